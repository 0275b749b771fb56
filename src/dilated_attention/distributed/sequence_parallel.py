"""Sequence-parallel dilated attention: ``dilated_attention(..., group=...)``.

Semantics: docs/spec.md ("Definition", "Sequence parallelism").

Each of the P ranks holds the contiguous shard ``[rank*L, (rank+1)*L)`` (L = N/P) of q, k, v and
of ``key_padding_mask``, and gets back its shard of exactly the single-device result, with exact
gradients. Positions are global.

Per branch (w, r) and dilation offset o (query heads ``h % r == o``), a query at position p sees
the keys of its segment ``p // w`` whose in-segment index is congruent to o. The keys of a
segment may live on other ranks ("source" ranks); this rank computes one partial attention per
(source rank, segment, offset) block, with the blocks of equal shape (over segments and offsets)
batched into one attention call, and merges every partial result of every branch into one float32
accumulator by LSE (:func:`..merge.merge_partial`; in place where rows are strided views):

- keys on this rank: no communication (a branch whose segments never cross a shard boundary,
  e.g. ``L % w == 0``, is entirely local); causal is plain causal masking inside each block.
- keys on another rank: that rank selects its dilated rows (offset o, only the kv heads of
  offset o's query heads: 1/r of the rows) of the segments both ranks share and sends only those,
  point to point (batched isend/irecv: no process groups are created). With ``causal`` a rank
  receives only from earlier ranks (it never needs later keys) and those blocks are unmasked.

Queries never move. Exchange schedules (:func:`exchange_mode`): ``"allgather"`` posts every
peer's rows at once (one round; best when a segment spans few ranks), ``"ring"`` exchanges with
the peers at distance 1, 2, ... one distance per round with the next round in flight, so at most
two rounds (four peers' rows) are held at a time (a distance-staged ring: rows go straight to
their destination, never relayed, so each row crosses the network once). ``"auto"`` picks allgather when no rank has more than two
peers in the branch, else ring (the choice is a pure function of the shapes, so every rank
agrees).

Backward: the K/V rows are exchanged again (not stored, to keep memory O(N/P + w/r)); each
block's backward runs with the FINAL merged output and LSE (exact gradients, the branch mixing
weights are not detached); the dK/dV of received rows are sent back to their owners at the end
of each branch and added there.

Per rank, per branch: traffic O(w/r) rows (x kv heads of an offset), independent of N; memory
O(L + w/r). :func:`exchange_mode` reports the bytes this rank sent (``calls.stats``).

Local work (:func:`..kernels.select.pick_sp_local_impl`): with ``impl="torch"`` every block runs
:mod:`..kernels.block_attention` on gathered or strided rows. With ``impl="triton"`` the blocks of this rank's own rows
(keys on this rank) of every branch whose segments start at the start of this rank's shard
(``rank*L % w == 0``, e.g. every branch with ``L % w == 0``; a branch with no peer on this rank
always qualifies) run instead in ONE call of the fused Triton forward on the local shard
(positions are the same modulo w, causal is per segment, the key padding mask is the local
shard), which returns its own (out, lse) over all those branches; it initialises the float32
accumulator and the remaining blocks (received rows, and own rows of unaligned branches) merge
into it by LSE as above. It runs while the first K/V exchange round is in flight. Its backward is
one call of the fused Triton backward with the final merged out and lse (exact, as for the
blocks). A rank whose branches are all fused needs no accumulator and no merge.
``impl="auto"`` picks the fused kernel where it measured faster (causal attention, and calls that
need no gradient) and the torch kernels for non-causal training (the rule and its measurement:
:func:`..kernels.select.pick_sp_local_impl`, benchmarks/bench_sequence_parallel.py). The fused forward returns its partial output in the
input dtype, so with fp16/bf16 inputs that partial result is rounded once more before the merge
(one extra rounding of the input dtype, on the torch path's error scale).

Packed stream (:func:`dilated_attention_sp_varlen`, from ``dilated_attention_varlen(group=)``
and ``ring_attention(cu_seqlens=)``): each rank holds a "contiguous" or "zigzag" shard of one
stream of documents with global offsets; the branch plans come from
:func:`.sp_plan.plan_branch_packed` (segments per document, which may cross rank boundaries) and
run through the same exchange, compute and autograd code as above (torch kernels for every
block; the fused Triton shard call does not apply).

Not supported with a group (clear errors): ``dropout_p > 0``, ``seqlen_q != seqlen_k`` (KV-cache
decoding), ``impl="reference"``, and ``impl="triton"`` where the Triton kernel cannot run (no
triton, not CUDA, headdim or dtype unsupported: the error gives the reason).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from ..autograd_rules import backward_context, connected_empty, no_double_backward, zero_features
from ..branches import branch_head_ranges
from ..kernels.block_attention import attn_bwd, attn_fwd
from ..kernels.select import pick_sp_local_impl
from ..merge import acc_dtype, merge_partial, merge_partial_
from .comm import (
    SP_NAMES,
    SP_VARLEN_NAMES,
    PeerExchange,
    check_same_across_ranks,
    dtype_code,
    float_bits,
    resolve_group,
    validate_across_ranks,
    world_and_rank,
)
from .sp_plan import (
    EXCHANGE_MODES,
    Jobs,
    kv_sizes,
    pack_kv,
    plan_branch,
    plan_branch_packed,
    unpack_kv,
)

_TAG_KV, _TAG_RET = 20, 21


@dataclass
class SPCalls:
    """The options and the statistics of the sequence-parallel calls made inside one
    :func:`exchange_mode` block.

    ``exchange``: the K/V exchange schedule ("auto", "allgather" or "ring"; every rank must use
    the same). ``stats``: the bytes this rank sent in the last forward / backward:
    ``fwd_bytes_sent``, ``bwd_bytes_sent`` (K/V rows again + dK/dV returned), ``branches`` (one
    dict per branch: ``w``, ``r``, ``mode``, ``peers``, ``fwd_bytes_sent``, ``local_impl``:
    ``"triton"`` when this rank's own-row blocks ran in the fused kernel, else ``"torch"``),
    ``world``. A backward run after the block still reports into the object of its forward.
    """

    exchange: str = "auto"
    stats: dict = field(default_factory=dict)


# the SPCalls of the innermost exchange_mode block of this thread / task (None: defaults, no stats)
_CALLS: contextvars.ContextVar[SPCalls | None] = contextvars.ContextVar("dilated_attention_sp_calls", default=None)


@contextlib.contextmanager
def exchange_mode(mode: str = "auto"):
    """``with exchange_mode("ring") as calls: ...``: the sequence-parallel calls inside the block
    use this K/V exchange schedule and report their communication into ``calls.stats``
    (:class:`SPCalls`). Every rank must use the same mode. Outside a block: "auto", no stats.
    """
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange mode must be one of {EXCHANGE_MODES}, got {mode!r}")
    calls = SPCalls(mode)
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


# ------------------------------------------------------------------------------------- exchange


def _post_kv_round(ex, plan, rnd, k, v, mask):
    """Post one round of K/V row exchange; returns {src: flat receive buffer}."""
    b, d = k.shape[0], k.shape[-1]
    send = {p: pack_kv(plan, plan.send_rows[p], k, v, mask) for p in rnd if p in plan.send_rows}
    recv = {
        p: k.new_empty(sum(kv_sizes(plan, plan.recv_counts[p], b, d, mask is not None)))
        for p in rnd if p in plan.recv_counts
    }
    ex.add(send, recv)
    return recv


# ----------------------------------------------------------------------------------- compute


def _sources(plan, src, me, k, v, mask, received):
    """[(k_src, v_src, mask_src (B, n) | None, heads | None)] per offset for one source rank.

    Own rows: the full local k, v (B, L, Hkv, D) and the offset's kv heads (gathered per block
    with the rows, never copied whole). Received rows: (B, n, Gk, D), heads already selected.
    """
    if src == me:
        return [(k, v, mask, off.hk) for off in plan.offsets]
    return [(kk, vv, mm, None) for kk, vv, mm in received[src]]


def _strided(x, aff, s, n, haff, gh):
    """View of x (B, L, H, ...) at rows aff[0] + aff[1]*i + aff[2]*t and heads haff[0] + haff[1]*j.

    -> (B, S, n, Gh, ...). The (row, head) pairs are distinct, so in-place updates are safe.
    """
    a, b, c = aff
    h0, hstep = haff
    st = x.stride()
    size = (x.shape[0], s, n, gh, *x.shape[3:])
    stride = (st[0], b * st[1], c * st[1], hstep * st[2], *st[3:])
    return x.as_strided(size, stride, x.storage_offset() + a * st[1] + h0 * st[2])


def _q_view_ok(job, off) -> bool:
    return job.qaff is not None and off.hq_aff is not None


def _k_view_ok(job, off, heads) -> bool:
    return job.kaff is not None and (heads is None or off.hk_aff is not None)


def _q_rows(job, off, x):
    """Query-side rows of one job from x (B, L, H, ...) -> (B, S, nq, Gh, ...), a view if possible."""
    s, nq = job.qidx.shape
    if _q_view_ok(job, off):
        return _strided(x, job.qaff, s, nq, off.hq_aff, off.hq.numel())
    return x[:, job.qidx[..., None], off.hq[None, None, :]]


def _k_rows(job, off, x, heads):
    """Key-side rows from a source tensor -> (B, S, nk, Gk, ...), a view if possible.

    heads: the kv heads to take (own rows, x is (B, L, Hkv, D)) or None (received rows, x is
    already (B, n, Gk, D)).
    """
    s, nk = job.kidx.shape
    if _k_view_ok(job, off, heads):
        haff, gk = ((0, 1), x.shape[2]) if heads is None else (off.hk_aff, off.hk.numel())
        return _strided(x, job.kaff, s, nk, haff, gk)
    if heads is None:
        return x[:, job.kidx]
    return x[:, job.kidx[..., None], heads[None, None, :]]


def _k_add(job, off, acc, val, heads):
    """acc[rows of the job] += val (B, S, nk, Gk, D); (row, head) pairs of a job are distinct."""
    if _k_view_ok(job, off, heads):
        _k_rows(job, off, acc, heads).add_(val)
    elif heads is None:
        acc[:, job.kidx] += val
    else:
        acc[:, job.kidx[..., None], heads[None, None, :]] += val


def _bundles(plan, src) -> list[list[tuple[int, Jobs]]]:
    """(offset index, job) pairs of one source grouped by shape: one attention call per group.

    Blocks of different offsets (different heads) with equal shapes are stacked along the batch
    dim, so a branch with r offsets costs one kernel launch per shape, not r.
    """
    groups: dict = {}
    for oi, off in enumerate(plan.offsets):
        gk = off.hq.numel() if off.kexp is not None else off.hk.numel()
        for job in plan.jobs[(src, oi)]:
            key = (*job.qidx.shape, job.kidx.shape[1], off.hq.numel(), gk, job.causal)
            groups.setdefault(key, []).append((oi, job))
    return list(groups.values())


def _to_sdpa(parts: list[torch.Tensor]) -> torch.Tensor:
    """[(B, S, n, G, D)] * O -> (B*O*S, G, n, D) (one copy at most)."""
    x = parts[0].unsqueeze(1) if len(parts) == 1 else torch.stack(parts, 1)  # (B, O, S, n, G, D)
    b, o, s, n, g, d = x.shape
    return x.reshape(b * o * s, n, g, d).transpose(1, 2)


def _from_sdpa(x: torch.Tensor, b: int, o: int) -> torch.Tensor:
    """(B*O*S, G, n, ...) -> (B, O, S, n, G, ...)."""
    x = x.transpose(1, 2)
    return x.reshape(b, o, -1, *x.shape[1:])


def _bundle_inputs(bundle, plan, q, srcs):
    """q, k, v in SDPA layout (B*O*S, G, n, D) and the key mask (B*O*S, nk) of one bundle."""
    qs, ks_, vs_, ms_ = [], [], [], []
    for oi, job in bundle:
        off = plan.offsets[oi]
        ks, vs, ms, heads = srcs[oi]
        qs.append(_q_rows(job, off, q))
        kb, vb = _k_rows(job, off, ks, heads), _k_rows(job, off, vs, heads)  # (B, S, nk, Gk, D)
        if off.kexp is not None:  # query heads share kv heads unevenly: one kv head per query head
            kb, vb = kb[:, :, :, off.kexp], vb[:, :, :, off.kexp]
        ks_.append(kb)
        vs_.append(vb)
        ms_.append(None if ms is None else ms[:, job.kidx])  # (B, S, nk)
    mb = None
    if ms_[0] is not None:
        mb = torch.stack(ms_, 1).reshape(-1, ms_[0].shape[-1])
    return _to_sdpa(qs), _to_sdpa(ks_), _to_sdpa(vs_), mb


def _q_side_sdpa(bundle, plan, x, lse_like=False):
    """Query-side rows of x (out, dout: (B, L, H, D); lse: (B, L, H)) for a bundle, SDPA layout."""
    parts = [_q_rows(job, plan.offsets[oi], x) for oi, job in bundle]
    if lse_like:
        parts = [t.unsqueeze(-1) for t in parts]
        return _to_sdpa(parts).squeeze(-1).contiguous()  # (B*O*S, G, n)
    return _to_sdpa(parts)


def _merge_rows(job, off, acc_out, acc_lse, o, lse):
    """Merge a job's partial (o (B, S, nq, Gh, D), lse (B, S, nq, Gh)) into the accumulators."""
    ao, al = _q_rows(job, off, acc_out), _q_rows(job, off, acc_lse)
    if _q_view_ok(job, off):  # views: merge in place
        merge_partial_(ao, al, o, lse)
        return
    mo, ml = merge_partial(ao, al, o, lse)
    idx = (slice(None), job.qidx[..., None], off.hq[None, None, :])
    acc_out[idx] = mo
    acc_lse[idx] = ml


