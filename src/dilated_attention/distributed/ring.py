"""Ring attention: exact dense attention over a sequence sharded across the ranks of a group.

Algorithm (forward), for P ranks, each holding N/P queries and the K/V of the same positions:
queries stay on their rank; k and v (only the kv heads, each in its own (B, N/P, Hkv, D) layout)
travel round the ring rank -> rank+1 in P-1 steps, as one batch of isend/irecv. At step t, rank r
computes its queries against the block of rank ``(r - t) % P`` while the next block is already in
flight (:class:`.comm.RingComm`), and merges the partial output by LSE (the stable form of
:func:`..merge.merge_partial`, in place). Each block's backward runs with the FINAL output and LSE
(:func:`..kernels.block_attention.attn_bwd`), which gives exact gradients.

Exactness: results equal those of float32 accumulators everywhere (an fp32 output accumulator
merged in step order, fp32 dq, fp32 dK/dV accumulators adding their partials in step order; fp64
for fp64 inputs), bit for bit, at every P:
- P = 2: every output, dq, dk and dv element combines exactly two partials, which the block
  kernels produce in the input dtype. The running output stays in the input dtype and the merge
  of the second partial runs in fp32 a row chunk at a time, rounded once. The backward adds the
  two gradient partials in place in the input dtype: for bf16/fp16 torch computes the sum in
  fp32 and rounds once, which is fp32 accumulation followed by the cast. Backward order: the
  partner's K/V arrive, its block is computed, the dK/dV partials are exchanged (each rank gets
  those of its own block), then the own block is computed and the partials added to its results.
- P >= 3: fp32 output and dq accumulators as before. K/V travel round the ring again in the
  backward; the dK/dV partials of the block computed at step t go straight to the block's owner
  in the input dtype (widening them there is exact), overlapped with the next step, and the owner
  adds them in step order into one fp32 accumulator pair for its own block only.

Causal: with ``layout="contiguous"`` blocks from later ranks are skipped (still forwarded) and the
own block is causal; rank P-1 does P times the work of rank 0. With ``layout="zigzag"`` (rank r
holds chunks r and 2P-1-r of 2P) every step costs every rank the same: the own block is causal,
a block from an earlier rank is seen by all local queries through its first chunk only, and a
block from a later rank is seen only by the local late chunk, through both of its chunks.

Memory per rank, in units of T = one local (B, N/P, H, D) tensor in the input dtype (bf16; an fp32
buffer is 2T; K/V are smaller under GQA; causal blocks of other ranks are half-sized), besides
q, k, v, out and dout, and besides the attention kernel's workspace:
- forward, P = 2: the output (1T, it is also what the backward saves), the partner's k, v (2T),
  its partial output (1T) and a T/4 fp32 merge chunk. P >= 3: the fp32 output accumulator (2T),
  the k, v in flight and those being computed (4T) and the step's partial output (1T).
- backward, P = 2: at most 6T: the partner's k, v and the partials computed on them (5T), then
  the partner's dK/dV partials of our block (2T), our dq rows of its block (1T) and the own
  block's dq, dk, dv (3T). The K/V and partial exchanges are not overlapped with compute.
  P >= 3: fp32 dq and own dK/dV accumulators (6T), two k, v pairs (4T), the partials sent and
  received (4T) and the step's partials (3T): 17T. All O(N/P), independent of P.
Communication per rank: (P-1) K/V blocks forward; (P-1) K/V blocks and at most (P-1) dK/dV
partial blocks in the input dtype backward.
"""

from __future__ import annotations

import torch

from ..autograd_rules import autocast_inputs, backward_context, no_double_backward
from ..checks import (
    check_bool,
    check_cu_seqlens_meta,
    check_cu_seqlens_values,
    check_qkv,
    resolve_scale,
)
from ..kernels.block_attention import attn_bwd, attn_fwd
from ..merge import acc_dtype, merge_partial_
from .comm import (
    RING_NAMES,
    BufferTracker,
    RingComm,
    dtype_code,
    float_bits,
    resolve_group,
    validate_across_ranks,
    world_and_rank,
)
from .layout import LAYOUTS, check_layout


