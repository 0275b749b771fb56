"""The sequence-parallel plan of one dilated-attention branch on one rank: which ranks it
exchanges rows with (peers and rounds), which attention blocks it computes (jobs), and the layout
of the K/V messages. Pure functions of the shapes (the same on every rank), cached per shape
(:func:`..plan_cache.cached_plan`); no communication here.

Used by :mod:`.sequence_parallel` (compute, autograd, entry point); semantics in docs/spec.md
("Sequence parallelism").
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..geometry import block_offsets, block_row, rows_in
from ..plan_cache import cached_plan
from .layout import chunk_owner, rank_chunks

# K/V exchange schedules: "allgather" posts every peer's rows in one round, "ring" one distance
# per round; "auto" picks allgather when no rank has more than two peers in the branch
EXCHANGE_MODES = ("auto", "allgather", "ring")



@dataclass
class Jobs:
    """Equally shaped (segment) blocks of one (source, offset): one attention call."""

    qidx: torch.Tensor  # (S, nq) local query rows
    kidx: torch.Tensor  # (S, nk) rows of the source K/V tensor
    causal: bool
    # qidx[s, t] == a + s*b + t*c: rows read and written through strided views, no gather
    qaff: tuple[int, int, int] | None = None
    kaff: tuple[int, int, int] | None = None  # same for kidx


@dataclass
class Offset:
    o: int
    hq: torch.Tensor  # (Gh,) query heads of this offset
    hk: torch.Tensor  # (Gk,) distinct kv heads they read
    kexp: torch.Tensor | None  # (Gh,) index into hk per query head when the sharing is uneven
    hq_aff: tuple[int, int] | None = None  # hq == h0 + step * arange(Gh): (h0, step)
    hk_aff: tuple[int, int] | None = None


@dataclass
class BranchPlan:
    w: int
    r: int
    offsets: list  # [Offset]
    jobs: dict  # (src, offset index) -> [Jobs]
    send_rows: dict  # dst -> [LongTensor local rows per offset index]
    recv_counts: dict  # src -> [rows per offset index]
    rounds: list  # [[peer, ...]] peers exchanged with in each round
    mode: str
    peers: int


def _rank_segments(x: int, L: int, w: int) -> range:
    return range(x * L // w, ((x + 1) * L - 1) // w + 1)


def _peers(x: int, P: int, L: int, w: int, causal: bool) -> tuple[list[int], list[int]]:
    """(ranks x sends to, ranks x receives from) in a branch of segment length w."""
    segs = _rank_segments(x, L, w)
    lo_rank = segs[0] * w // L
    hi_rank = min(P - 1, (min((segs[-1] + 1) * w, P * L) - 1) // L)
    near = [y for y in range(lo_rank, hi_rank + 1) if y != x]
    send = [y for y in near if not causal or y > x]
    recv = [y for y in near if not causal or y < x]
    return send, recv


def _affine1(t: torch.Tensor) -> tuple[int, int] | None:
    """(t0, step) if the 1-D int tensor is t0 + step * arange(n), else None."""
    if t.numel() == 0:
        return None
    step = int(t[1] - t[0]) if t.numel() > 1 else 1
    if step < 1 or not torch.equal(t, t[0] + step * torch.arange(t.numel())):
        return None
    return int(t[0]), step


def _affine2(idx: torch.Tensor) -> tuple[int, int, int] | None:
    """(a, b, c) if idx (S, n) == a + b * s + c * t, with b, c >= 1, else None."""
    rows = _affine1(idx[0])
    cols = _affine1(idx[:, 0])
    if rows is None or cols is None:
        return None
    a, c = rows
    b = cols[1]
    if not torch.equal(idx, a + b * torch.arange(idx.shape[0])[:, None] + c * torch.arange(idx.shape[1])):
        return None
    return a, b, c


def _offsets(H, Hkv, w, r, hs, he) -> list:
    """The dilation offsets of a branch with at least one query head in ``[hs, he)``."""
    rep = H // Hkv
    offsets = []
    for o in block_offsets(r, w):
        hq = [h for h in range(hs, he) if h % r == o]
        if not hq:
            continue
        kv = [h // rep for h in hq]
        uniq = sorted(set(kv))
        even = len({kv.count(u) for u in uniq}) == 1
        kexp = None if even else torch.tensor([uniq.index(x) for x in kv])
        offsets.append(Offset(o, torch.tensor(hq), torch.tensor(uniq), kexp,
                               _affine1(torch.tensor(hq)), _affine1(torch.tensor(uniq))))
    return offsets


def _schedule(mode, me, P, peers, max_peers):
    """(mode, rounds): every rank derives the same schedule from the same global numbers."""
    if mode == "auto":
        mode = "allgather" if max_peers <= 2 else "ring"
    if mode == "allgather":
        rounds = [peers] if peers else []
    else:
        rounds = []
        for d in range(1, P):
            rd = [y for y in (me - d, me + d) if y in peers]
            if rd:
                rounds.append(rd)
    return mode, rounds


def _plan_cpu(P, me, L, H, Hkv, w, r, hs, he, causal, mode):
    N = P * L
    offsets = _offsets(H, Hkv, w, r, hs, he)

    def rows(x, s, o, upto=None):
        """Global positions of rank x in segment s with offset o (below ``upto`` if given)."""
        seg_start = s * w
        seg_end = seg_start + min(w, N - seg_start)
        lo, hi = max(seg_start, x * L), min(seg_end, (x + 1) * L)
        if upto is not None:
            hi = min(hi, upto)
        t0, t1 = rows_in(lo, hi, block_row(seg_start, o, r, 0), r)
        return block_row(seg_start, o, r, t0), t1 - t0

    send_to, recv_from = _peers(me, P, L, w, causal)
    my_segs = _rank_segments(me, L, w)
    send_rows = {}
    for dst in send_to:
        shared = [s for s in _rank_segments(dst, L, w) if s in my_segs]
        per_o = []
        for off in offsets:
            parts = []
            for s in shared:
                p0, n = rows(me, s, off.o)
                parts.append(torch.arange(n) * r + (p0 - me * L))
            per_o.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
        send_rows[dst] = per_o
    jobs: dict = {}
    recv_counts = {}
    for src in [me, *recv_from]:
        src_segs = _rank_segments(src, L, w)
        shared = [s for s in my_segs if s in src_segs]
        counts = []
        for oi, off in enumerate(offsets):
            by_shape: dict = {}
            kbase = 0
            for s in shared:
                q0, nq = rows(me, s, off.o)
                k0, nk = rows(src, s, off.o)
                if nq and nk:
                    qi = torch.arange(nq) * r + (q0 - me * L)
                    if src == me:
                        ki = qi
                    else:
                        ki = torch.arange(kbase, kbase + nk)
                    by_shape.setdefault((nq, nk), []).append((qi, ki))
                kbase += nk
            counts.append(kbase)
            jobs[(src, oi)] = []
            for lst in by_shape.values():
                qi, ki = torch.stack([a for a, _ in lst]), torch.stack([b for _, b in lst])
                jobs[(src, oi)].append(Jobs(qi, ki, causal and src == me, _affine2(qi), _affine2(ki)))
        if src != me:
            recv_counts[src] = counts
    # the schedule depends only on global shapes, so every rank picks the same one
    max_peers = max(len(set(sum(_peers(x, P, L, w, causal), []))) for x in range(P))
    peers = sorted(set(send_to) | set(recv_from))
    mode, rounds = _schedule(mode, me, P, peers, max_peers)
    return BranchPlan(w, r, offsets, jobs, send_rows, recv_counts, rounds, mode, len(peers))


def _to_device(cpu: BranchPlan, device) -> BranchPlan:
    def mv(t):
        return None if t is None else t.to(device)

    return BranchPlan(
        cpu.w, cpu.r,
        [Offset(o.o, mv(o.hq), mv(o.hk), mv(o.kexp), o.hq_aff, o.hk_aff) for o in cpu.offsets],
        {k: [Jobs(mv(j.qidx), mv(j.kidx), j.causal, j.qaff, j.kaff) for j in v]
         for k, v in cpu.jobs.items()},
        {k: [mv(t) for t in v] for k, v in cpu.send_rows.items()},
        dict(cpu.recv_counts), cpu.rounds, cpu.mode, cpu.peers,
    )


def plan_branch(P, me, L, H, Hkv, w, r, hs, he, causal, mode, device) -> BranchPlan:
    """One branch's plan on ``device`` (cached in :mod:`..plan_cache`)."""
    args = (P, me, L, H, Hkv, w, r, hs, he, causal, mode)
    return cached_plan((__name__, *args, str(device)), lambda: _to_device(_plan_cpu(*args), device))


