"""geometry.py against brute-force enumeration of the definition (docs/spec.md, "Definition"):
block b, segment s, offset o holds the positions p with p // w == s and (p % w) % r == o."""

from __future__ import annotations

import itertools

import torch

from dilated_attention.geometry import (
    block_length,
    block_offsets,
    block_row,
    ceil_div,
    first_query_row,
    rows_in,
    segments,
)

# awkward sizes: short last segments, r not dividing w, r == w, one-row segments
CASES = [(n, w, r) for n in (1, 2, 7, 16, 33) for w in (1, 3, 4, 8, 10) for r in (1, 2, 3, 4, 8)
         if r <= w]


def test_ceil_div():
    for a, b in itertools.product(range(-9, 10), range(1, 5)):
        assert ceil_div(a, b) == -(-a // b) == int(torch.tensor(a / b).ceil())


def test_blocks_match_definition():
    for n, w, r in CASES:
        segs = list(segments(n, w))
        assert [s for s, _ in segs] == list(range(0, n, w))
        assert sum(length for _, length in segs) == n
        covered = []
        for start, length in segs:
            want = {o: [p for p in range(start, start + length) if (p % w) % r == o] for o in range(r)}
            assert list(block_offsets(r, length)) == [o for o in range(r) if want[o]]
            for o in range(r):
                nrows = block_length(length, o, r)
                assert nrows == len(want[o]), (n, w, r, start, o)
                rows = [block_row(start, o, r, t) for t in range(nrows)]
                assert rows == want[o]
                covered += rows
                t = torch.arange(nrows)
                assert block_row(start, o, r, t).tolist() == want[o]  # tensors broadcast
                for qoff in range(0, n + 1):
                    first = next((t for t, p in enumerate(want[o]) if p >= qoff), len(want[o]))
                    assert min(first_query_row(start, o, r, qoff), nrows) == first
        assert sorted(covered) == list(range(n))  # the blocks of a branch partition the positions


def test_rows_in():
    for first, r, lo, hi in itertools.product(range(0, 6), range(1, 4), range(-2, 12), range(-2, 14)):
        t0, t1 = rows_in(lo, hi, first, r)
        want = [t for t in range(20) if lo <= first + r * t < hi]
        assert t0 <= t1
        assert list(range(t0, t1)) == want or (not want and t0 == t1), (first, r, lo, hi)


def test_flop_pairs_match_reference_multiplicity():
    """flops.dilated_pairs (built on geometry.py) counts exactly the incidences of the oracle."""
    from dilated_attention.flops import dilated_pairs
    from dilated_attention.reference import multiplicity

    for (nq, nk), h, (seg, dil), causal, ha in itertools.product(
        [(17, 17), (5, 23), (1, 10), (40, 40)], (1, 3, 4), [((4,), (1,)), ((3, 8), (2, 3)), ((5, 10, 16), (1, 4, 8))],
        (False, True), ("all", "split"),
    ):
        m = multiplicity(nq, nk, h, seg, dil, ha, causal)
        assert dilated_pairs(nq, nk, h, seg, dil, causal, ha) == int(m.sum()), (nq, nk, h, seg, dil, causal, ha)
