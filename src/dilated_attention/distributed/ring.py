"""Ring attention: exact dense attention over a sequence sharded across the ranks of a group.

Algorithm (forward), for P ranks, each holding N/P queries and the K/V of the same positions:
queries stay on their rank; the (k, v) block (only the kv heads, packed into one buffer) travels
round the ring rank -> rank+1 in P-1 steps. At step t, rank r computes its queries against the
block of rank ``(r - t) % P`` while the next block is already in flight (batched isend/irecv,
:class:`.comm.RingComm`), and merges the partial output into an fp32 accumulator by LSE
(the stable form of :func:`..merge.merge_partial`, written in place). The backward sends (k, v) round the ring again and the fp32
dK/dV accumulator of each block round a second ring, one hop behind; after P hops each rank holds
the gradient of its own K/V. Each block's backward runs with the FINAL output and LSE
(:func:`..kernels.local.attn_bwd`), which gives exact gradients.

Causal: with ``layout="contiguous"`` blocks from later ranks are skipped (still forwarded) and the
own block is causal; rank P-1 does P times the work of rank 0. With ``layout="zigzag"`` (rank r
holds chunks r and 2P-1-r of 2P) every step costs every rank the same: the own block is causal,
a block from an earlier rank is seen by all local queries through its first chunk only, and a
block from a later rank is seen only by the local late chunk, through both of its chunks.

Memory per rank: the local q, k, v, out and lse, plus at most two travelling K/V blocks in the
forward, and two K/V blocks plus two fp32 dK/dV blocks in the backward: O(N/P), independent of P.
Communication per rank: (P-1) K/V blocks forward; (P-1) K/V blocks + P fp32 dK/dV blocks backward.
"""

from __future__ import annotations

import struct

import torch

from ..api import check_qkv, resolve_scale
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
    once), ``bwd_bytes_sent``, ``bwd_peak_ring_bytes``, ``kv_block_bytes`` (one local K/V block),
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


def _ring_forward(qt, kv, group, world, rank, scale, causal, layout, tracker):
    """qt: (B, H, Nl, D); kv: (2, B, Hkv, Nl, D) contiguous. Returns out acc, lse acc, bytes sent."""
    b, h, nl, _ = qt.shape
    adt = _acc_dtype(qt)
    acc_out = torch.zeros(b, h, nl, kv.shape[-1], dtype=adt, device=qt.device)
    acc_lse = torch.full((b, h, nl), float("-inf"), dtype=adt, device=qt.device)
    comm = RingComm(group, tracker, tag=0) if world > 1 else None
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = comm.send_recv(kv)
            comm.commit()
        plan = _step_plan(rank, (rank - step) % world, causal, layout, nl)
        if plan is not None:
            qs, ks, c = plan
            o, lse = attn_fwd(qt[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, c)
            merge_partial_(acc_out[:, :, qs], acc_lse[:, :, qs], o, lse)
            del o, lse
        if nxt is not None:
            comm.wait()
            kv = nxt  # drops the previous travelling block
    return acc_out, acc_lse, (comm.bytes_sent if comm else 0)


def _ring_backward(dot, qt, kv, out, lse, group, world, rank, scale, causal, layout, tracker):
    """All in (B, H|Hkv, Nl, D) layout; kv: (2, B, Hkv, Nl, D). Returns dq (acc), dkv (acc), bytes."""
    nl = qt.shape[2]
    adt = _acc_dtype(qt)
    dq = torch.zeros(qt.shape, dtype=adt, device=qt.device)
    kv_comm = RingComm(group, tracker, tag=1) if world > 1 else None
    dkv_comm = RingComm(group, tracker, tag=2) if world > 1 else None
    dkv_in = None
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = kv_comm.send_recv(kv)
            kv_comm.commit()
        plan = _step_plan(rank, (rank - step) % world, causal, layout, nl)
        grads = None
        if plan is not None:
            qs, ks, c = plan
            dq_s, dk_s, dv_s = attn_bwd(
                dot[:, :, qs], qt[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
                lse[:, :, qs], scale, c,
            )
            dq[:, :, qs] += dq_s
            grads = (ks, dk_s, dv_s)
        # the dK/dV accumulator of the block we hold now arrives one hop behind the block itself
        if step == 0:
            dkv = tracker.track(torch.zeros(kv.shape, dtype=adt, device=kv.device))
        else:
            dkv_comm.wait()
            dkv = dkv_in
        if grads is not None:
            ks, dk_s, dv_s = grads
            dkv[0][:, :, ks] += dk_s
            dkv[1][:, :, ks] += dv_s
            del grads, dk_s, dv_s
        if world > 1:
            dkv_in = dkv_comm.send_recv(dkv)
            dkv_comm.commit()
            dkv = None  # the send holds it until the next wait
        if nxt is not None:
            kv_comm.wait()
            kv = nxt
    if world > 1:
        dkv_comm.wait()
        dkv = dkv_in  # after P hops: the gradient of this rank's own K/V
    sent = (kv_comm.bytes_sent + dkv_comm.bytes_sent) if world > 1 else 0
    return dq, dkv, sent


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, world, rank, scale, causal, layout):
        # q: (B, Nl, H, D); k, v: (B, Nl, Hkv, D)
        qt = q.transpose(1, 2)  # (B, H, Nl, D) view, as SDPA takes it
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()  # (2, B, Hkv, Nl, D)
        tracker = BufferTracker()
        acc_out, acc_lse, sent = _ring_forward(qt, kv, group, world, rank, scale, causal, layout, tracker)
        out_t = acc_out.to(q.dtype)  # (B, H, Nl, D)
        del acc_out
        _LAST_STATS.update(
            fwd_bytes_sent=sent, fwd_peak_ring_bytes=tracker.peak_live_bytes,
            kv_block_bytes=kv.numel() * kv.element_size(), world=world,
        )
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out_t, acc_lse)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.scale, ctx.causal, ctx.layout = scale, causal, layout
        lse = acc_lse.to(torch.float32)
        ctx.mark_non_differentiable(lse)
        return out_t.transpose(1, 2).contiguous(), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out_t, lse = ctx.saved_tensors
        dot = dout.transpose(1, 2)  # (B, H, Nl, D)
        if dot.stride(-1) != 1:
            dot = dot.contiguous()
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()
        tracker = BufferTracker()
        dq, dkv, sent = _ring_backward(
            dot, q.transpose(1, 2), kv, out_t, lse, ctx.group, ctx.world, ctx.rank, ctx.scale,
            ctx.causal, ctx.layout, tracker,
        )
        _LAST_STATS.update(bwd_bytes_sent=sent, bwd_peak_ring_bytes=tracker.peak_live_bytes)
        dq = dq.transpose(1, 2).to(q.dtype)
        dk = dkv[0].transpose(1, 2).to(k.dtype)
        dv = dkv[1].transpose(1, 2).to(v.dtype)
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
        or ``(out, lse)``. Gradients flow to q, k, v in their dtypes.
    """
    group = resolve_group(group)
    world, rank = world_and_rank(group)
    scale = resolve_scale(softmax_scale, q.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() == 4 else 1.0
    causal = bool(causal)
    _validate(q, k, v, causal, scale, layout, group, validate)
    # world and rank travel explicitly: group=None would mean the default group inside
    out, lse = _RingAttentionFunction.apply(q, k, v, group, world, rank, scale, causal, layout)
    return (out, lse) if return_lse else out
