"""How much tile work the fused kernel computes per useful pair: packed documents vs one sequence.

A count, no GPU: for each branch (w, r), each document's segments, each head's offset o = h % r,
a block of L = ceil((segment length - o) / r) rows is tiled as the kernels tile it (query blocks
of BM rows, key blocks of BN; causal: key blocks up to the diagonal). "computed" counts every
tile in full (masked entries included), "useful" the pairs docs/spec.md counts. If packed
documents were slower per useful FLOP because of masked tiles, the ratio of (computed / useful)
packed to one sequence would show it; if it is near 1, the cost is elsewhere (per-program work,
short loops), which the kernel profile then has to show.

    python benchmarks/varlen_block_model.py              # bench_varlen.py's documents, 16 heads
    python benchmarks/varlen_block_model.py --causal no --blocks fwd=128x64,dkdv=64x64,dq=128x64
    python benchmarks/varlen_block_model.py \
        --profile benchmarks/results/profile_varlen_h100_2026-11-26_checked.md   # per branch

Measured on the H100 (2026-11-26, ``results/profile_varlen_h100_2026-11-26_checked.md``): raw
kernel times of the packed stream within 0-4% of one sequence's while its useful pairs are
0.853x; this count gives the packed stream 1.5-4% more tiles per useful pair.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def block_work(rows: int, bm: int, bn: int, causal: bool) -> tuple[int, int]:
    """(useful pairs, computed tile entries) of one head's block of ``rows`` rows."""
    if rows <= 0:
        return 0, 0
    useful = rows * (rows + 1) // 2 if causal else rows * rows
    computed = 0
    for i in range(-(-rows // bm)):
        hi = min(bm * (i + 1), rows)
        computed += (-(-hi // bn) if causal else -(-rows // bn)) * bm * bn
    return useful, computed


def block_sizes(lengths, w: int, r: int, heads: int):
    """The rows of every head's block of branch (w, r): each document's segments of w rows from
    its first row (the last one shorter), head h's block ceil((segment - h % r) / r) rows."""
    for n in lengths:
        for s in range(-(-n // w)):
            seg = min(w, n - s * w)
            for h in range(heads):
                yield max(0, -(-(seg - h % r) // r))


def stream_work(lengths, branches, heads: int, bm: int, bn: int, causal: bool) -> list[tuple[int, int]]:
    """Per branch: (useful, computed) summed over documents, segments and heads."""
    out = []
    for w, r in branches:
        u = c = 0
        for rows in block_sizes(lengths, w, r, heads):
            du, dc = block_work(rows, bm, bn, causal)
            u, c = u + du, c + dc
        out.append((u, c))
    return out


def stream_programs(lengths, branches, heads: int, bm: int) -> list[int]:
    """Per branch: the query tiles of bm rows over every head's block, i.e. the programs with rows
    of a forward kernel launched per (query tile, block): each pays the kernel's fixed cost once
    (its setup, and in the Gluon varlen kernels the TMA descriptors it makes)."""
    return [sum(-(-rows // bm) for rows in block_sizes(lengths, w, r, heads)) for w, r in branches]


def report(lengths, branches, heads: int, tiles: dict[str, tuple[int, int]], causal: bool) -> str:
    total = sum(lengths)
    lines = [f"{len(lengths)} documents, {total} tokens, {heads} heads, branches {branches}, "
             f"causal={causal}", "",
             "| kernel | BM x BN | computed / useful, packed | one sequence | packed / one "
             "| per branch | useful pairs, packed / one | computed, packed / one | per branch "
             "| query tiles (programs) per branch, packed / one |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, (bm, bn) in tiles.items():
        p = stream_work(lengths, branches, heads, bm, bn, causal)
        o = stream_work([total], branches, heads, bm, bn, causal)
        up, cp = sum(x[0] for x in p), sum(x[1] for x in p)
        uo, co = sum(x[0] for x in o), sum(x[1] for x in o)
        per = " ".join(f"{(c / u) / (c1 / u1):.2f}" for (u, c), (u1, c1) in zip(p, o, strict=True))
        per_c = " ".join(f"{c / c1:.3f}" for (_, c), (_, c1) in zip(p, o, strict=True))
        progs = " ".join(f"{a} / {b}" for a, b in zip(stream_programs(lengths, branches, heads, bm),
                                                      stream_programs([total], branches, heads, bm), strict=True))  # fmt: skip
        lines.append(f"| {name} | {bm} x {bn} | {cp / up:.3f} | {co / uo:.3f} | "
                     f"{(cp / up) / (co / uo):.3f} | {per} | {up / uo:.3f} | {cp / co:.3f} | {per_c} | {progs} |")
    return "\n".join(lines) + "\n"


def per_launch_times(profile_md: str) -> dict[str, tuple[list[float], list[float]]]:
    """``profile_varlen.py``'s "Per launch, in order" table: per kernel name, the packed and the
    one-sequence times (us) of its launches in order."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    in_table = False
    for line in open(profile_md):
        if line.startswith("## "):
            in_table = line.startswith("## Per launch")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if in_table and len(cells) == 5 and cells[0].isdigit():
            packed, one = out.setdefault(cells[1], ([], []))
            packed.append(float(cells[2]))
            one.append(float(cells[4]))
    return out


def per_branch_report(lengths, branches, heads, blocks, causal, profile_md: str) -> str:
    """Per kernel and branch: measured time packed / one sequence against the tile and
    useful-pair ratios of the count, and the microseconds above parity per useful pair."""
    times = per_launch_times(profile_md)
    total = sum(lengths)
    lines = [f"per branch, measured (`{profile_md}`) against the count", "",
             "| kernel | w, r | time packed / one | tiles | useful pairs | time per tile "
             "| time per useful pair | us above parity |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    kernels = {"fwd": "dilated_fwd_kernel", "dkdv": "dilated_bwd_dkdv_kernel",
               "dq": "dilated_bwd_dq_kernel"}  # fmt: skip
    for name, (bm, bn) in blocks.items():
        tp, to = times.get(kernels.get(name, name), ([], []))
        if len(tp) != len(branches):  # a folded launch, or another branch set
            lines.append(f"| {name} | {len(tp)} launches for {len(branches)} branches: skipped |"
                         " | | | | | |")
            continue
        p = stream_work(lengths, branches, heads, bm, bn, causal)
        o = stream_work([total], branches, heads, bm, bn, causal)
        for (w, r), a, b, (up, cp), (uo, co) in zip(branches, tp, to, p, o, strict=True):
            t, c, u = a / b, cp / co, up / uo
            lines.append(f"| {name} | {w}, {r} | {t:.3f} | {c:.3f} | {u:.3f} | {t / c:.3f} | "
                         f"{t / u:.3f} | {a - b * u:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", type=int, default=131072)
    p.add_argument("--mean-len", type=float, default=8192)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--segments", default="2048,4096,8192,16384,32768")
    p.add_argument("--dilations", default="1,2,4,8,16")
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--blocks", default="fwd=128x64,dq=128x64,dkdv=64x64",
                   help="the kernels' (BM x BN) for head dim 128 (triton_launch.default_configs)")
    p.add_argument("--profile", help="a profile_varlen.py results file (same documents, "
                   "branches, causal): per-branch measured times against the count")
    a = p.parse_args(argv)
    from bench_varlen import document_lengths  # torch: the benchmark's own lengths

    lengths = document_lengths(a.total, a.mean_len, a.sigma, a.seed)
    branches = list(zip((int(x) for x in a.segments.split(",")),
                        (int(x) for x in a.dilations.split(",")), strict=True))  # fmt: skip
    blocks = {k: tuple(int(x) for x in v.split("x")) for k, v in
              (kv.split("=") for kv in a.blocks.split(","))}  # fmt: skip
    print(report(lengths, branches, a.heads, blocks, a.causal == "yes"), end="")
    if a.profile:
        print()
        print(per_branch_report(lengths, branches, a.heads, blocks, a.causal == "yes", a.profile),
              end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