def _fwd_source(plan, src, me, q, k, v, mask, received, acc_out, acc_lse, scale):
    b = q.shape[0]
    srcs = _sources(plan, src, me, k, v, mask, received)
    for bundle in _bundles(plan, src):
        qb, kb, vb, mb = _bundle_inputs(bundle, plan, q, srcs)
        o, lse = attn_fwd(qb, kb, vb, scale, bundle[0][1].causal, mb)
        o = _from_sdpa(o, b, len(bundle))  # (B, O, S, nq, Gh, D)
        lse = _from_sdpa(lse.unsqueeze(-1), b, len(bundle)).squeeze(-1).to(acc_lse.dtype)
        for i, (oi, job) in enumerate(bundle):
            _merge_rows(job, plan.offsets[oi], acc_out, acc_lse, o[:, i], lse[:, i])


def _bwd_source(plan, src, me, saved, received, dq, dk_src, scale):
    """Block backward for one source; adds into dq and the source's dK/dV.

    dk_src: (dk, dv) laid out like the source (own rows: the local (B, L, Hkv, D) accumulators;
    received rows: one (dk, dv) pair per offset).
    """
    q, k, v, mask, out, lse, dout = saved
    b = q.shape[0]
    srcs = _sources(plan, src, me, k, v, mask, received)
    for bundle in _bundles(plan, src):
        qb, kb, vb, mb = _bundle_inputs(bundle, plan, q, srcs)
        ob = _q_side_sdpa(bundle, plan, out)
        dob = _q_side_sdpa(bundle, plan, dout)
        lb = _q_side_sdpa(bundle, plan, lse, lse_like=True)
        dqb, dkb, dvb = attn_bwd(dob, qb, kb, vb, ob, lb, scale, bundle[0][1].causal, mb)
        dqb = _from_sdpa(dqb, b, len(bundle))  # (B, O, S, nq, Gh, D)
        dkb = _from_sdpa(dkb, b, len(bundle))  # (B, O, S, nk, Gk, D)
        dvb = _from_sdpa(dvb, b, len(bundle))
        for i, (oi, job) in enumerate(bundle):
            off = plan.offsets[oi]
            dks, dvs = dk_src if src == me else dk_src[oi]
            dqi = dqb[:, i].to(dq.dtype)
            if _q_view_ok(job, off):
                _q_rows(job, off, dq).add_(dqi)
            else:
                dq[:, job.qidx[..., None], off.hq[None, None, :]] += dqi
            dki, dvi = dkb[:, i].to(dks.dtype), dvb[:, i].to(dvs.dtype)
            if off.kexp is not None:  # sum the per-query-head copies back onto the kv heads
                gk = off.hk.numel()
                dki = dki.new_zeros(*dki.shape[:3], gk, dki.shape[-1]).index_add_(3, off.kexp, dki)
                dvi = dvi.new_zeros(*dvi.shape[:3], gk, dvi.shape[-1]).index_add_(3, off.kexp, dvi)
            heads = srcs[oi][3]
            _k_add(job, off, dks, dki, heads)
            _k_add(job, off, dvs, dvi, heads)


