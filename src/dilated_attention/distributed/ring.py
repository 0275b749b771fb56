"""Ring attention: exact dense attention over a sequence sharded across the ranks of a group.

Algorithm (forward), for P ranks, each holding N/P queries and the K/V of the same positions:
queries stay on their rank; k and v (only the kv heads, each in its own (B, N/P, Hkv, D) layout)
travel round the ring rank -> rank+1 in P-1 steps, as one batch of isend/irecv. At step t, rank r
computes its queries against the block of rank ``(r - t) % P`` while the next block is already in
flight (:class:`.comm.RingComm`), and merges the partial output into an fp32 accumulator by LSE (the
stable form of :func:`..merge.merge_partial`, written in place). The backward sends (k, v) round
the ring again and the fp32 dK and dV accumulators of each block (a pair, one batch) round a second
ring, one hop behind; after P hops each rank holds the gradient of its own K/V. Each block's
backward runs with the FINAL output and LSE (:func:`..kernels.local.attn_bwd`), which gives exact
gradients.

Causal: with ``layout="contiguous"`` blocks from later ranks are skipped (still forwarded) and the
own block is causal; rank P-1 does P times the work of rank 0. With ``layout="zigzag"`` (rank r
holds chunks r and 2P-1-r of 2P) every step costs every rank the same: the own block is causal,
a block from an earlier rank is seen by all local queries through its first chunk only, and a
block from a later rank is seen only by the local late chunk, through both of its chunks.

Memory per rank, in units of T = one local (B, N/P, H, D) tensor in the input dtype (bf16; an fp32
buffer is 2T; K/V are smaller under GQA). Forward, besides q, k, v (3T): the fp32 output
accumulator (2T, in (B, N/P, H, D) layout, so the returned output is its cast and is also what the
backward saves: no second copy in another layout), one step's partial output (1T) and the
travelling k, v: the pair in flight (2T) and, from the second step on, the pair being computed
(2T; the first step computes on the inputs themselves): 8T at P = 2, 10T at P >= 3. No K/V copy
is made unless k or v is not contiguous. Backward: the saved q, k, v, out and dout (5T), the fp32
dq (2T), the travelling k, v (2T at P = 2, 4T at P >= 3), the fp32 dK/dV pair being sent and the
pair being received (8T) and one block's dq/dk/dv partials (3T): 20T at P = 2, 22T at P >= 3, plus
the attention kernel's workspace; the final casts to the input dtype come one accumulator at a
time after the rings. All O(N/P), independent of P.
Communication per rank: (P-1) K/V blocks forward; (P-1) K/V blocks + P fp32 dK/dV blocks backward.
"""

from __future__ import annotations

import struct

import torch

from ..api import check_qkv, resolve_scale
from ..autograd_rules import autocast_inputs, backward_context, no_double_backward
from ..kernels.local import attn_bwd, attn_fwd
from ..merge import merge_partial_
from .comm import (
    BufferTracker,
    RingComm,
    check_same_across_ranks,
    dtype_code,
    resolve_group,
    world_and_rank,
)
from .layout import LAYOUTS, check_layout

_LAST_STATS: dict = {}


