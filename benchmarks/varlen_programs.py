"""Programs per launch of the packed-documents (varlen) Triton kernels, counted on the CPU.

The launches that ``triton_launch.forward`` / ``backward`` make for ``bench_varlen.py``'s packed
batch (131072 tokens, lognormal documents of mean 8192, 16 x 128 bf16, LongNet branches), on
``meta`` tensors with the launchers replaced by a recorder: no GPU, no kernel runs. Per launch:
its grid's programs; the programs whose (document, segment) exists (blocks per segment x heads
x the documents' segments, ``sum ceil(n_d / w)``); the programs whose block has rows (the
blocks per segment are sized for the longest document: a shorter segment leaves the rest
empty); and the same launch on one sequence of the same tokens (programs, with rows). Run it on any tree (before / after a grid change) by pointing PYTHONPATH at it::

    PYTHONPATH=src python3 benchmarks/varlen_programs.py [--causal yes|no] [--total N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dilated_attention.branches import branch_head_ranges
from dilated_attention.kernels import direct_launch
from dilated_attention.kernels import triton_launch as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_varlen import _offsets, document_lengths  # noqa: E402

NAMES = {"dilated_fwd_kernel": "fwd", "dilated_fwd_folded_kernel": "fwd (folded)",
         "dilated_bwd_dkdv_kernel": "dkdv", "dilated_bwd_dq_kernel": "dq"}  # fmt: skip


def _record(run) -> list[tuple[str, int, dict]]:
    """(kernel, programs, arguments by name) of every launch ``run()`` makes (none run)."""
    seen = []

    def launch(self, grid, args, options):
        name = self.kernel.__name__
        if name in NAMES:
            a = dict(zip(self.names, args))
            a.update(options)
            seen.append((NAMES[name], grid[0] * (grid[1] if len(grid) > 1 else 1), a))

    real = direct_launch.DirectKernel.launch
    direct_launch.DirectKernel.launch = launch
    try:
        run()
    finally:
        direct_launch.DirectKernel.launch = real
    return seen


def _with_rows(name: str, a: dict, lens) -> int:
    """Programs of the launch (arguments ``a``) whose block has at least one row, over
    documents of ``lens`` rows (the kernels' ``_block_geometry``; dK/dV: programs with a head)."""
    if name == "fwd (folded)":  # a tile: rows congruent to c mod RMAX in one WMIN window
        wmin, rmax, bm = a["WMIN"], a["RMAX"], a["BM"]
        per_win = [-(-len(range(c, wmin, rmax)) // bm) for c in range(rmax)]
        n = sum(per_win) * (sum(x // wmin for x in lens))
        n += sum(-(-len(range(c, x % wmin, rmax)) // bm) for x in lens for c in range(rmax))
        return n * a["H"]
    w, r = a["W"], a["R"]
    if name == "dkdv":
        heads = []
        for g in range(a["HKV"]):
            for i0 in range(a["NI"]):
                h0 = g * a["REP"] + i0
                h_start = h0 + (max(a["HS"] - h0, 0) + r - 1) // r * r
                if h_start < min((g + 1) * a["REP"], a["HE"]):
                    heads.append(h0)
        blk = a["BN"]
    else:
        heads, blk = range(a["HS"], a["HS"] + a["NHB"]), a["BM"]
    n = 0
    for x in lens:
        for s0 in range(0, x, w):
            seglen = min(w, x - s0)
            n += sum(-(-(max(seglen - h % r + r - 1, 0) // r) // blk) for h in heads)
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--total", type=int, default=131072)
    a = p.parse_args(argv)
    causal = a.causal == "yes"
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    h, d, total, dt, dev = 16, 128, a.total, torch.bfloat16, "meta"
    lens = document_lengths(total, 8192, 1.0, 0)
    cu = _offsets(lens, dev)
    docs = L.Docs(cu, cu, max(lens), max(lens))
    ranges = branch_head_ranges(h, len(seg), "all")
    q, k, v, do = (torch.empty(1, total, h, d, device=dev, dtype=dt) for _ in range(4))
    args = (seg, dil, causal, d**-0.5, ranges)

    def step(dc):
        out, lse = L.forward(q, k, v, None, *args, docs=dc)
        L.backward(do, q, k, v, None, out, lse, *args, docs=dc)

    packed, one = _record(lambda: step(docs)), _record(lambda: step(None))
    print(f"{total} tokens in {len(lens)} documents (longest {max(lens)}), {h} x {d}, "
          f"branches {seg} / {dil}, causal={causal}\n")
    print("| kernel | w | r | programs | with a segment | with rows | one sequence | with rows |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    tot = [0] * 5
    for (name, n, args_), (_, n1, args1) in zip(packed, one, strict=True):
        w = args_.get("W", args_.get("WMIN"))
        if name == "fwd (folded)":
            per_seg, heads, r = args_["NT"] * args_["RMAX"], h, args_["RMAX"]
        else:
            per_seg = args_["NNB"] if name == "dkdv" else args_["NM"]
            heads = args_["HKV"] * args_["NI"] if name == "dkdv" else args_["NHB"]
            r = args_["R"]
        row = (n, per_seg * heads * sum(-(-x // w) for x in lens), _with_rows(name, args_, lens),
               n1, _with_rows(name, args1, [total]))
        tot = [t + x for t, x in zip(tot, row, strict=True)]
        print(f"| {name} | {w} | {r} | " + " | ".join(f"{x:,}" for x in row) + " |")
    print("| all | | | " + " | ".join(f"{x:,}" for x in tot) + " |")


if __name__ == "__main__":
    main()
