"""``impl="torch"``: dilated attention from PyTorch attention kernels plus an exact LSE merge.

For each branch (w, r) the key positions split into blocks: one per (segment, offset o), holding
the rows ``segment_start + o + r*t`` (:mod:`..geometry`). Query head h reads the block of offset ``h % r``. Each block
is plain dense attention (causal inside the block when the whole call is causal: positions are
increasing), so one call of :mod:`.block_attention` per *group* of equally shaped blocks does a
whole branch, batched over (batch, segment, offset). Partial results merge by LSE
(:mod:`..merge`) into one float32 accumulator; the output is written once.

Rows are taken as views where the layout allows (r = 1) and by one gather per group otherwise
(1/r of the rows). Dilated query rows of different heads differ, so q is gathered per head; K/V
are gathered per *kv head* and GQA is left to the attention kernel whenever the query heads of a
group share their kv heads evenly (never a repeat of K/V in the usual configurations).

The backward runs each group's attention backward with the FINAL merged output and LSE (as ring
attention does), which is the exact gradient of the definition (docs/spec.md): the branch mixing
weights are not detached. Memory: one float32 output accumulator (forward) and float32 dq/dk/dv accumulators
(backward), plus one group's gathered rows; never an N x N score matrix.

Queries shorter than keys (KV-cache decoding): query row t is position ``Nk - Nq + t``. Only the
segments that hold queries are computed; rows of those segments before the first query are
computed as dummies and routed to a scratch row ("trash row" ``Nq``), and their LSE is set to
+inf in the backward so that they contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..autograd_rules import backward_context, no_double_backward
from ..branches import branch_head_ranges
from ..geometry import block_length, block_offsets, block_row, segments
from ..merge import acc_dtype, merge_partial, merge_partial_
from ..plan_cache import cached_plan
from .block_attention import attn_bwd, attn_fwd


@dataclass(frozen=True)
class _Group:
    """Equally shaped blocks of one branch, batched into one attention call.

    view kind (r == 1, no dummies): rows [start, start + nseg * length), heads [hs, he).
    strided kind (r > 1, whole segments of length % r == 0, every offset, head ranges aligned to
    r, no dummies): rows [start, start + nseg * length) split as (segment, t, offset); query heads
    [hs, he) split as (g, offset) and the two offsets tied by a diagonal view, so that reading is
    one strided copy and writing is in place, with no index tensors. K/V: the same diagonal
    (``kmode="diag"``, MHA) or every kv head [kvs, kve) for every offset (``kmode="shared"``,
    GQA with r dividing the group size).
    gather kind: index tensors, built on the inputs' device.
    """

    kind: str
    # view kind
    start: int = 0
    nseg: int = 0
    length: int = 0
    hs: int = 0
    he: int = 0
    kvs: int = 0
    kve: int = 0
    # strided kind (uses start, nseg, length, hs, he, kvs, kve too)
    r: int = 1
    kmode: str = ""
    # gather kind
    kpos: torch.Tensor | None = None  # (S, O, L) key positions
    qsrc: torch.Tensor | None = None  # (S, O, L) query rows to read (dummies clamped to 0)
    qdst: torch.Tensor | None = None  # (S, O, L) query rows to write (dummies -> trash row Nq)
    hq: torch.Tensor | None = None  # (O, Gh) query heads per offset
    hk: torch.Tensor | None = None  # (O, Gk) kv heads per offset
    unique_k: bool = True  # (position, kv head) pairs are unique in this group
    fresh: bool = False  # no earlier group wrote these (row, head) pairs: write, don't merge

    # ------------------------------------------------------------------ reading rows
    def strided(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """strided kind: x (B, N, heads, *tail) -> a view (B, S, O, G, T, *tail), O = r offsets."""
        r, t = self.r, self.length // self.r
        rows = x[:, self.start : self.start + self.nseg * self.length]
        rows = rows.unflatten(1, (self.nseg, t, r))  # (B, S, T, O, heads, *tail)
        if side == "k" and self.kmode == "shared":
            y = rows[:, :, :, :, self.kvs : self.kve]  # (B, S, T, O, Gk, *tail)
            return y.permute(0, 1, 3, 4, 2, *range(5, y.dim()))
        hs, he = (self.hs, self.he) if side == "q" else (self.kvs, self.kve)
        y = rows[:, :, :, :, hs:he].unflatten(4, ((he - hs) // r, r))  # (B, S, T, O, G, O', *tail)
        y = torch.diagonal(y, 0, 3, 5)  # (B, S, T, G, *tail, O): position offset == head offset
        y = y.movedim(-1, 2)  # (B, S, O, T, G, *tail)
        return y.transpose(3, 4)  # (B, S, O, G, T, *tail)

    def take(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """x: (B, N, heads, D) -> (B', G, L, D), a view when possible."""
        b, d = x.shape[0], x.shape[-1]
        if self.kind == "strided":
            y = self.strided(x, side)  # (B, S, O, G, T, D)
            # one strided copy into the (B', L, G, D) layout the flash kernels read fastest
            y = y.transpose(3, 4).reshape(-1, y.shape[4], y.shape[3], d)
            return y.transpose(1, 2)
        if self.kind == "view":
            hs, he = (self.hs, self.he) if side == "q" else (self.kvs, self.kve)
            rows = x[:, self.start : self.start + self.nseg * self.length, hs:he]
            return rows.reshape(b * self.nseg, self.length, he - hs, d).transpose(1, 2)
        pos = self.qsrc if side == "q" else self.kpos
        heads = self.hq if side == "q" else self.hk
        g = x[:, pos[..., None], heads[None, :, None, :]]  # (B, S, O, L, G, D)
        s, o, l, gh = g.shape[1:5]
        return g.view(b * s * o, l, gh, d).transpose(1, 2)

    def take_rows_q_dst(self, x: torch.Tensor) -> torch.Tensor:
        """Like take(x, 'q') but reading the destination rows (the trash row for dummies).

        x: (B, Nq + 1, H) -> (B', Gh, L), contiguous (used for the LSE).
        """
        b = x.shape[0]
        if self.kind == "strided":
            y = self.strided(x, "q")  # (B, S, O, G, T)
            return y.reshape(-1, y.shape[3], y.shape[4])
        if self.kind == "view":
            rows = x[:, self.start : self.start + self.nseg * self.length, self.hs : self.he]
            return rows.reshape(b * self.nseg, self.length, self.he - self.hs).transpose(1, 2).contiguous()
        g = x[:, self.qdst[..., None], self.hq[None, :, None, :]]  # (B, S, O, L, Gh)
        s, o, l, gh = g.shape[1:5]
        return g.view(b * s * o, l, gh).transpose(1, 2).contiguous()

    def take_mask(self, kpm: torch.Tensor | None) -> torch.Tensor | None:
        """key_padding_mask (B, Nk) -> (B', L)."""
        if kpm is None:
            return None
        b = kpm.shape[0]
        if self.kind == "strided":
            rows = kpm[:, self.start : self.start + self.nseg * self.length]
            rows = rows.unflatten(1, (self.nseg, self.length // self.r, self.r))  # (B, S, T, O)
            return rows.transpose(2, 3).reshape(-1, self.length // self.r)
        if self.kind == "view":
            rows = kpm[:, self.start : self.start + self.nseg * self.length]
            return rows.reshape(b * self.nseg, self.length)
        m = kpm[:, self.kpos]  # (B, S, O, L)
        return m.reshape(-1, m.shape[-1])

    # ------------------------------------------------------------------ writing rows
    def merge_into(self, acc_out, acc_lse, out_g, lse_g, first: bool = False) -> None:
        """Merge (out_g (B', Gh, L, D), lse_g (B', Gh, L)) into acc_out (B, Nq+1, H, D), acc_lse (B, Nq+1, H)."""
        b, d = acc_out.shape[0], acc_out.shape[-1]
        if self.kind == "strided":
            dst_o = self.strided(acc_out, "q")  # (B, S, O, G, T, D) view of the accumulator
            dst_l = self.strided(acc_lse, "q")  # (B, S, O, G, T)
            o_new = out_g.unflatten(0, dst_o.shape[:3])
            l_new = lse_g.unflatten(0, dst_l.shape[:3])
            if first:
                dst_o.copy_(o_new)
                dst_l.copy_(l_new)
                return
            merge_partial_(dst_o, dst_l, o_new, l_new)
            return
        if self.kind == "view":
            sl = (slice(None), slice(self.start, self.start + self.nseg * self.length), slice(self.hs, self.he))
            gh = self.he - self.hs
            o_new = out_g.transpose(1, 2).reshape(b, self.nseg * self.length, gh, d)
            l_new = lse_g.transpose(1, 2).reshape(b, self.nseg * self.length, gh).to(acc_lse.dtype)
            if first:  # nothing merged here yet: write, no merge pass
                acc_out[sl] = o_new
                acc_lse[sl] = l_new
                return
            merge_partial_(acc_out[sl], acc_lse[sl], o_new, l_new)
            return
        idx = (slice(None), self.qdst[..., None], self.hq[None, :, None, :])
        s, o_, l_ = self.qdst.shape
        gh = self.hq.shape[1]
        o_new = out_g.transpose(1, 2).reshape(b, s, o_, l_, gh, d)
        l_new = lse_g.transpose(1, 2).reshape(b, s, o_, l_, gh).to(acc_lse.dtype)
        if first:
            acc_out[idx] = o_new.to(acc_out.dtype)
            acc_lse[idx] = l_new
            return
        o, l = merge_partial(acc_out[idx], acc_lse[idx], o_new, l_new)
        acc_out[idx] = o
        acc_lse[idx] = l

    def add_into(self, acc: torch.Tensor, val: torch.Tensor, side: str) -> None:
        """acc (B, N(+1), heads, D) += val (B', G, L, D) at this group's rows."""
        b, d = acc.shape[0], acc.shape[-1]
        if self.kind == "strided":  # (row, head) pairs are unique within the group
            dst = self.strided(acc, side)  # (B, S, O, G, T, D)
            dst += val.unflatten(0, dst.shape[:3])
            return
        if self.kind == "view":
            hs, he = (self.hs, self.he) if side == "q" else (self.kvs, self.kve)
            region = acc[:, self.start : self.start + self.nseg * self.length, hs:he]
            region += val.transpose(1, 2).reshape(b, self.nseg * self.length, he - hs, d)
            return
        pos = self.qdst if side == "q" else self.kpos
        heads = self.hq if side == "q" else self.hk
        s, o, l = pos.shape
        v = val.transpose(1, 2).reshape(b, s, o, l, heads.shape[1], d).to(acc.dtype)
        idx = (slice(None), pos[..., None], heads[None, :, None, :])
        if side == "k" and not self.unique_k:
            bidx = torch.arange(b, device=acc.device)[:, None, None, None, None]
            acc.index_put_((bidx, pos[None, ..., None], heads[None, None, :, None, :]), v, accumulate=True)
        else:
            # unique (row, head) pairs (the trash row may repeat; it is discarded): no sort needed
            acc[idx] = acc[idx] + v


def _strided_kmode(offs, r, length, nrows, hs, he, rep, qoff) -> str:
    """"diag" / "shared" when a gather group of every offset has a strided view, else ""."""
    if qoff != 0 or r < 2 or length % r or nrows * r != length or len(offs) != r:
        return ""
    if hs % r or (he - hs) % r:
        return ""
    for i, (off, heads, _khead) in enumerate(offs):
        if off != i or heads != list(range(hs + off, he, r)):
            return ""
    if rep == 1:
        return "diag"
    if hs % rep == 0 and he % rep == 0 and rep % r == 0:
        kv = list(range(hs // rep, he // rep))
        if all(khead == kv for _, _, khead in offs):
            return "shared"
    return ""


def _plan_cpu(nq, nk, nheads, nheads_kv, segment_lengths, dilation_rates, head_assignment, chunk_rows):
    """The groups of every branch, with index tensors on the CPU (:func:`make_plan` caches them)."""
    qoff = nk - nq
    rep = nheads // nheads_kv
    groups: list[dict] = []
    touched: list[tuple[int, int]] = []
    ranges = branch_head_ranges(nheads, len(segment_lengths), head_assignment)
    for (w, r), (hs, he) in zip(zip(segment_lengths, dilation_rates, strict=True), ranges, strict=True):
        if he <= hs:
            continue
        nfull = nk // w
        s0 = qoff // w  # first segment that holds a query
        seg_types = []  # (first segment, count, length)
        if nfull > s0:
            seg_types.append((s0, nfull - s0, w))
        if nk % w:
            seg_types.append((nfull, 1, nk - nfull * w))
        use_view = r == 1 and (qoff == 0) and hs % rep == 0 and he % rep == 0
        # heads no earlier branch touched: this branch's groups write the accumulator directly
        fresh = all(he2 <= hs or he <= hs2 for hs2, he2 in touched)
        touched.append((hs, he))
        # at most ~chunk_rows query rows per attention call: bounds the call's temporaries
        # (its dq/dk/dv and the kernels' workspaces) to a fraction of the full tensors
        seg_types = [
            (f, min(c, first + count - f), length)
            for first, count, length in seg_types
            for c in [max(1, chunk_rows // length)]
            for f in range(first, first + count, c)
        ]
        for first, count, length in seg_types:
            if use_view:
                groups.append(
                    dict(kind="view", start=first * w, nseg=count, length=length, hs=hs, he=he,
                         kvs=hs // rep, kve=he // rep, fresh=fresh)
                )
                continue
            by_shape: dict[tuple, list] = {}
            for off in block_offsets(r, length):
                heads = [h for h in range(hs, he) if h % r == off]
                if not heads:
                    continue
                nrows = block_length(length, off, r)
                kv = [h // rep for h in heads]
                uniq = sorted(set(kv))
                counts = {u: kv.count(u) for u in uniq}
                if len(set(counts.values())) == 1:
                    khead, unique = uniq, True
                else:  # query heads of this offset share kv heads unevenly: repeat K/V rows
                    khead, unique = kv, False
                key = (nrows, len(heads), len(khead), unique)
                by_shape.setdefault(key, []).append((off, heads, khead))
            for (nrows, _, _, unique), offs in by_shape.items():
                kmode = _strided_kmode(offs, r, length, nrows, hs, he, rep, qoff)
                if kmode:
                    groups.append(
                        dict(kind="strided", start=first * w, nseg=count, length=length, hs=hs,
                             he=he, kvs=hs // rep, kve=he // rep, r=r, kmode=kmode, fresh=fresh)
                    )
                    continue
                segs = torch.arange(first, first + count)[:, None, None] * w  # (S, 1, 1)
                o_t = torch.tensor([o for o, _, _ in offs])[None, :, None]  # (1, O, 1)
                t = torch.arange(nrows)[None, None, :]  # (1, 1, L)
                kpos = block_row(segs, o_t, r, t)  # (S, O, L)
                qrow = kpos - qoff
                groups.append(
                    dict(
                        kind="gather",
                        kpos=kpos,
                        qsrc=qrow.clamp(min=0),
                        qdst=torch.where(qrow >= 0, qrow, torch.full_like(qrow, nq)),
                        hq=torch.tensor([h for _, h, _ in offs]),
                        hk=torch.tensor([kh for _, _, kh in offs]),
                        unique_k=unique,
                        fresh=fresh,
                    )
                )
    return groups


_GROUP_ROWS = 32768  # query rows per attention call (whole segments; at least one segment)


def make_plan(nq, nk, nheads, nheads_kv, segment_lengths, dilation_rates, head_assignment, device):
    """The groups of a call on ``device`` (cached in :mod:`..plan_cache`)."""
    args = (nq, nk, nheads, nheads_kv, segment_lengths, dilation_rates, head_assignment, _GROUP_ROWS)

    def build():
        return tuple(
            _Group(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in g.items()})
            for g in _plan_cpu(*args)
        )

    return cached_plan((__name__, *args, str(device)), build)


class _DilatedTorchFunction(torch.autograd.Function):
    # forward / setup_context split (no ctx in forward) so that torch.func transforms can run it
    @staticmethod
    def forward(q, k, v, key_padding_mask, plan, scale, causal, dropout_p, seed):
        b, nq, h, _ = q.shape
        dv = v.shape[-1]
        adt = acc_dtype(q.dtype)
        # row nq: the trash row of dummy query rows, only needed when queries are shorter than
        # keys; without it acc_out[:, :nq] is contiguous, so the float32/float64 output (no
        # cast copy) is contiguous like the others
        trash = 1 if nq < k.shape[1] else 0
        acc_out = torch.zeros(b, nq + trash, h, dv, dtype=adt, device=q.device)
        acc_lse = torch.full((b, nq + 1, h), float("-inf"), dtype=adt, device=q.device)
        for gid, grp in enumerate(plan):
            o_g, l_g = attn_fwd(
                grp.take(q, "q"), grp.take(k, "k"), grp.take(v, "k"), scale, causal,
                grp.take_mask(key_padding_mask), dropout_p, seed + gid,
            )
            grp.merge_into(acc_out, acc_lse, o_g, l_g, first=grp.fresh)
        out = acc_out[:, :nq].to(q.dtype)
        if not out.is_contiguous():  # float32/float64 with a trash row: a view of acc_out
            out = out.contiguous()
        del acc_out
        acc_lse[:, nq] = float("inf")  # dummy rows contribute nothing in the backward
        lse = acc_lse[:, :nq].permute(0, 2, 1).to(torch.float32, copy=True)  # (B, H, Nq)
        return out, lse, acc_lse  # acc_lse: for the backward only (dropped by the caller)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, key_padding_mask, plan, scale, causal, dropout_p, seed = inputs
        out, lse, acc_lse = output
        ctx.save_for_backward(q, k, v, key_padding_mask, out, acc_lse)
        ctx.plan, ctx.scale, ctx.causal, ctx.dropout_p, ctx.seed = plan, scale, causal, dropout_p, seed
        ctx.mark_non_differentiable(lse, acc_lse)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_DilatedTorchFunction, info, in_dims, args, ntensors=4)

    @staticmethod
    def backward(ctx, dout, _dlse, _dacc_lse):
        q, k, v, kpm, out, lse_pad = ctx.saved_tensors
        with backward_context(q.device.type):
            dq, dk, dv = _apply_backward(
                _DilatedTorchBackward, dout, q, k, v, kpm, out, lse_pad, ctx.plan, ctx.scale, ctx.causal, ctx.dropout_p, ctx.seed
            )
        grads = (dq, dk, dv, None, None, None, None, None, None)
        return no_double_backward("impl='torch'", grads, (dout, q, k, v))


class _DilatedTorchBackward(torch.autograd.Function):
    """The backward pass as a Function of its own, so that it has a vmap rule too
    (``vmap(grad(f))``, per-sample gradients) instead of in-place accumulation on batched
    tensors. Runs under :func:`..autograd_rules.backward_context` (no graph of its own)."""

    @staticmethod
    def forward(dout, q, k, v, kpm, out, lse_pad, plan, scale, causal, dropout_p, seed):
        b, nq, h, d = q.shape
        adt = acc_dtype(q.dtype)
        dq = torch.zeros(b, nq + 1, h, d, dtype=adt, device=q.device)
        dk = torch.zeros(k.shape, dtype=adt, device=q.device)
        dv = torch.zeros(v.shape, dtype=adt, device=q.device)
        dout = dout.contiguous()
        lse_pad = lse_pad.to(adt)
        for gid, grp in enumerate(plan):
            dq_g, dk_g, dv_g = attn_bwd(
                grp.take(dout, "q"), grp.take(q, "q"), grp.take(k, "k"), grp.take(v, "k"),
                grp.take(out, "q"), grp.take_rows_q_dst(lse_pad), scale, causal,
                grp.take_mask(kpm), dropout_p, seed + gid,
            )
            grp.add_into(dq, dq_g, "q")
            grp.add_into(dk, dk_g, "k")
            grp.add_into(dv, dv_g, "k")
        # cast one accumulator at a time and drop it, so that the float32 copies of dq/dk/dv
        # never coexist with all three casts (peak: 3 float32 accumulators + 1 cast, not + 3)
        dq = dq[:, :nq].to(q.dtype)
        dk = dk.to(k.dtype)
        dv = dv.to(v.dtype)
        return dq, dk, dv

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_DilatedTorchBackward, info, in_dims, args, ntensors=7)


def _vmap_by_folding(fn, info, in_dims, args, ntensors: int):
    """torch.func.vmap rule: fold the vmapped dimension into the batch dimension (dim 0 of the
    first ``ntensors`` arguments; the plan does not depend on the batch size), apply ``fn``
    once, unfold its outputs."""
    n = info.batch_size

    def fold(x, d):
        if x is None:
            return None
        x = x.unsqueeze(0).expand(n, *x.shape) if d is None else x.movedim(d, 0)
        return x.reshape(n * x.shape[1], *x.shape[2:])

    folded = [fold(x, d) for x, d in zip(args[:ntensors], in_dims[:ntensors], strict=True)]
    outs = fn.apply(*folded, *args[ntensors:])
    return tuple(o.reshape(n, o.shape[0] // n, *o.shape[1:]) for o in outs), (0,) * len(outs)


# ------------------------------------------------------------------ small calls on the CPU
# A call whose whole score matrix is small (H * Nq * Nk <= _DENSE_MAX_SCORES, float32/float64,
# CPU, no key padding, no dropout) runs as ONE fused attention call over all keys with an
# additive bias log m(i, j, h) (-inf where m = 0): softmax(s + log m) is exactly the definition's
# softmax counted with multiplicity. The bias is built once per call shape from the block
# geometry and cached; rows with no key get a zero bias row and are zeroed after (out = 0,
# lse = -inf, zero gradients). Per call this costs a few tensor ops instead of a few per group:
# the host overhead of tiny calls (benchmarks/bench_overhead.py).
_DENSE_MAX_SCORES = 1 << 18  # measured crossover on the CPU (fwd+bwd, causal): between 2^18 and 2^19
_DENSE_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class _DensePlan:
    bias: torch.Tensor  # (1, H, Nq, Nk): log m, -inf where m = 0, 0 on rows with no key
    keep: torch.Tensor | None  # (1, Nq, H, 1): 1 where the row has a key, 0 where not; None if all
    empty: torch.Tensor | None  # (1, H, Nq) bool: rows with no key; None if none


def _multiplicity_from_blocks(nq, nk, nheads, segment_lengths, dilation_rates, head_assignment, causal):
    """m(i, j, h) (H, Nq, Nk) int32 from the block geometry (the blocks every path computes)."""
    qoff = nk - nq
    m = torch.zeros(nheads, nq, nk, dtype=torch.int32)
    ranges = branch_head_ranges(nheads, len(segment_lengths), head_assignment)
    for (w, r), (hs, he) in zip(zip(segment_lengths, dilation_rates, strict=True), ranges, strict=True):
        for start, length in segments(nk, w):
            for off in block_offsets(r, length):
                heads = [h for h in range(hs, he) if h % r == off]
                if not heads:
                    continue
                rows = block_row(start, off, r, torch.arange(block_length(length, off, r)))
                qrows = rows[rows >= qoff] - qoff
                if qrows.numel() == 0:
                    continue
                for h in heads:
                    m[h, qrows[:, None], rows[None, :]] += 1
    if causal:
        i = torch.arange(qoff, nk)[:, None]
        j = torch.arange(nk)[None, :]
        m = m * (j <= i)
    return m


def _dense_plan(nq, nk, nheads, segment_lengths, dilation_rates, head_assignment, causal, dtype, device):
    args = (nq, nk, nheads, segment_lengths, dilation_rates, head_assignment, causal)

    def build():
        m = _multiplicity_from_blocks(*args)
        empty = (m == 0).all(-1)  # (H, Nq)
        bias = torch.where(m > 0, m.to(torch.float64).log(), torch.full((), float("-inf"), dtype=torch.float64))
        bias = torch.where(empty[..., None], torch.zeros((), dtype=torch.float64), bias)
        has_empty = bool(empty.any())
        return _DensePlan(
            bias=bias[None].to(dtype=dtype, device=device),
            keep=(~empty).T[None, :, :, None].to(dtype=dtype, device=device) if has_empty else None,
            empty=empty[None].to(device) if has_empty else None,
        )

    return cached_plan((__name__, "dense", *args, dtype, str(device)), build)


def _dense_applies(q, k, key_padding_mask, dropout_p) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in _DENSE_DTYPES
        and key_padding_mask is None
        and dropout_p == 0.0
        and q.shape[2] * q.shape[1] * k.shape[1] <= _DENSE_MAX_SCORES
    )


def _heads_first(q, k, v):
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    return qh, kh, vh


class _DenseFunction(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, plan, scale):
        qh, kh, vh = _heads_first(q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, False, attn_mask=plan.bias, scale=scale
        )
        out = out.transpose(1, 2)  # (B, Nq, H, D)
        out = out * plan.keep if plan.keep is not None else out.contiguous()
        lse_out = lse.to(torch.float32)
        if plan.empty is not None:
            lse_out = lse_out.masked_fill(plan.empty, float("-inf"))
        return out, lse_out, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, plan, scale = inputs
        out, _, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        ctx.mark_non_differentiable(output[1], lse)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_DenseFunction, info, in_dims, args, ntensors=3)

    @staticmethod
    def backward(ctx, dout, _dlse, _dlse_raw):
        q, k, v, out, lse = ctx.saved_tensors
        with backward_context(q.device.type):
            dq, dk, dv = _apply_backward(_DenseBackward, dout, q, k, v, out, lse, ctx.plan, ctx.scale)
        return no_double_backward("impl='torch'", (dq, dk, dv, None, None), (dout, q, k, v))


class _DenseBackward(torch.autograd.Function):
    @staticmethod
    def forward(dout, q, k, v, out, lse, plan, scale):
        # rows with no key have out = 0 (zeroed) and must get no gradient: their dout is zeroed,
        # so every gradient term of those rows is 0 (their zero-bias softmax stays finite)
        if plan.keep is not None:
            dout = dout * plan.keep
        qh, kh, vh = _heads_first(q, k, v)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), qh, kh, vh, out.transpose(1, 2), lse, 0.0, False,
            attn_mask=plan.bias, scale=scale,
        )
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            b, h, n, d = dk.shape
            dk = dk.view(b, h // rep, rep, n, d).sum(2)
            dv = dv.view(b, h // rep, rep, n, dv.shape[-1]).sum(2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_folding(_DenseBackward, info, in_dims, args, ntensors=6)


def _apply(fn, *args):
    """``fn.apply(*args)`` without ``Function.apply``'s per-call ``inspect.signature`` binding of
    default arguments (tens of microseconds; every argument here is passed positionally, so the
    binding changes nothing). Under torch.func transforms the full ``apply`` runs."""
    if torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*args)


def _apply_backward(fn, *args):
    """A backward Function (which exists for its vmap rule) under ``backward_context``: outside
    torch.func transforms its forward runs directly (grad mode is off: no node to record)."""
    if torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return fn.forward(*args)


def dilated_attention_torch_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    *,
    causal: bool,
    scale: float,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    head_assignment: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs only (see api.py: nothing is checked here again).

    Returns out (B, Nq, H, D) and lse (B, H, Nq) float32.
    """
    # PyTorch's CPU flash kernel (the private aten op both paths below call) reads the head dim
    # as if it had unit stride: a view with a strided last dim (e.g. a permuted (B, D, N, H)
    # buffer) would silently give wrong results, so such inputs are copied once
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if _dense_applies(q, k, key_padding_mask, dropout_p):
        plan = _dense_plan(
            q.shape[1], k.shape[1], q.shape[2], segment_lengths, dilation_rates, head_assignment,
            causal, q.dtype, q.device,
        )
        out, lse, _ = _apply(_DenseFunction, q, k, v, plan, scale)
        return out, lse
    plan = make_plan(
        q.shape[1], k.shape[1], q.shape[2], k.shape[2], segment_lengths, dilation_rates,
        head_assignment, q.device,
    )
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    out, lse, _ = _apply(_DilatedTorchFunction, q, k, v, key_padding_mask, plan, scale, causal, dropout_p, seed)
    return out, lse


# Dynamo runs this eagerly (one graph break): the plan is a Python structure built from the
# concrete sequence lengths, so tracing into it would recompile for every new length. Eager
# callers call :func:`dilated_attention_torch_eager` (no Dynamo wrapper to pass through).
dilated_attention_torch = torch.compiler.disable(dilated_attention_torch_eager)
