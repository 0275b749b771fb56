"""benchmarks/block_ceiling.py: its block groups are the row's geometry (their pairs are
``dilated_pairs``), and its CPU smoke run writes the tables."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import block_ceiling  # noqa: E402

from dilated_attention.flops import dilated_pairs  # noqa: E402


def test_block_groups_count_the_rows_pairs():
    """For random rows (short last segments, w % r != 0, w > N, split heads, causal or not) the
    groups' pairs equal dilated_pairs, and every block length is a residue class's."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 700)
        nb = rng.randint(1, 4)
        dil = [rng.randint(1, 9) for _ in range(nb)]
        seg = [rng.randint(r, 3 * n + r) for r in dil]
        h = rng.choice([1, 2, 4, 6, 8])
        ha = rng.choice(["all", "split"]) if h >= nb else "all"
        causal = rng.random() < 0.5
        groups = block_ceiling.block_groups(n, h, seg, dil, ha)
        assert block_ceiling.group_pairs(groups, 3, causal) == 3 * dilated_pairs(
            n, n, h, seg, dil, causal, ha
        )
        for i, w, r, length, c in groups:
            assert (w, r) == (seg[i], dil[i]) and c > 0
            assert 0 < length <= -(-min(w, n) // r)


def test_block_groups_of_a_known_row():
    """N = 10, w = 4, r = 3, heads 0..3 (offsets 0, 1, 2, 0): segments of 4, 4 and 2 rows."""
    groups = block_ceiling.block_groups(10, 4, [4], [3])
    # offset 0: 2 rows in a 4-row segment, 1 in the 2-row one; offsets 1, 2: 1 row (the short
    # segment's offset 2 has none); heads per offset 2, 1, 1
    assert groups == [(0, 4, 3, 2, 4), (0, 4, 3, 1, 7)]


@pytest.mark.parametrize("rows", ["8br-paper-d64-fp16-causal,w%r-r64-n65536"])
def test_tiny_run_writes_the_tables(tmp_path, rows, capsys):
    out = tmp_path / "ceiling.md"
    block_ceiling.main(["--tiny", "--rows", rows, "--per-branch", "--out", str(out)])
    text = out.read_text()
    for name in rows.split(","):
        assert f"| {name} | fwd |" in text and f"| {name} | fwd+bwd |" in text
        assert f"| {name} | sum of branches / whole call |" in text
    # the 8br row at CPU size has two branches of (1, 1): both are listed
    per_branch = text.split("## Per branch")[1]
    assert per_branch.count("| 8br-paper-d64-fp16-causal | 1 | 1 |") == 2
    assert "nan" not in text
