"""When should the Triton forward fold all branches into one launch? (issue 24)

For every row of ``benchmarks/sweep.py`` whose branches fold (``triton_launch.fold_geometry``),
times the forward through the launcher with ``fold=True`` and ``fold=False`` (per-branch
launches + merge), not causal and causal, and prints w_min / r_max (the rows of one residue class
in a folded tile's window) beside the forward BM. Same inputs, CUDA events via
``triton.testing.do_bench`` (median).

    PYTHONPATH=src python3 benchmarks/fold_rule.py --out results/fold_rule_h100_DATE.md
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

from dilated_attention.branches import branch_head_ranges
from dilated_attention.flops import dilated_flops
from dilated_attention.kernels import triton_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, results_header  # noqa: E402
from sweep import ROWS  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=None, help="comma-separated sweep row names (default: every folding row)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import triton.testing

    names = a.rows.split(",") if a.rows else None
    lines = [
        "| row | B | N | H/Hkv | D | w_min / r_max | fwd BM | causal | fold ms | per-branch ms | fold TF/s | per-branch TF/s | faster |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        if names and r.name not in names:
            continue
        hr = branch_head_ranges(r.nheads, len(r.seg), "all")
        branches = triton_launch.branch_list(list(r.seg), list(r.dil), hr)
        geo = triton_launch.fold_geometry(r.seqlen, r.seqlen, branches)
        if geo is None:
            continue
        dt = dict(bf16=torch.bfloat16, fp16=torch.float16)[r.dtype]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device="cuda", dtype=dt, generator=g)
        k, v = (torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device="cuda", dtype=dt, generator=g)
                for _ in range(2))
        bm = triton_launch.resolve_configs(r.headdim)["fwd"][0]
        for causal in (False, True):
            ms = {}
            outs = {}
            for fold in (True, False):
                f = functools.partial(triton_launch.forward, q, k, v, None, list(r.seg), list(r.dil),
                                      causal, r.headdim**-0.5, hr, fold=fold)
                with torch.no_grad():
                    outs[fold] = f()[0]
                    ms[fold] = triton.testing.do_bench(f, warmup=5, rep=30, return_mode="median")
            diff = (outs[True].float() - outs[False].float()).abs().max().item()
            fl = dilated_flops(r.batch, r.seqlen, r.seqlen, r.nheads, r.headdim, list(r.seg), list(r.dil),
                               causal=causal)
            tf = {f: fl / (ms[f] * 1e-3) / 1e12 for f in ms}
            line = (f"| {r.name} | {r.batch} | {r.seqlen} | {r.nheads}/{r.nheads_kv} | {r.headdim} | "
                    f"{geo[0]} / {geo[1]} = {geo[0] // geo[1]} | {bm} | {causal} | {ms[True]:.2f} | "
                    f"{ms[False]:.2f} | {tf[True]:.0f} | {tf[False]:.0f} | "
                    f"{'fold' if ms[True] < ms[False] else 'per-branch'} (max diff {diff:.1e}) |")
            print(line, flush=True)
            lines.append(line)
            del outs
        torch.cuda.empty_cache()
    head = results_header("Folded forward vs per-branch launches (issue 24)", "cuda", command_line("python3"))
    text = "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