def _step_plan(rank: int, src: int, causal: bool, layout: str, n_local: int):
    """Which local query rows meet which rows of the block from rank ``src`` at this step.

    Returns ``(q_rows, kv_rows, causal_block)`` as slices, or None when nothing is attended.
    """
    full = slice(None)
    if not causal:
        return full, full, False
    if src == rank:
        return full, full, True  # positions increase within a shard in both layouts
    if layout == "contiguous":
        return (full, full, False) if src < rank else None
    c = n_local // 2
    if src < rank:  # block chunks (src, 2P-1-src): only chunk src is in the past of all our queries
        return full, slice(0, c), False
    # src > rank: our early chunk r precedes both block chunks; our late chunk follows both
    return slice(c, None), full, False


def _t(x: torch.Tensor) -> torch.Tensor:
    """(B, N, H, D) <-> (B, H, N, D) view: the kernels take SDPA's layout, we store (B, N, H, D)."""
    return x.transpose(1, 2)


def _ring_forward(q, k, v, group, world, rank, scale, causal, layout, tracker):
    """q: (B, Nl, H, D); k, v: (B, Nl, Hkv, D) contiguous (they travel as they are).

    Returns the output (B, Nl, H, D) (in the input dtype at P = 2, else the fp32 accumulator;
    fp64 for fp64), lse (B, H, Nl) in the accumulator dtype, bytes sent.
    """
    b, nl, h, _ = q.shape
    adt = acc_dtype(q.dtype)
    qt = _t(q)
    # P = 2: out is the merge of exactly two partials, computed in the accumulator dtype a row
    # chunk at a time and rounded once; the running output can live in the input dtype
    out_dt = q.dtype if world == 2 else adt
    acc = torch.empty(b, nl, h, v.shape[-1], dtype=out_dt, device=q.device)
    acc_lse = torch.empty((b, h, nl), dtype=adt, device=q.device)
    comm = RingComm(group, tracker, tag=0) if world > 1 else None
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = (comm.send_recv(k), comm.send_recv(v))  # one batch: k and v together
            comm.commit()
        plan = _step_plan(rank, (rank - step) % world, causal, layout, nl)
        if plan is not None:
            qs, ks, c = plan
            o, lse = attn_fwd(qt[:, :, qs], _t(k)[:, :, ks], _t(v)[:, :, ks], scale, c)
            if step == 0:  # the own block (all rows, always attended): the accumulators start as it
                _t(acc).copy_(o)
                acc_lse.copy_(lse)
            elif out_dt == adt:
                merge_partial_(_t(acc)[:, :, qs], acc_lse[:, :, qs], o, lse)
            else:
                _merge_second_partial_(_t(acc)[:, :, qs], acc_lse[:, :, qs], o, lse)
            del o, lse
        if nxt is not None:
            comm.wait()
            k, v = nxt  # drops the previous travelling block
            nxt = None
    return acc, acc_lse, (comm.bytes_sent if comm else 0)


_MERGE_CHUNKS = 8  # the fp32 temporary of the P = 2 merge is 1/8 of the output in fp32