# ------------------------------------------------------------------------------ autograd glue


@dataclass
class _Fused:
    """The branches whose own-row blocks run in one fused Triton call on the local shard."""

    seg: list  # [w]
    dil: list  # [r]
    head_ranges: list  # [(hs, he)] global head ranges of those branches
    causal: bool


def _fused_fwd(fused, q, k, v, mask, scale):
    """-> out (B, L, H, D) in q's dtype, lse (B, H, L) float32, over the fused branches only."""
    from ..kernels.triton_ops import triton_forward

    return triton_forward(q, k, v, fused.seg, fused.dil, fused.head_ranges, causal=fused.causal,
                          scale=scale, key_padding_mask=mask)


def _fused_bwd(fused, dout, q, k, v, mask, out, lse_bhl, scale):
    """Fused branches' share of dq, dk, dv, given the FINAL merged out and lse (B, H, L)."""
    from ..kernels.triton_ops import triton_backward

    return triton_backward(dout, q, k, v, out, lse_bhl, fused.seg, fused.dil, fused.head_ranges,
                           causal=fused.causal, scale=scale, key_padding_mask=mask)


class _DilatedSPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, work, fused, stats, report, group, me, world, scale):
        """work: [(branch index, plan, own)] branches with blocks on the torch path (``own``:
        this rank's own rows too, else only received rows); fused: :class:`_Fused` or None;
        stats: one dict per branch; report: the dict of :class:`SPCalls` to fill, or None."""
        b, L, h, _ = q.shape
        adt = acc_dtype(q.dtype)
        if fused is not None:  # exchanging branches first: the fused call overlaps their 1st round
            work = sorted(work, key=lambda t: not t[1].rounds)
        sent_by = {}
        if not work:  # every branch of this rank is fused: its result is the result
            out, lse_bhl = (_fused_fwd(fused, q, k, v, mask, scale) if fused is not None else (
                torch.zeros_like(q), torch.full((b, h, L), float("-inf"), device=q.device)))
            acc_lse = lse_bhl.permute(0, 2, 1)
        else:
            if fused is not None:  # the fused result initialises the accumulators
                acc_out = torch.empty(b, L, h, v.shape[-1], dtype=adt, device=q.device)
                acc_lse = torch.empty((b, L, h), dtype=adt, device=q.device)

                def run_fused():
                    o, lse_f = _fused_fwd(fused, q, k, v, mask, scale)
                    acc_out.copy_(o)
                    acc_lse.copy_(lse_f.permute(0, 2, 1))

                pending = [run_fused]
                if not work[0][1].rounds:
                    pending.pop()()
            else:
                acc_out = torch.zeros(b, L, h, v.shape[-1], dtype=adt, device=q.device)
                acc_lse = torch.full((b, L, h), float("-inf"), dtype=adt, device=q.device)
                pending = []
            for bi, plan, own in work:
                sent_by[bi] = _branch_forward(
                    plan, group, me, q, k, v, mask, acc_out, acc_lse, scale, own=own,
                    overlap=pending.pop() if pending else None,
                )
            out = acc_out.to(q.dtype)
            del acc_out
        per_branch = [dict(st, fwd_bytes_sent=sent_by.get(bi, 0)) for bi, st in enumerate(stats)]
        if report is not None:
            report.clear()
            report.update(fwd_bytes_sent=sum(sent_by.values()), bwd_bytes_sent=0,
                          branches=per_branch, world=world)
        ctx.report = report
        ctx.save_for_backward(q, k, v, mask, out, acc_lse)
        ctx.work, ctx.fused, ctx.group, ctx.me, ctx.scale = work, fused, group, me, scale
        lse = acc_lse.permute(0, 2, 1).to(torch.float32)  # (B, H, L)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        with backward_context(q.device.type):
            grads = _DilatedSPFunction._grads(ctx, dout.contiguous(), q, k, v, mask, out, lse)
        dq, dk, dv = no_double_backward("dilated_attention(group=...)", grads[:3], (dout, q, k, v))
        return dq, dk, dv, *grads[3:]

    @staticmethod
    def _grads(ctx, dout, q, k, v, mask, out, lse):
        fused, work = ctx.fused, ctx.work
        nones = (None,) * 9
        if not work:
            if fused is None:
                return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *nones
            if ctx.report is not None:
                ctx.report["bwd_bytes_sent"] = 0
            return (*_fused_bwd(fused, dout, q, k, v, mask, out, lse.permute(0, 2, 1), ctx.scale),
                    *nones)
        adt = lse.dtype
        new = torch.empty if fused is not None else torch.zeros
        dq = new(q.shape, dtype=adt, device=q.device)
        dk = new(k.shape, dtype=adt, device=q.device)
        dv = new(v.shape, dtype=adt, device=q.device)
        pending = []
        if fused is not None:  # the fused gradients initialise the accumulators

            def run_fused():
                for acc, g in zip((dq, dk, dv), _fused_bwd(fused, dout, q, k, v, mask, out,
                                                            lse.permute(0, 2, 1), ctx.scale),
                                  strict=True):
                    acc.copy_(g)

            pending.append(run_fused)
            if not work[0][1].rounds:
                pending.pop()()
        saved = (q, k, v, mask, out, lse, dout)
        total = 0
        for _, plan, own in work:
            total += _branch_backward(plan, ctx.group, ctx.me, saved, dq, dk, dv, ctx.scale,
                                      own=own, overlap=pending.pop() if pending else None)
        if ctx.report is not None:
            ctx.report["bwd_bytes_sent"] = total
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *nones


