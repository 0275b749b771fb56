"""The sequence-parallel plan of one dilated-attention branch on one rank: which ranks it
exchanges rows with (peers and rounds), which attention blocks it computes (jobs), and the layout
of the K/V messages. Pure functions of the shapes (the same on every rank), cached per shape
(:func:`..plan_cache.cached_plan`); no communication here.

Used by :mod:`.sequence_parallel` (compute, autograd, entry point); semantics in docs/spec.md
("Sequence parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..geometry import block_offsets, block_row, rows_in
from ..plan_cache import cached_plan

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


def _plan_cpu(P, me, L, H, Hkv, w, r, hs, he, causal, mode):
    N = P * L
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
    if mode == "auto":
        mode = "allgather" if max_peers <= 2 else "ring"
    peers = sorted(set(send_to) | set(recv_from))
    if mode == "allgather":
        rounds = [peers] if peers else []
    else:
        rounds = []
        for d in range(1, P):
            rd = [y for y in (me - d, me + d) if y in peers]
            if rd:
                rounds.append(rd)
    return BranchPlan(w, r, offsets, jobs, send_rows, recv_counts, rounds, mode, len(peers))


def plan_branch(P, me, L, H, Hkv, w, r, hs, he, causal, mode, device) -> BranchPlan:
    """One branch's plan on ``device`` (cached in :mod:`..plan_cache`)."""
    args = (P, me, L, H, Hkv, w, r, hs, he, causal, mode)

    def build():
        cpu = _plan_cpu(*args)

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

    return cached_plan((__name__, *args, str(device)), build)


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
