"""Block geometry of a dilated branch: which positions form each attention block (a leaf module).

Branch ``(w, r)`` cuts the key positions ``0 .. n-1`` into segments of length ``w`` (segment
``s`` covers ``[s*w, min((s+1)*w, n))``; the last one may be short). Inside a segment, offset
``o`` (``0 <= o < r``) selects the rows ``s*w + o + r*t``, ``t = 0, 1, ...``: one dense
attention block, attended by the query heads ``h`` with ``h % r == o`` (docs/spec.md,
"Definition"). Queries shorter than keys are bottom-right aligned: query row ``i`` is position
``qoff + i`` with ``qoff = seqlen_k - seqlen_q``, so a block's first query is its first row at
position ``>= qoff``.

Every implementation and the FLOP count derive their blocks from these functions, so they agree
on the rows of every block, including the short last segment and offsets with no row in it.
The functions take ints; :func:`block_row` also broadcasts over tensors.
"""

from __future__ import annotations

from collections.abc import Iterator


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``b > 0``), exact for negative ``a`` too."""
    return -(-a // b)


def segments(n: int, w: int) -> Iterator[tuple[int, int]]:
    """``(start, length)`` of every segment of length ``w`` over ``n`` positions (last one short)."""
    for start in range(0, n, w):
        yield start, min(w, n - start)


def block_offsets(r: int, seg_len: int) -> range:
    """The offsets ``o`` whose block has at least one row in a segment of ``seg_len`` rows."""
    return range(min(r, seg_len))


def block_length(seg_len: int, o: int, r: int) -> int:
    """Rows of the residue class ``o`` (mod ``r``) in a segment of ``seg_len`` rows."""
    return max(0, ceil_div(seg_len - o, r))


def block_row(seg_start, o, r: int, t):
    """Position of row ``t`` of the block of offset ``o`` in the segment starting at ``seg_start``.

    Works elementwise on tensors (broadcasting), e.g. ``t = torch.arange(block_length(...))``.
    """
    return seg_start + o + r * t


def first_row_at_or_after(pos: int, first: int, r: int) -> int:
    """The smallest ``t >= 0`` with ``first + r*t >= pos``."""
    return max(0, ceil_div(pos - first, r))


def rows_in(lo: int, hi: int, first: int, r: int) -> tuple[int, int]:
    """Index range ``[t0, t1)`` of the positions ``first + r*t`` (t >= 0) that lie in ``[lo, hi)``.

    Empty ranges come back as ``t0 == t1``.
    """
    t0 = first_row_at_or_after(lo, first, r)
    return t0, max(t0, ceil_div(hi - first, r))


def first_query_row(seg_start: int, o: int, r: int, qoff: int) -> int:
    """Index of the first row of a block that is a query (position ``>= qoff``)."""
    return first_row_at_or_after(qoff, seg_start + o, r)


def query_segments(nq: int, nk: int, w: int) -> tuple[int, int]:
    """``(first, count)``: the segments of length ``w`` that hold at least one query row.

    Queries are the last ``nq`` of ``nk`` positions (bottom-right aligned), so segments before
    ``(nk - nq) // w`` hold keys only.
    """
    first = (nk - nq) // w
    return first, ceil_div(nk, w) - first


def max_block_length(n: int, w: int, r: int) -> int:
    """The longest block (rows of one residue class in one segment) over ``n`` positions."""
    return ceil_div(min(w, n), r)