def _branch_forward(plan, group, me, q, k, v, mask, acc_out, acc_lse, scale, own=True,
                    overlap=None) -> int:
    """One branch's blocks on the torch path. own: run this rank's own-row blocks (False when
    the fused kernel does them); overlap: work to run while the first exchange round flies."""
    sent = 0
    ex = PeerExchange(group, _TAG_KV)
    recv = _post_kv_round(ex, plan, plan.rounds[0], k, v, mask) if plan.rounds else {}
    if overlap is not None:
        overlap()
    # own rows first: overlaps the first exchange round
    if own:
        _fwd_source(plan, me, me, q, k, v, mask, None, acc_out, acc_lse, scale)
    b, d = k.shape[0], k.shape[-1]
    for i in range(len(plan.rounds)):
        ex.wait()
        sent += ex.bytes_sent
        cur = {p: unpack_kv(plan, plan.recv_counts[p], buf, b, d, mask is not None) for p, buf in recv.items()}
        ex = PeerExchange(group, _TAG_KV)
        recv = _post_kv_round(ex, plan, plan.rounds[i + 1], k, v, mask) if i + 1 < len(plan.rounds) else {}
        for src in sorted(cur):
            _fwd_source(plan, src, me, q, k, v, mask, cur, acc_out, acc_lse, scale)
        del cur
    return sent


