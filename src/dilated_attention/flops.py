"""Useful FLOP counts (docs/spec.md, "Measuring speed"), from the branch geometry in closed form.

forward = 4 * headdim * sum_{branch b, head h} #{(i, j) attended in branch b by head h}
(a pair two branches share counts twice; causal counts only j <= i); backward = 2.5 x forward.
"""

from __future__ import annotations

from .branches import branch_head_ranges
from .geometry import block_length, block_offsets, first_query_row, segments


def _block_pairs(n: int, nq_rows: int, causal: bool) -> int:
    """Pairs in one (segment, offset) block of n key rows whose last nq_rows rows are queries."""
    if n <= 0 or nq_rows <= 0:
        return 0
    if not causal:
        return nq_rows * n
    # query row t (0-based in the block) sees t + 1 keys; queries are rows n - nq_rows .. n - 1
    first = n - nq_rows
    return (first + 1 + n) * nq_rows // 2


def dilated_pairs(
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    segment_lengths,
    dilation_rates,
    causal: bool = False,
    head_assignment: str = "all",
) -> int:
    """Number of (query, key, head, branch) incidences attended (with the paper's double counting)."""
    qoff = seqlen_k - seqlen_q
    total = 0
    ranges = branch_head_ranges(nheads, len(segment_lengths), head_assignment)
    for (w, r), (hs, he) in zip(zip(segment_lengths, dilation_rates, strict=True), ranges, strict=True):
        heads_per_off = [0] * r
        for h in range(hs, he):
            heads_per_off[h % r] += 1
        for s0, ls in segments(seqlen_k, w):
            for o in block_offsets(r, ls):
                if heads_per_off[o] == 0:
                    continue
                n = block_length(ls, o, r)
                # rows s0 + o + r t with position >= qoff are queries
                nq_rows = max(0, n - first_query_row(s0, o, r, qoff))
                total += heads_per_off[o] * _block_pairs(n, nq_rows, causal)
    return total


def dilated_flops(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    headdim: int,
    segment_lengths,
    dilation_rates,
    causal: bool = False,
    head_assignment: str = "all",
    backward: bool = False,
) -> float:
    """Useful FLOPs of dilated attention; ``backward=True`` gives forward + backward (3.5x)."""
    fwd = 4.0 * headdim * batch * dilated_pairs(
        seqlen_q, seqlen_k, nheads, segment_lengths, dilation_rates, causal, head_assignment
    )
    return fwd * 3.5 if backward else fwd


def dense_flops(
    batch: int, seqlen: int, nheads: int, headdim: int, causal: bool = False, backward: bool = False
) -> float:
    """Useful FLOPs of dense attention over seqlen x seqlen (causal counts j <= i)."""
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    fwd = 4.0 * headdim * batch * nheads * pairs
    return fwd * 3.5 if backward else fwd


def dilated_flops_varlen(
    seqlens_q,
    seqlens_k,
    nheads: int,
    headdim: int,
    segment_lengths,
    dilation_rates,
    causal: bool = False,
    head_assignment: str = "all",
    backward: bool = False,
) -> float:
    """Useful FLOPs of dilated attention over packed documents: the sum over documents of
    :func:`dilated_flops` of each document alone (document i has ``seqlens_q[i]`` queries,
    bottom-right aligned in its ``seqlens_k[i]`` keys; ``backward=True``: forward + backward).
    Lengths are Python ints (e.g. ``cu_seqlens.diff().tolist()``), one pair per document."""
    seqlens_q, seqlens_k = list(seqlens_q), list(seqlens_k)
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(
            f"seqlens_q has {len(seqlens_q)} documents and seqlens_k {len(seqlens_k)}: give one "
            "length pair per document"
        )
    total = 0.0
    for nq, nk in zip(seqlens_q, seqlens_k, strict=True):
        if nq > 0:
            total += dilated_flops(1, nq, nk, nheads, headdim, segment_lengths, dilation_rates,
                                   causal, head_assignment, backward)
    return total