def _merge_second_partial_(out, lse_acc, out_b, lse_b) -> None:
    """:func:`..merge.merge_partial_` for an ``out`` held in a lower precision than ``lse_acc``.

    Every output element goes through the same operations as in ``merge_partial_`` on an fp32
    copy of ``out`` (an exact widening): the weights are computed once on the whole LSE, then
    ``mul_`` and ``addcmul_`` run on an fp32 copy of one chunk of query rows, which is rounded
    back into ``out``. Elementwise results do not depend on the chunking, so this equals the
    fp32 accumulator followed by one cast, bit for bit, with an fp32 temporary of 1/8 of ``out``.
    out: (B, H, Nq, D) strided view; lse_acc: (B, H, Nq), updated in place.
    """
    lse_b = lse_b.to(lse_acc.dtype)
    lse = torch.logaddexp(lse_acc, lse_b)
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_acc - shift).unsqueeze(-1)
    w_b = torch.exp(lse_b - shift).unsqueeze(-1)
    lse_acc.copy_(lse)
    n = out.shape[2]
    step = max(1, -(-n // _MERGE_CHUNKS))
    for r0 in range(0, n, step):
        rows = slice(r0, r0 + step)
        tmp = out[:, :, rows].to(lse_acc.dtype)
        tmp.mul_(w_a[:, :, rows])
        tmp.addcmul_(out_b[:, :, rows], w_b[:, :, rows])
        out[:, :, rows].copy_(tmp)
        del tmp


def _block_bwd(dot, qt, ot, lse, kt, vt, plan, scale):
    qs, ks, c = plan
    return attn_bwd(dot[:, :, qs], qt[:, :, qs], kt[:, :, ks], vt[:, :, ks], ot[:, :, qs],
                    lse[:, :, qs], scale, c)


def _rows(sl: slice, n: int) -> int:
    return len(range(*sl.indices(n)))


def _partial_buf(k, plan, nl) -> torch.Tensor:
    """Receive buffer for one dK or dV partial of this rank's block, in the (B, rows, Hkv, D)
    layout partials travel in (the sender computed ``plan`` on our block)."""
    b, _, hkv, d = k.shape
    return torch.empty(b, _rows(plan[1], nl), hkv, d, dtype=k.dtype, device=k.device)


def _travelling(x_sdpa: torch.Tensor) -> torch.Tensor:
    """A (B, H, rows, D) block gradient in the (B, rows, H, D) layout it travels and is returned
    in (no copy when the kernel wrote it in that layout)."""
    return _t(x_sdpa).contiguous()


def _ring_backward(do, q, k, v, out, lse, group, world, rank, scale, causal, layout, tracker):
    """do, q, out: (B, Nl, H, D); k, v: (B, Nl, Hkv, D) contiguous; lse: (B, H, Nl).

    Returns dq, dk, dv in the input dtypes (B, Nl, H|Hkv, D), and the bytes sent.
    """
    if world == 1:
        dq, dk, dv = attn_bwd(_t(do), _t(q), _t(k), _t(v), _t(out), lse, scale, causal)
        return _travelling(dq), _travelling(dk), _travelling(dv), 0
    if world == 2:
        return _pair_backward(do, q, k, v, out, lse, group, rank, scale, causal, layout, tracker)
    return _owner_backward(do, q, k, v, out, lse, group, world, rank, scale, causal, layout, tracker)


def _pair_backward(do, q, k, v, out, lse, group, rank, scale, causal, layout, tracker):
    """P = 2. Every dq/dk/dv element is the sum of exactly two partials, each produced in the
    input dtype by the block kernel; adding them in place in the input dtype computes the sum in
    fp32 (torch's opmath for bf16/fp16) and rounds once: the same bits as an fp32 accumulator
    followed by one cast (the addition commutes, so the order of the two does not matter).

    Order, chosen for the peak: exchange K/V, compute the partner's block, exchange the dK/dV
    partials (each rank receives those of its own block), then compute the own block and add
    into its results. During the own block only the partner's partials (dq rows, dK, dV of
    our block) are held besides the kernel's outputs; the two exchanges are not overlapped.
    """
    nl = q.shape[1]
    other = 1 - rank
    dot, qt, ot = _t(do), _t(q), _t(out)
    comm = RingComm(group, tracker, tag=1)
    kr, vr = comm.send_recv(k), comm.send_recv(v)
    comm.commit()
    comm.wait()
    plan = _step_plan(rank, other, causal, layout, nl)  # our queries on the partner's block
    dq_o = dk_o = dv_o = None
    if plan is not None:
        dq_o, dk_o, dv_o = _block_bwd(dot, qt, ot, lse, _t(kr), _t(vr), plan, scale)
    del kr, vr
    if plan is not None:  # one at a time: a copy only where the kernel's layout differs
        dk_o = _travelling(dk_o)
        dv_o = _travelling(dv_o)
    in_plan = _step_plan(other, rank, causal, layout, nl)  # the partner's queries on our block
    rdk = rdv = None
    if in_plan is not None:
        rdk, rdv = _partial_buf(k, in_plan, nl), _partial_buf(v, in_plan, nl)
    pcomm = RingComm(group, tracker, tag=2)
    pcomm.exchange(dk_o, other if dk_o is not None else None, rdk, other if rdk is not None else None)
    pcomm.exchange(dv_o, other if dv_o is not None else None, rdv, other if rdv is not None else None)
    pcomm.commit()
    pcomm.wait()
    del dk_o, dv_o
    dq, dk, dv = attn_bwd(dot, qt, _t(k), _t(v), ot, lse, scale, causal)
    if plan is not None:
        dq[:, :, plan[0]] += dq_o
        del dq_o
    if in_plan is not None:
        dk[:, :, in_plan[1]] += _t(rdk)
        del rdk
        dv[:, :, in_plan[1]] += _t(rdv)
        del rdv
    del dot, qt, ot
    sent = comm.bytes_sent + pcomm.bytes_sent
    return _travelling(dq), _travelling(dk), _travelling(dv), sent


def _owner_backward(do, q, k, v, out, lse, group, world, rank, scale, causal, layout, tracker):
    """P >= 3. K/V travel round the ring as in the forward; at step t the dK/dV partials of the
    block of rank ``src = (r - t) % P`` go straight to ``src`` (in the input dtype, the dtype the
    block kernel produces them in: widening them later is exact), and the partials of our own
    block computed at step t by rank ``(r + t) % P`` arrive, overlapped with step t + 1. Each
    rank keeps one fp32 dK/dV accumulator, for its own block only, and adds its partials in step
    order, as the fp32 accumulators that travelled round a second ring did: the same sums.
    dq is accumulated locally in fp32, in step order.
    """
    nl = q.shape[1]
    adt = acc_dtype(q.dtype)
    dt_q, dt_k, dt_v = q.dtype, k.dtype, v.dtype
    dot, qt, ot = _t(do), _t(q), _t(out)
    kv_comm = RingComm(group, tracker, tag=1)
    p_comm = RingComm(group, tracker, tag=2)
    dq = dk = dv = None
    pending = None  # (rows of our block, dK partial, dV partial) arriving from the last step
    kk, vv = k, v
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = (kv_comm.send_recv(kk), kv_comm.send_recv(vv))
            kv_comm.commit()
        src = (rank - step) % world
        plan = _step_plan(rank, src, causal, layout, nl)
        dk_s = dv_s = None
        if plan is not None:
            dq_s, dk_s, dv_s = _block_bwd(dot, qt, ot, lse, _t(kk), _t(vv), plan, scale)
            if step == 0:  # own block: all rows; the fp32 dq and dK/dV start as its gradients
                dq = torch.empty(q.shape, dtype=adt, device=q.device)
                _t(dq).copy_(dq_s)
                del dq_s
                dk = tracker.track(torch.empty(k.shape, dtype=adt, device=k.device))
                _t(dk).copy_(dk_s)
                del dk_s
                dv = tracker.track(torch.empty(v.shape, dtype=adt, device=v.device))
                _t(dv).copy_(dv_s)
                del dv_s
            else:
                _t(dq)[:, :, plan[0]] += dq_s
                del dq_s
                dk_s = _travelling(dk_s)
                dv_s = _travelling(dv_s)
        if step > 0:  # the partials of step - 1 (ours arrived, ours sent): add in step order
            p_comm.wait()
            if pending is not None:
                rows, pdk, pdv = pending
                dk[:, rows] += pdk
                del pdk
                dv[:, rows] += pdv
                del pdv
            pending = None
        if step > 0:
            # to the owner of the block just computed; from the rank that computed on ours
            sender = (rank + step) % world
            in_plan = _step_plan(sender, rank, causal, layout, nl)
            rdk = rdv = None
            if in_plan is not None:
                rdk, rdv = _partial_buf(k, in_plan, nl), _partial_buf(v, in_plan, nl)
                pending = (in_plan[1], rdk, rdv)
            dst = src if dk_s is not None else None
            p_comm.exchange(dk_s, dst, rdk, sender if rdk is not None else None)
            p_comm.exchange(dv_s, dst, rdv, sender if rdv is not None else None)
            p_comm.commit()
            del dk_s, dv_s, rdk, rdv  # the pending batch holds them until its wait
        if nxt is not None:
            kv_comm.wait()
            kk, vv = nxt
            nxt = None
    del kk, vv
    dq_out = dq.to(dt_q)  # while the last partials are in flight
    del dq
    p_comm.wait()
    if pending is not None:
        rows, pdk, pdv = pending
        dk[:, rows] += pdk
        dv[:, rows] += pdv
        del pdk, pdv
    pending = None
    del dot, qt, ot
    # one fp32 accumulator at a time next to its cast (a no-op in the accumulator dtype)
    dk_out = dk.to(dt_k)
    del dk
    dv_out = dv.to(dt_v)
    del dv
    return dq_out, dk_out, dv_out, kv_comm.bytes_sent + p_comm.bytes_sent


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, world, rank, scale, causal, layout, stats):
        # q: (B, Nl, H, D); k, v: (B, Nl, Hkv, D); stats: the caller's dict or None
        tracker = BufferTracker()
        kc, vc = k.contiguous(), v.contiguous()  # no copy when already contiguous
        acc, acc_lse, sent = _ring_forward(
            q, kc, vc, group, world, rank, scale, causal, layout, tracker
        )
        if stats is not None:
            stats.clear()
            stats.update(
                fwd_bytes_sent=sent, fwd_peak_ring_bytes=tracker.peak_live_bytes,
                kv_block_bytes=kc.numel() * kc.element_size() + vc.numel() * vc.element_size(),
                world=world,
            )
        del kc, vc
        out = acc.to(q.dtype)  # (B, Nl, H, D) contiguous; the accumulator itself for fp32 inputs
        del acc
        if any(ctx.needs_input_grad[:3]):
            # the inputs as given (no extra copies kept between forward and backward) and the
            # returned output itself (no second copy in another layout)
            ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.scale, ctx.causal, ctx.layout, ctx.stats = scale, causal, layout, stats
        lse = acc_lse.to(torch.float32)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout_in = dout
        with backward_context(q.device.type):
            if dout.stride(-1) != 1:
                dout = dout.contiguous()
            tracker = BufferTracker()
            dq, dk, dv, sent = _ring_backward(
                dout, q, k.contiguous(), v.contiguous(), out, lse, ctx.group, ctx.world, ctx.rank,
                ctx.scale, ctx.causal, ctx.layout, tracker,
            )
        if ctx.stats is not None:
            ctx.stats.update(bwd_bytes_sent=sent, bwd_peak_ring_bytes=tracker.peak_live_bytes)
        dq, dk, dv = no_double_backward("ring_attention", (dq, dk, dv), (dout_in, q, k, v))
        return dq, dk, dv, None, None, None, None, None, None, None


def _validate(q, k, v, causal, scale, layout, group, validate: bool):
    """Local checks, then one cross-rank descriptor check (the same error on every rank)."""
    world, _ = world_and_rank(group)

    def local_checks():
        check_qkv(q, k, v, "ring_attention")
        check_layout(layout)
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"ring_attention: each rank must pass q, k, v shards of one length, got seqlen_q "
                f"{q.shape[1]} and seqlen_k {k.shape[1]}"
            )
        if layout == "zigzag" and world > 1 and q.shape[1] % 2:
            raise ValueError(
                f"ring_attention: layout='zigzag' needs an even shard length (global N divisible "
                f"by 2P = {2 * world}), got a shard of {q.shape[1]}; pad the sequence"
            )

    names = RING_NAMES

    def describe():
        return [*q.shape, *k.shape, dtype_code(q.dtype), int(causal), LAYOUTS.index(layout),
                float_bits(scale)]

    like = q if isinstance(q, torch.Tensor) else torch.empty(0)
    validate_across_ranks(group, "ring_attention", local_checks, describe, names, like, validate)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    validate: bool = True,
    stats: dict | None = None,
    cu_seqlens=None,
):
    """Exact dense attention over a sequence sharded along dim 1 across the ranks of ``group``.

    Every rank calls this with its shard of the global sequence, as produced by
    ``shard_sequence(x, group, layout)``.

    Args:
        q: (batch, N/P, nheads, headdim), this rank's queries.
        k, v: (batch, N/P, nheads_kv, headdim), the K/V of the same positions
            (``nheads % nheads_kv == 0``; only the kv heads travel).
        group: a ``ProcessGroup`` (a subgroup is fine), a 1-D ``DeviceMesh``, or ``(mesh, dim)``
            for one dimension of a larger mesh (equivalently pass ``mesh.get_group(dim)``).
            ``None``: the default group when ``torch.distributed`` is initialised, else one rank.
        causal: global causal mask (key position <= query position).
        softmax_scale: default ``headdim ** -0.5``.
        layout: ``"contiguous"`` or ``"zigzag"`` (load-balanced for causal; N % 2P == 0).
        return_lse: also return lse (batch, nheads, N/P) float32, natural log (not differentiable).
        validate: all-gather a 12-int descriptor of the inputs once per call, so that mismatched
            shapes / dtypes / options raise the same clear ``ValueError`` on every rank instead of
            hanging. Costs one tiny collective and one host sync per call; pass False to skip it.
        stats: a dict to receive this rank's communication and memory counters: the forward
            fills ``fwd_bytes_sent``, ``fwd_peak_ring_bytes`` (peak bytes of received blocks alive
            at once), ``kv_block_bytes`` (one local k plus v) and ``world``; the backward adds
            ``bwd_bytes_sent`` and ``bwd_peak_ring_bytes`` (received K/V blocks and dK/dV
            partials, and at P >= 3 this rank's fp32 dK/dV accumulators). Nothing is kept in the
            module. With ``cu_seqlens``: ``fwd_bytes_sent``, ``bwd_bytes_sent``, ``world``.
        cu_seqlens: packed documents (flash-attn's varlen offsets): the GLOBAL offsets
            (docs + 1,) of one packed stream of N tokens, the same on every rank, as a CPU or
            device integer tensor or a list of ints (the plan is built from host values: device
            offsets are read once, one sync). q is then this rank's shard ``(N/P, nheads,
            headdim)`` (or one packed row ``(1, N/P, nheads, headdim)``) and the output and lse
            (``(nheads, N/P)``, or ``(1, nheads, N/P)``) have the same form. Each query attends
            to the keys of its own document only (causal: at or before it); documents may cross
            rank boundaries and need no padding (only ``N % P == 0``, zigzag ``N % 2P == 0``).
            The K/V rows of a document travel only to the other ranks that hold queries of that
            document (with ``causal`` only to later positions), directly, not round the ring: a
            document inside one shard costs no communication
            (:func:`.sequence_parallel.dilated_attention_sp_varlen` with one dense branch).

    Returns:
        out (batch, N/P, nheads, headdim) in q's dtype, this rank's shard of the global output;
        or ``(out, lse)``. Gradients flow to q, k, v in their dtypes. ``out`` itself is saved for
        the backward (as SDPA does): changing it in place before the backward makes autograd
        raise its in-place error.
    """
    q, k, v, amp_device = autocast_inputs(q, k, v)
    args = (q, k, v, group, causal, softmax_scale, layout, return_lse, validate, stats, cu_seqlens)
    if amp_device is not None:  # the SDPA rule (docs/autocast.md): cast once, run with autocast off
        with torch.autocast(amp_device, enabled=False):
            return _ring(*args)
    return _ring(*args)