def _branch_backward(plan, group, me, saved, dq, dk, dv, scale, own=True, overlap=None) -> int:
    q, k, v, mask = saved[:4]
    b, d = k.shape[0], k.shape[-1]
    adt = dq.dtype
    sent = 0
    ex = PeerExchange(group, _TAG_KV)
    recv = _post_kv_round(ex, plan, plan.rounds[0], k, v, mask) if plan.rounds else {}
    if overlap is not None:
        overlap()
    if own:
        _bwd_source(plan, me, me, saved, None, dq, (dk, dv), scale)  # own rows, straight into dk/dv
    grads_back = {}  # src -> flat dK/dV of the rows it sent us
    for i in range(len(plan.rounds)):
        ex.wait()
        sent += ex.bytes_sent
        cur = {p: unpack_kv(plan, plan.recv_counts[p], buf, b, d, mask is not None) for p, buf in recv.items()}
        ex = PeerExchange(group, _TAG_KV)
        recv = _post_kv_round(ex, plan, plan.rounds[i + 1], k, v, mask) if i + 1 < len(plan.rounds) else {}
        for src in sorted(cur):
            acc = [[torch.zeros(kk.shape, dtype=adt, device=kk.device), torch.zeros(vv.shape, dtype=adt, device=vv.device)]
                   for kk, vv, _ in cur[src]]
            _bwd_source(plan, src, me, saved, cur, dq, acc, scale)
            grads_back[src] = torch.cat([t.reshape(-1) for pair in acc for t in pair]) if acc else dq.new_zeros(0)
        del cur
    # return the dK/dV of received rows to their owners, one round for the whole branch
    if plan.send_rows or plan.recv_counts:
        ret = PeerExchange(group, _TAG_RET)
        incoming = {}
        for dst, rows in plan.send_rows.items():
            n = sum(2 * b * r_.numel() * off.hk.numel() * d for r_, off in zip(rows, plan.offsets, strict=True))
            incoming[dst] = torch.empty(n, dtype=adt, device=q.device)
        ret.add(grads_back, incoming)
        ret.wait()
        sent += ret.bytes_sent
        for dst, buf in incoming.items():
            pos = 0
            for rows, off in zip(plan.send_rows[dst], plan.offsets, strict=True):
                n = b * rows.numel() * off.hk.numel() * d
                shape = (b, rows.numel(), off.hk.numel(), d)
                sel = (slice(None), rows[:, None], off.hk[None, :])
                dk[sel] += buf[pos : pos + n].view(shape)
                dv[sel] += buf[pos + n : pos + 2 * n].view(shape)
                pos += 2 * n
    return sent


