"""Tile counts of the Gluon kernels over packed documents against one sequence of the same tokens
(issue 22 item 2b; CPU only, no timing): per branch, the programs (query tiles of 128 rows, per
head) and the (query tile, key tile) pairs they compute, of ``bench_varlen.py``'s packed batch.

With the kernels' measured times per branch (``profile_varlen.py``), this separates work the
packed batch must do from what it pays per program: if the packed kernels take the same time
per tile pair as one sequence's, their time ratio equals the tile-pair ratio printed here.

    python3 benchmarks/varlen_tiles.py [--total 131072 --mean-len 8192 --sigma 1 --tile 128]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_varlen import document_lengths  # noqa: E402


def tiles(lens: list[int], w: int, r: int, heads: int, causal: bool, tile: int) -> tuple[int, int, float]:
    """(programs, tile pairs, useful pairs) of branch (w, r) over documents ``lens``: each
    document's segments of w rows from its first row (the last one shorter), head h's block of
    a segment of n rows ceil((n - h % r) / r) rows long; causal counts the diagonal tiles whole."""
    progs = pairs = 0
    useful = 0.0
    for n_doc in lens:
        for s in range(0, n_doc, w):
            n = min(w, n_doc - s)
            for h in range(heads):
                b = max(0, -(-(n - h % r) // r))
                nt = -(-b // tile)
                progs += nt
                pairs += nt * (nt + 1) // 2 if causal else nt * nt
                useful += b * (b + 1) / 2 if causal else b * b
    return progs, pairs, useful


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", type=int, default=131072)
    p.add_argument("--mean-len", type=float, default=8192)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--segments", default="2048,4096,8192,16384,32768")
    p.add_argument("--dilations", default="1,2,4,8,16")
    p.add_argument("--tile", type=int, default=128, help="rows of a query and of a key tile")
    a = p.parse_args()
    lens = document_lengths(a.total, a.mean_len, a.sigma, a.seed)
    seg = [int(x) for x in a.segments.split(",")]
    dil = [int(x) for x in a.dilations.split(",")]
    print(f"{len(lens)} documents, {sum(lens)} tokens, longest {max(lens)}; {a.heads} heads; tiles of {a.tile}")
    print("| causal | w | r | programs one / packed | tile pairs one / packed | packed / one | pairs a program one / packed |")
    print("|---|---|---|---|---|---|---|")
    for causal in (False, True):
        tot = [0.0, 0.0, 0.0, 0.0]
        for w, r in zip(seg, dil, strict=True):
            p1, t1, u1 = tiles([sum(lens)], w, r, a.heads, causal, a.tile)
            p2, t2, u2 = tiles(lens, w, r, a.heads, causal, a.tile)
            tot = [tot[0] + t1, tot[1] + t2, tot[2] + u1, tot[3] + u2]
            print(f"| {causal} | {w} | {r} | {p1} / {p2} | {t1} / {t2} | {t2 / t1:.3f} | {t1 / p1:.1f} / {t2 / p2:.1f} |")
        print(f"| {causal} | all | | | {tot[0]:.0f} / {tot[1]:.0f} | {tot[1] / tot[0]:.3f} | useful pairs packed / one "
              f"{tot[3] / tot[2]:.3f} |")


if __name__ == "__main__":
    main()