# ------------------------------------------------------------------ packed stream (varlen)
#
# A packed stream of N tokens holds documents ``cu[i]:cu[i+1]`` (global offsets); each document
# is its own sequence, so branch (w, r) cuts every document into segments of w starting at its
# first token (the last one shorter) and nothing crosses a document. Rank x holds one chunk
# ("contiguous") or two ("zigzag") of the stream; a segment may cross chunk (rank) boundaries.
# The rows of segment [s0, s1) with offset o are the positions s0 + o + r*t. Everything below
# is a pure function of (P, layout, cu, shapes), so sender and receiver derive the same message
# layout: the rows rank x sends to rank y are, per offset, the concatenation over the segments
# both touch (in increasing position order) of :func:`_sent`'s rows.


class _Stream:
    """Geometry of a packed stream over P ranks (host ints only)."""

    def __init__(self, P, layout, cu):
        self.P, self.layout, self.cu = P, layout, cu
        self.N = cu[-1]
        self.chunks = [rank_chunks(self.N, P, x, layout) for x in range(P)]
        self.csize = self.N // (P if layout == "contiguous" else 2 * P)

    def segment_at(self, p, w):
        """(s0, s1) of the segment of length w that holds position p."""
        d = bisect.bisect_right(self.cu, p) - 1  # cu[d] <= p < cu[d + 1] (empty documents skipped)
        a, b = self.cu[d], self.cu[d + 1]
        s0 = a + (p - a) // w * w
        return s0, min(s0 + w, b)

    def segments(self, x, w):
        """The segments that hold positions of rank x, in increasing order."""
        out = []
        for g0, g1, _ in self.chunks[x]:
            p = g0
            while p < g1:
                s0, s1 = self.segment_at(p, w)
                if not out or out[-1][0] < s0:
                    out.append((s0, s1))
                p = s1
        return out

    def owners(self, s0, s1):
        """The ranks that hold positions of [s0, s1) (s1 > s0)."""
        first, last = s0 // self.csize, (s1 - 1) // self.csize
        return sorted({chunk_owner(j, self.P, self.layout) for j in range(first, last + 1)})

    def rows(self, x, s0, s1, o, r):
        """Rank x's rows of the block (segment [s0, s1), offset o): [(position, local row, n)],
        one piece per chunk, in increasing position order; both advance by r."""
        out = []
        for g0, g1, l0 in self.chunks[x]:
            lo, hi = max(s0, g0), min(s1, g1)
            if lo >= hi:
                continue
            t0, t1 = rows_in(lo, hi, block_row(s0, o, r, 0), r)
            if t1 > t0:
                p0 = block_row(s0, o, r, t0)
                out.append((p0, l0 + p0 - g0, t1 - t0))
        return out