# ---------------------------------------------------------------------------------- entry point


def _fusable(me: int, L: int, w: int) -> bool:
    """Can the fused kernel run this rank's own-row blocks of a branch of segment length w?

    Its segments count from row 0 of the tensor it gets, so the local shard must start on a
    segment boundary: ``me*L % w == 0`` (every rank when ``L % w == 0``; always rank 0). The
    own-row blocks are then exactly the kernel's segments of the shard (the last one cut at the
    shard end, as the owner of the rest computes its part), with the same in-segment offsets.
    """
    return (me * L) % w == 0


def _validate(q, k, v, seg, dil, causal, scale, mask, dropout_p, head_assignment, impl, group):
    """Check the inputs on every rank (same error everywhere); returns the local-block kernel
    (:func:`..kernels.select.pick_sp_local_impl`)."""
    local = ["torch"]

    def local_checks():
        if dropout_p > 0:
            raise ValueError(
                "dropout_p > 0 is not supported with group= (sequence-parallel); apply dropout "
                "outside attention or run without a group"
            )
        local[0] = pick_sp_local_impl(impl, q, k, causal)
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"sequence-parallel dilated_attention needs seqlen_q == seqlen_k per shard, got "
                f"{q.shape[1]} and {k.shape[1]} (KV-cache decoding is single-device only)"
            )

    names = SP_NAMES

    def describe():
        bhash = hash((seg, dil)) & ((1 << 62) - 1)  # same on every rank: tuples of ints hash stably
        return [q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[2], dtype_code(q.dtype),
                int(causal), int(mask is not None), int(head_assignment == "split"), bhash,
                float_bits(scale)]

    validate_across_ranks(group, "dilated_attention(group=...)", local_checks, describe, names, q)
    return local[0]