def last_ring_stats() -> dict:
    """Communication / memory counters of the last ring forward and backward on this rank.

    Keys: ``fwd_bytes_sent``, ``fwd_peak_ring_bytes`` (peak bytes of received blocks alive at
    once), ``bwd_bytes_sent``, ``bwd_peak_ring_bytes`` (received K/V and dK/dV buffers and this
    rank's own dK/dV accumulators), ``kv_block_bytes`` (one local k plus v, in bytes),
    ``world``. Tests use it to check that ring memory does not grow with P.
    """
    return dict(_LAST_STATS)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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

    Returns the output accumulator (B, Nl, H, D) (fp32, fp64 for fp64), lse (B, H, Nl), bytes sent.
    """
    b, nl, h, _ = q.shape
    adt = _acc_dtype(q)
    qt = _t(q)
    acc = torch.empty(b, nl, h, v.shape[-1], dtype=adt, device=q.device)
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
            else:
                merge_partial_(_t(acc)[:, :, qs], acc_lse[:, :, qs], o, lse)
            del o, lse
        if nxt is not None:
            comm.wait()
            k, v = nxt  # drops the previous travelling block
            nxt = None
    return acc, acc_lse, (comm.bytes_sent if comm else 0)


def _ring_backward(do, q, k, v, out, lse, group, world, rank, scale, causal, layout, tracker):
    """do, q, out: (B, Nl, H, D); k, v: (B, Nl, Hkv, D) contiguous; lse: (B, H, Nl).

    Returns dq, dk, dv in the input dtypes (B, Nl, H|Hkv, D), and the bytes sent.
    """
    nl = q.shape[1]
    adt = _acc_dtype(q)
    dt_q, dt_k, dt_v = q.dtype, k.dtype, v.dtype
    dot, qt, ot = _t(do), _t(q), _t(out)
    kv_comm = RingComm(group, tracker, tag=1) if world > 1 else None
    dkv_comm = RingComm(group, tracker, tag=2) if world > 1 else None
    dq = dk = dv = dkv_in = None
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = (kv_comm.send_recv(k), kv_comm.send_recv(v))
            kv_comm.commit()
        plan = _step_plan(rank, (rank - step) % world, causal, layout, nl)
        dk_s = dv_s = None
        if plan is not None:
            qs, ks, c = plan
            dq_s, dk_s, dv_s = attn_bwd(
                dot[:, :, qs], qt[:, :, qs], _t(k)[:, :, ks], _t(v)[:, :, ks], ot[:, :, qs],
                lse[:, :, qs], scale, c,
            )
            if step == 0:  # own block: all rows; the fp32 dq starts as its gradient
                dq = torch.empty(q.shape, dtype=adt, device=q.device)
                _t(dq).copy_(dq_s)
            else:
                _t(dq)[:, :, qs] += dq_s
            del dq_s
        # the dK/dV accumulators of the block we hold now arrive one hop behind the block itself
        if step == 0:
            dk = tracker.track(torch.empty(k.shape, dtype=adt, device=k.device))
            _t(dk).copy_(dk_s)
            del dk_s
            dv = tracker.track(torch.empty(v.shape, dtype=adt, device=v.device))
            _t(dv).copy_(dv_s)
            del dv_s
        else:
            dkv_comm.wait()
            dk, dv = dkv_in
            dkv_in = None
            if plan is not None:
                _t(dk)[:, :, ks] += dk_s
                del dk_s
                _t(dv)[:, :, ks] += dv_s
                del dv_s
        if world > 1:
            dkv_in = (dkv_comm.send_recv(dk), dkv_comm.send_recv(dv))
            dkv_comm.commit()
            dk = dv = None  # the send holds them until the next wait
        if nxt is not None:
            kv_comm.wait()
            k, v = nxt
            nxt = None
    del k, v, dot, qt, ot
    dq_out = dq.to(dt_q)  # while the last dK/dV hop is in flight
    del dq
    if world > 1:
        dkv_comm.wait()
        dk, dv = dkv_in  # after P hops: the gradient of this rank's own K/V
        dkv_in = None
    # one fp32 accumulator at a time next to its cast (a no-op in the accumulator dtype)
    dk_out = dk.to(dt_k)
    del dk
    dv_out = dv.to(dt_v)
    del dv
    sent = (kv_comm.bytes_sent + dkv_comm.bytes_sent) if world > 1 else 0
    return dq_out, dk_out, dv_out, sent


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, world, rank, scale, causal, layout):
        # q: (B, Nl, H, D); k, v: (B, Nl, Hkv, D)
        tracker = BufferTracker()
        kc, vc = k.contiguous(), v.contiguous()  # no copy when already contiguous
        acc, acc_lse, sent = _ring_forward(
            q, kc, vc, group, world, rank, scale, causal, layout, tracker
        )
        _LAST_STATS.update(
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
        ctx.scale, ctx.causal, ctx.layout = scale, causal, layout
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
        _LAST_STATS.update(bwd_bytes_sent=sent, bwd_peak_ring_bytes=tracker.peak_live_bytes)
        dq, dk, dv = no_double_backward("ring_attention", (dq, dk, dv), (dout_in, q, k, v))
        return dq, dk, dv, None, None, None, None, None, None


def _validate(q, k, v, causal, scale, layout, group, validate: bool):
    """Local checks, then one cross-rank descriptor check (the same error on every rank)."""
    world, _ = world_and_rank(group)
    local_error = None
    try:
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
    except (TypeError, ValueError) as e:
        if world == 1 or not validate:
            raise
        local_error = str(e)
    if world == 1 or not validate:
        return
    names = ["batch", "seqlen_q (shard)", "nheads", "headdim", "batch (k)", "seqlen_k (shard)",
             "nheads_kv", "headdim (k)", "dtype", "causal", "layout", "softmax_scale (float64 bits)"]
    if local_error:
        desc = [0] * len(names)
    else:
        scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
        desc = [*q.shape, *k.shape, dtype_code(q.dtype), int(causal), LAYOUTS.index(layout), scale_bits]
    like = q if isinstance(q, torch.Tensor) else torch.empty(0)
    check_same_across_ranks(group, desc, names, like, "ring_attention", local_error)


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

    Returns:
        out (batch, N/P, nheads, headdim) in q's dtype, this rank's shard of the global output;
        or ``(out, lse)``. Gradients flow to q, k, v in their dtypes. ``out`` itself is saved for
        the backward (as SDPA does): changing it in place before the backward makes autograd
        raise its in-place error.
    """
    q, k, v, amp_device = autocast_inputs(q, k, v)
    if amp_device is not None:  # the SDPA rule (docs/autocast.md): cast once, run with autocast off
        with torch.autocast(amp_device, enabled=False):
            return ring_attention(
                q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
                return_lse=return_lse, validate=validate,
            )
    group = resolve_group(group)
    world, rank = world_and_rank(group)
    scale = resolve_scale(softmax_scale, q.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() == 4 else 1.0
    causal = bool(causal)
    _validate(q, k, v, causal, scale, layout, group, validate)
    # world and rank travel explicitly: group=None would mean the default group inside
    out, lse = _RingAttentionFunction.apply(q, k, v, group, world, rank, scale, causal, layout)
    return (out, lse) if return_lse else out