def _before(pieces, limit, r):
    """The rows of ``pieces`` at positions < limit (a prefix), as pieces."""
    out = []
    for p0, l0, n in pieces:
        m = min(n, max(0, -(-(limit - p0) // r)))
        if m:
            out.append((p0, l0, m))
        if m < n:
            break
    return out


def _count(pieces) -> int:
    return sum(n for _, _, n in pieces)


def _local(pieces, r) -> list[int]:
    return [l0 + r * t for _, l0, n in pieces for t in range(n)]


def _sent(src_rows, dst_rows, causal, r):
    """The rows of a block that its holder ``src`` sends to ``dst``: all of them when dst has
    rows of the block, and with ``causal`` only those before dst's last row."""
    if not dst_rows:
        return []
    if not causal:
        return src_rows
    p0, _, n = dst_rows[-1]
    return _before(src_rows, p0 + r * (n - 1), r)


def _plan_packed_cpu(P, me, layout, cu, H, Hkv, w, r, hs, he, causal, mode):
    st = _Stream(P, layout, cu)
    offsets = _offsets(H, Hkv, w, r, hs, he)
    groups: dict = {}  # (src, oi) -> {(nq, nk, causal): [(qrows, krows)]}
    send_rows: dict = {}  # dst -> [[local rows] per offset]
    recv_counts: dict = {}  # src -> [rows per offset]

    def job(src, oi, q, k, c):
        if q and k:
            groups.setdefault((src, oi), {}).setdefault((len(q), len(k), c), []).append((q, k))

    for s0, s1 in st.segments(me, w):
        owners = st.owners(s0, s1)
        for oi, off in enumerate(offsets):
            mine = st.rows(me, s0, s1, off.o, r)
            for x in owners:
                if x == me:
                    if not mine:
                        continue
                    if not causal:
                        rows = _local(mine, r)
                        job(me, oi, rows, rows, False)
                        continue
                    for i, piece in enumerate(mine):  # per chunk: causal inside, earlier chunks whole
                        rows = _local([piece], r)
                        job(me, oi, rows, rows, True)
                        job(me, oi, rows, _local(mine[:i], r), False)
                    continue
                theirs = st.rows(x, s0, s1, off.o, r)
                out = _sent(mine, theirs, causal, r)
                if out:
                    send_rows.setdefault(x, [[] for _ in offsets])[oi] += _local(out, r)
                inc = _sent(theirs, mine, causal, r)
                if not inc:
                    continue
                counts = recv_counts.setdefault(x, [0] * len(offsets))
                kbase = counts[oi]
                counts[oi] += _count(inc)
                if not causal:
                    job(x, oi, _local(mine, r), list(range(kbase, kbase + _count(inc))), False)
                    continue
                # a chunk's queries see x's rows before the chunk's first row, unmasked; chunks
                # that see the same rows share one entry (an entry's key rows must be distinct)
                by_m: dict = {}
                for piece in mine:
                    by_m.setdefault(_count(_before(inc, piece[0], r)), []).append(piece)
                for m, pieces in by_m.items():
                    job(x, oi, _local(pieces, r), list(range(kbase, kbase + m)), False)
    jobs: dict = {}
    for src in [me, *recv_counts]:
        for oi in range(len(offsets)):
            jobs[(src, oi)] = []
            for (_, _, c), lst in groups.get((src, oi), {}).items():
                qi = torch.tensor([a for a, _ in lst], dtype=torch.long)
                ki = torch.tensor([b for _, b in lst], dtype=torch.long)
                jobs[(src, oi)].append(Jobs(qi, ki, c, _affine2(qi), _affine2(ki)))
    send_rows = {d: [torch.tensor(x, dtype=torch.long) for x in per_o] for d, per_o in send_rows.items()}
    # the exchange schedule from global numbers (every rank agrees): peers through the segments
    # that cross a chunk boundary
    near = [set() for _ in range(P)]
    for x in range(P):
        for g0, _, _ in st.chunks[x]:
            if 0 < g0 < st.N:
                s0, s1 = st.segment_at(g0, w)
                if s0 < g0:
                    own = st.owners(s0, s1)
                    for y in own:
                        near[y] |= set(own) - {y}
    peers = sorted(set(send_rows) | set(recv_counts))
    mode, rounds = _schedule(mode, me, P, peers, max((len(n) for n in near), default=0))
    return BranchPlan(w, r, offsets, jobs, send_rows, recv_counts, rounds, mode, len(peers))


def plan_branch_packed(P, me, layout, cu, H, Hkv, w, r, hs, he, causal, mode, device) -> BranchPlan:
    """One branch's plan over a packed stream with global document offsets ``cu`` (a tuple of
    host ints; cached in :mod:`..plan_cache`). Same structure as :func:`plan_branch`."""
    args = (P, me, layout, tuple(cu), H, Hkv, w, r, hs, he, causal, mode)
    return cached_plan((__name__, "packed", *args, str(device)),
                       lambda: _to_device(_plan_packed_cpu(*args), device))


# ------------------------------------------------------------------------------ message layout


def kv_sizes(plan, counts, b, d, with_mask):
    """Flat sizes of (k, v[, mask]) per offset in a K/V message."""
    out = []
    for off, n in zip(plan.offsets, counts, strict=True):
        gk = off.hk.numel()
        out += [b * n * gk * d, b * n * gk * d] + ([b * n] if with_mask else [])
    return out


def pack_kv(plan, rows_per_o, k, v, mask):
    parts = []
    for off, rows in zip(plan.offsets, rows_per_o, strict=True):
        sel = (slice(None), rows[:, None], off.hk[None, :])
        parts += [k[sel].reshape(-1), v[sel].reshape(-1)]
        if mask is not None:
            parts.append(mask[:, rows].to(k.dtype).reshape(-1))
    return torch.cat(parts) if parts else k.new_zeros(0)


def unpack_kv(plan, counts, buf, b, d, with_mask):
    """-> [(k (B, n, Gk, D), v, mask (B, n) | None)] per offset."""
    sizes = kv_sizes(plan, counts, b, d, with_mask)
    pieces = list(torch.split(buf, sizes)) if sizes else []
    res = []
    for off, n in zip(plan.offsets, counts, strict=True):
        gk = off.hk.numel()
        kk = pieces.pop(0).view(b, n, gk, d)
        vv = pieces.pop(0).view(b, n, gk, d)
        mm = pieces.pop(0).view(b, n) > 0.5 if with_mask else None
        res.append((kk, vv, mm))
    return res