def dilated_attention_sp(
    q, k, v, segment_lengths, dilation_rates, *, causal, scale, key_padding_mask, dropout_p,
    head_assignment, return_lse, impl, group,
):
    """Validated inputs from :func:`dilated_attention_api`. Each rank passes its contiguous shard.

    q: (B, N/P, H, D); k, v: (B, N/P, Hkv, D); key_padding_mask: (B, N/P) bool or None.
    Returns out (B, N/P, H, D) (and lse (B, H, N/P) float32 when ``return_lse``).
    """
    group = resolve_group(group)
    world, me = world_and_rank(group)
    seg, dil = tuple(segment_lengths), tuple(dilation_rates)
    local = _validate(q, k, v, seg, dil, causal, scale, key_padding_mask, dropout_p,
                      head_assignment, impl, group)
    b, L, h, d = q.shape
    # nothing to compute, on every rank (the ranks agreed on the shapes above), as on one device
    # (api._run): batch 0 or empty shards; head dim 0, whose lse the same call on zero features gives
    if b == 0 or L == 0:
        lse = torch.full((b, h, L), float("-inf"), device=q.device)
        return (connected_empty(q, k, v), lse) if return_lse else connected_empty(q, k, v)
    if d == 0:
        zq, zk = zero_features(q, k)
        _, lse = dilated_attention_sp(
            zq, zk, zk, seg, dil, causal=causal, scale=1.0, key_padding_mask=key_padding_mask,
            dropout_p=0.0, head_assignment=head_assignment, return_lse=True, impl=impl, group=group,
        )  # fmt: skip
        return (connected_empty(q, k, v), lse) if return_lse else connected_empty(q, k, v)
    calls = _CALLS.get()  # the innermost exchange_mode block, if any
    mode = calls.exchange if calls is not None else "auto"
    ranges = branch_head_ranges(h, len(seg), head_assignment)
    work, stats = [], []
    fused = _Fused([], [], [], bool(causal))
    for (w, r), (hs, he) in zip(zip(seg, dil, strict=True), ranges, strict=True):
        if he <= hs:
            continue
        plan = plan_branch(world, me, L, h, k.shape[2], w, r, hs, he, bool(causal), mode, q.device)
        fuse = local == "triton" and _fusable(me, L, w)
        if fuse:
            fused.seg.append(w)
            fused.dil.append(r)
            fused.head_ranges.append((hs, he))
        if not fuse or plan.rounds:  # blocks left for the torch path (at least the exchange)
            work.append((len(stats), plan, not fuse))
        stats.append(dict(w=w, r=r, mode=plan.mode, peers=plan.peers,
                          local_impl="triton" if fuse else "torch"))
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    out, lse = _DilatedSPFunction.apply(
        q, k, v, mask, work, fused if fused.seg else None, stats,
        calls.stats if calls is not None else None, group if world > 1 else None,
        me, world, scale,
    )
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ packed stream (varlen)


def sp_varlen_arg_error(group, err: Exception, tensors, name: str, validate: bool = True):
    """Raise ``err``, an argument error found on this rank before the cross-rank check of
    :func:`dilated_attention_sp_varlen` (a type, shape or device check of the tensors or the
    offsets), after taking part in that check's one all-gather with it: the ranks whose
    arguments passed then raise "invalid inputs on rank(s) [...]" instead of waiting in the
    all-gather until the collective timeout. ``tensors``: the call's arguments, for the device
    of the collective (the first CUDA tensor among them, else the CPU)."""
    _raise_on_every_rank(group, err, tensors, name, SP_VARLEN_NAMES, validate)


