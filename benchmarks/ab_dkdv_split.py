"""Issue 24: the dK/dV kernel in one launch (dK and dV in one program, the default) against two
launches (a dV-only pass, then a dK-only pass: 5 matrix products per block instead of 4, half
the accumulator state each; ``config={"dkdv_split": (BM, BN, warps, stages)}``).

    PYTHONPATH=src python3 benchmarks/ab_dkdv_split.py [--n 131072] [--out f.md]

At the headline shape (batch 1, 16 x 128 heads, bf16, LongNet branches w 2048..32768, r 1..16),
causal and not: the backward alone (``triton_launch.backward`` through its training plan, the
forward run once), do_bench medians over ``--rounds`` interleaved rounds, each variant's dK / dV
launches' GPU time from a profiler pass, the dQ, dK, dV bits checked equal to the one-launch
kernel's, and dense SDPA's backward (flash) in the same run. Registers and spills of the
variants on the CPU: ``benchmarks/kernel_resources.py --config "dkdv_split=..."`` (Triton 3.6:
2026-11-28, NOTES_triton.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import results_header  # noqa: E402

from dilated_attention.branches import branch_head_ranges  # noqa: E402
from dilated_attention.kernels import triton_launch as L  # noqa: E402

VARIANTS = {
    "one launch (default)": None,
    "split 64x64 w4 s2": {"dkdv_split": (64, 64, 4, 2)},
    "split 64x128 w8 s2": {"dkdv_split": (64, 128, 8, 2)},
    "split 64x64 w4 s3": {"dkdv_split": (64, 64, 4, 3)},
    "split 64x128 w8 s3": {"dkdv_split": (64, 128, 8, 3)},
}


def _kernel_ms(fn, name: str) -> float:
    """GPU time (ms) of the kernels whose name contains ``name`` in one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    tot = 0.0
    for e in prof.key_averages():
        if name in e.key:
            tot += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    return tot / 1e3


def run_case(a, causal: bool, names, seg, dil, hr, scale, dev) -> list[str]:
    """The table rows of one causal setting (every tensor freed on return)."""
    import triton

    lines = []
    q, k, v, do = (torch.randn(1, a.n, a.heads, a.headdim, device=dev, dtype=torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    out, lse = L.forward(q, k, v, None, seg, dil, causal, scale, hr)
    fns, want = {}, None
    for name in names:
        cfg = VARIANTS[name]

        def bwd(cfg=cfg):
            return L.backward(do, q, k, v, None, out, lse, seg, dil, causal, scale, hr, config=cfg)

        try:
            got = bwd()
            torch.cuda.synchronize()
        except Exception as e:  # a variant that does not compile says so; the others run
            lines.append(f"| {causal} | {name} | {type(e).__name__}: {str(e).splitlines()[0][:60]} | | | | |")
            print(lines[-1], flush=True)
            continue
        if want is None:
            want = got
        same = all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
        fns[name] = (bwd, same)
    # dense SDPA backward (flash) on the same tensors
    qd, kd, vd = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
    dod = do.transpose(1, 2)

    def dense_bwd():
        return torch.autograd.grad(od, (qd, kd, vd), dod, retain_graph=True)

    times = {name: [] for name in [*fns, "dense"]}
    for _ in range(a.rounds):
        for name, (fn, _) in fns.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))
        times["dense"].append(triton.testing.do_bench(dense_bwd, warmup=10, rep=100, return_mode="median"))
    dense_ms = statistics.median(times["dense"])
    base = statistics.median(times[names[0]]) if names and names[0] in fns else None
    for name, (fn, same) in fns.items():
        ms = statistics.median(times[name])
        kms = _kernel_ms(fn, "dkdv")
        ratio = f"{ms / base:.3f}x" if base else ""
        lines.append(f"| {causal} | {name} | {ms:.3f} | {ratio} | {kms:.3f} | {'yes' if same else '**NO**'} "
                     f"| {dense_ms:.3f} |")
        print(lines[-1], flush=True)
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    hr = branch_head_ranges(a.heads, len(seg), "all")
    scale = a.headdim**-0.5
    names = [v for v in a.variants.split(",") if v]
    lines = results_header(f"dK/dV in one launch vs split in two (issue 24), N={a.n}", dev) + [
        "",
        f"Batch 1, {a.heads} x {a.headdim} bf16, branches {seg} / {dil}; backward only "
        f"(`triton_launch.backward`, training plan), do_bench medians, {a.rounds} interleaved rounds "
        "(the median of the rounds' medians); dK/dV ms: the dK/dV launches' GPU time (profiler).",
        "",
        "| causal | variant | bwd ms | vs one launch | dK/dV kernels ms | bits equal | dense SDPA bwd ms |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    torch.manual_seed(0)
    for causal in (False, True):
        lines += run_case(a, causal, names, seg, dil, hr, scale, dev)
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
