"""Branch bookkeeping shared by every implementation: which heads take part in which branch.

This file owns the pure-Python facts of the definition (docs/spec.md, "Definition") that do not
touch tensors: the head ranges of ``head_assignment="all"`` / ``"split"`` and the validation of
the branch lists. Which rows form each block: :mod:`.geometry`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


def branch_head_ranges(nheads: int, nbranches: int, head_assignment: str) -> list[tuple[int, int]]:
    """Half-open head range ``[start, stop)`` that takes part in each branch.

    ``"all"``: every head in every branch (the paper).
    ``"split"``: ``nbranches`` contiguous groups, as even as possible, the first
    ``nheads % nbranches`` groups one head larger; group b takes part in branch b only.
    A group may be empty when ``nheads < nbranches``; that branch then contributes nothing.
    """
    if head_assignment == "all":
        return [(0, nheads)] * nbranches
    if head_assignment == "split":
        base, extra = divmod(nheads, nbranches)
        ranges = []
        start = 0
        for b in range(nbranches):
            size = base + (1 if b < extra else 0)
            ranges.append((start, start + size))
            start += size
        return ranges
    raise ValueError(f"head_assignment must be 'all' or 'split', got {head_assignment!r}")


def normalize_branches(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate the branch lists and return them as tuples of ints."""
    if isinstance(segment_lengths, (int, str, bytes)) or isinstance(dilation_rates, (int, str, bytes)):
        raise TypeError(
            "segment_lengths and dilation_rates must be sequences of ints, e.g. "
            f"segment_lengths=[2048, 4096], dilation_rates=[1, 2]; got {segment_lengths!r}, "
            f"{dilation_rates!r}"
        )
    seg = tuple(segment_lengths)
    dil = tuple(dilation_rates)
    if len(seg) == 0:
        raise ValueError("segment_lengths is empty: give at least one branch, e.g. [2048]")
    if len(seg) != len(dil):
        raise ValueError(
            f"segment_lengths ({len(seg)} entries: {list(seg)}) and dilation_rates "
            f"({len(dil)} entries: {list(dil)}) must have the same length, one entry per branch"
        )
    for name, vals in (("segment_lengths", seg), ("dilation_rates", dil)):
        for v in vals:
            # bools are ints to Python, but dilation_rates=[True, 2] is a mistake, not 1
            if isinstance(v, bool):
                raise TypeError(f"{name} must hold ints, got the bool {v!r} in {list(vals)}")
            if not isinstance(v, int):
                try:
                    operator.index(v)
                except TypeError:
                    raise TypeError(f"{name} must hold ints, got {v!r} in {list(vals)}") from None
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {int(v)} in {list(vals)}")
    seg = tuple(int(x) for x in seg)
    dil = tuple(int(x) for x in dil)
    for w, r in zip(seg, dil, strict=True):
        if r > w:
            raise ValueError(
                f"dilation rate {r} is larger than its segment length {w}: this is usually "
                "swapped arguments; the order is (segment_lengths, dilation_rates)"
            )
    return seg, dil