def sp_arg_error(group, err: Exception, tensors):
    """:func:`sp_varlen_arg_error` for ``dilated_attention(group=...)``: an argument error of
    this rank (``describe_call``'s checks) raised after taking part in the all-gather of
    :func:`_validate`, so that the other ranks raise too instead of waiting."""
    _raise_on_every_rank(group, err, tensors, "dilated_attention(group=...)", SP_NAMES, True)


def _raise_on_every_rank(group, err, tensors, name, names, validate):
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise err
    group = resolve_group(group)
    world, _ = world_and_rank(group)
    if world == 1 or not validate:
        raise err
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    like = next((t for t in ts if t.is_cuda), torch.empty(0))
    try:
        check_same_across_ranks(group, [0] * len(names), names, like, name, str(err))
    except ValueError as e:  # always: this rank's error, with the rank named
        try:
            again = type(err)(str(e))
        except Exception:  # an error type with another constructor
            again = ValueError(str(e))
        raise again from err


def dilated_attention_sp_varlen(
    q, k, v, cu_seqlens, segment_lengths, dilation_rates, *, causal, scale, head_assignment,
    impl, group, layout, local_checks=None, name="dilated_attention_varlen", report=None,
    validate=True,
):
    """Sequence-parallel dilated attention over a packed stream of documents.

    q: (L, H, D), k, v: (L, Hkv, D): this rank's shard (``layout``: "contiguous" or "zigzag") of
    a stream of N = P*L tokens; ``cu_seqlens``: the GLOBAL document offsets (docs + 1,) as a
    list of host ints, identical on every rank (the caller read them to the host once; they are
    checked across ranks here). Each document is its own sequence (docs/spec.md, "Packed
    documents (varlen)"); documents may cross rank boundaries. ``local_checks``: the caller's
    value checks, run inside the cross-rank validation so that a bad input raises the same error
    on every rank. ``report``: a dict that receives the statistics (as :class:`SPCalls`).
    ``validate=False`` skips the cross-rank descriptor check (``ring_attention(validate=False)``).

    Returns out (L, H, D) in q's dtype and lse (H, L) float32.
    """
    group = resolve_group(group)
    world, me = world_and_rank(group)
    seg, dil = tuple(segment_lengths), tuple(dilation_rates)
    cu = tuple(int(x) for x in cu_seqlens)

    def checks():
        if local_checks is not None:
            local_checks()
        if impl not in ("auto", "torch"):
            raise ValueError(
                f"{name}: impl={impl!r} is not available with group= over packed documents: the "
                "local blocks run the torch kernels; use impl='torch' or 'auto'"
            )
        if q.shape[0] != k.shape[0]:
            raise ValueError(
                f"{name}: with group= each rank passes q, k, v shards of one length, got "
                f"{q.shape[0]} query and {k.shape[0]} key rows"
            )

    names = SP_VARLEN_NAMES

    def describe():
        bhash = hash((seg, dil)) & ((1 << 62) - 1)  # tuples of ints hash the same in every process
        return [q.shape[0], q.shape[1], q.shape[2], k.shape[1], dtype_code(q.dtype), int(causal),
                int(head_assignment == "split"), bhash, float_bits(scale),
                int(layout == "zigzag"), len(cu) - 1, hash(cu) & ((1 << 62) - 1)]

    validate_across_ranks(group, name, checks, describe, names, q, validate)
    h = q.shape[1]
    calls = _CALLS.get()
    mode = calls.exchange if calls is not None else "auto"
    if report is None and calls is not None:
        report = calls.stats
    ranges = branch_head_ranges(h, len(seg), head_assignment)
    work, stats = [], []
    for (w, r), (hs, he) in zip(zip(seg, dil, strict=True), ranges, strict=True):
        if he <= hs:
            continue
        plan = plan_branch_packed(world, me, layout, cu, h, k.shape[1], w, r, hs, he, bool(causal),
                                  mode, q.device)
        work.append((len(stats), plan, True))
        stats.append(dict(w=w, r=r, mode=plan.mode, peers=plan.peers, local_impl="torch"))
    out, lse = _DilatedSPFunction.apply(
        q[None], k[None], v[None], None, work, None, stats, report,
        group if world > 1 else None, me, world, scale,
    )
    return out[0], lse[0]