def _ring(q, k, v, group, causal, softmax_scale, layout, return_lse, validate, stats, cu_seqlens):
    """:func:`ring_attention` after its autocast rule (the public function does not call itself
    again)."""
    group = resolve_group(group)
    world, rank = world_and_rank(group)
    scale = resolve_scale(softmax_scale, q.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() in (3, 4) else 1.0
    causal = check_bool("causal", causal)
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"ring_attention: stats must be a dict to fill or None, got {type(stats).__name__}")
    if cu_seqlens is not None:
        return _packed(q, k, v, cu_seqlens, group, world, causal, scale, layout, return_lse,
                       validate, stats)
    _validate(q, k, v, causal, scale, layout, group, validate)
    # world and rank travel explicitly: group=None would mean the default group inside
    out, lse = _RingAttentionFunction.apply(q, k, v, group, world, rank, scale, causal, layout, stats)
    return (out, lse) if return_lse else out


def _packed(q, k, v, cu_seqlens, group, world, causal, scale, layout, return_lse, validate, stats):
    """``ring_attention(cu_seqlens=...)``: dense attention inside each document of a packed
    stream, sharded over the ranks: one dense branch (w >= every document, r = 1) of the packed
    sequence-parallel plan (:func:`.sequence_parallel.dilated_attention_sp_varlen`)."""
    from .sequence_parallel import dilated_attention_sp_varlen, sp_varlen_arg_error

    name = "ring_attention"
    names = ("cu_seqlens", "cu_seqlens")
    try:
        q3, k3, v3, row, cu = _packed_args(q, k, v, cu_seqlens, name, names)
    except (TypeError, ValueError) as e:  # on every rank, not only here (the others would wait)
        sp_varlen_arg_error(group, e, (q, k, v, cu_seqlens), name, validate)
    n_local = q3.shape[0]
    n = world * n_local

    def checks():
        check_qkv(q3[None], k3[None], v3[None], name)
        check_layout(layout)
        if q3.shape[0] != k3.shape[0]:
            raise ValueError(
                f"{name}: each rank must pass q, k, v shards of one length, got {q3.shape[0]} "
                f"query and {k3.shape[0]} key rows"
            )
        where = f"the global stream: P = {world} ranks x {n_local} rows of this rank's shard"
        check_cu_seqlens_values(cu, cu, n, n, None, None, name, (where, where), names)
        if layout == "zigzag" and n_local % 2:
            raise ValueError(
                f"{name}: layout='zigzag' cuts the stream into 2P = {2 * world} equal chunks, so "
                f"the stream length N = {n} must be a multiple of {2 * world} (each rank an even "
                f"shard, got {n_local}); append one filler document to the stream, or use "
                "layout='contiguous' (N % P == 0)"
            )

    out, lse = dilated_attention_sp_varlen(
        q3, k3, v3, cu, (max(n, 1),), (1,), causal=causal, scale=scale, head_assignment="all",
        impl="torch", group=group, layout=layout, local_checks=checks, name=name, report=stats,
        validate=validate,
    )
    if stats is not None:
        stats.pop("branches", None)
    if row:
        out, lse = out[None], lse[None]
    return (out, lse) if return_lse else out


def _packed_args(q, k, v, cu_seqlens, name, names):
    """The type and shape checks of ``_packed`` that come before the offsets can be read:
    (q, k, v as (N/P, heads, headdim), whether they came as one packed row, host offsets)."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
    row = q.dim() == 4
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != q.dim() or t.dim() not in (3, 4) or (row and t.shape[0] != 1):
            raise ValueError(
                f"{name}: with cu_seqlens, q, k, v must be this rank's shard of one packed stream, "
                f"(N/P, heads, headdim) or one packed row (1, N/P, heads, headdim); got {n} of "
                f"shape {tuple(t.shape)} (q {tuple(q.shape)})"
            )
    q3, k3, v3 = (q[0], k[0], v[0]) if row else (q, k, v)
    if isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens
    ):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    check_cu_seqlens_meta(cu_seqlens, cu_seqlens, q.device, name, names)
    cu = [int(x) for x in cu_seqlens.tolist()]  # one sync for device offsets
    return q3, k3, v3, row, cu
