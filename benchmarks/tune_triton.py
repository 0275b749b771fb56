"""Sweep the Triton kernels' block configs on the GPU (one kernel varied at a time).

    PYTHONPATH=src python3 benchmarks/tune_triton.py --n 131072 --max-seconds 240 --out tune.md

For each candidate (BM, BN, num_warps, num_stages) of the forward, dK/dV and dQ kernels (set
through the private ``DILATED_ATTENTION_TRITON_CONFIG`` override, the others at their
defaults) it first checks out/dq/dk/dv against the default config on fresh random inputs at
N = 32768 (relative Frobenius error < 1e-2: same math, different summation order), then times
the forward (forward configs) or forward+backward (dK/dV, dQ configs) at --n, bf16, batch 1,
16 heads x 128, LongNet branches, not causal. Configs that fail to compile (shared memory) or
disagree are reported as such. Last, the best of each kernel combined against the defaults,
causal and not. Stops starting new candidates after --max-seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from dilated_attention import dilated_attention
from dilated_attention.flops import dilated_flops

ENV = "DILATED_ATTENTION_TRITON_CONFIG"
SEG, DIL = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 4, 3),
            (128, 32, 8, 3)],
    "dkdv": [(32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 1), (32, 128, 8, 3), (64, 64, 4, 2),
             (32, 64, 4, 3), (16, 128, 8, 2), (64, 128, 4, 2)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3),
           (128, 32, 4, 3)],
}


def _run(n, causal, backward, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(1, n, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = dilated_attention(q, k, v, SEG, DIL, causal=causal, impl="triton")
    if not backward:
        return [out.detach()]
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _time(n, causal, backward):
    import triton.testing

    q, k, v, do = (torch.randn(1, n, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def f():
        out = dilated_attention(q, k, v, SEG, DIL, causal=causal, impl="triton")
        if backward:
            out.backward(do)

    if backward:
        f()
        ms = triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")
    else:
        with torch.no_grad():
            ms = triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")
    return ms


def _spec(kernel, cfg):
    return f"{kernel}={','.join(map(str, cfg))}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--max-seconds", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--candidates", default=None,
                   help="replace the built-in list, e.g. 'dkdv=64,64,4,3;dq=128,64,8,2' (the default "
                        "config of each kernel named is always timed too)")
    a = p.parse_args()
    cands = CANDIDATES
    if a.candidates:
        from dilated_attention.kernels.triton_dilated import _configs

        default = _configs(128, False)
        cands = {}
        for item in filter(None, (s.strip() for s in a.candidates.split(";"))):
            name, _, vals = item.partition("=")
            cands.setdefault(name.strip(), [default[name.strip()]]).append(tuple(int(x) for x in vals.split(",")))
    import triton

    t0 = time.time()
    os.environ.pop(ENV, None)
    ref = _run(32768, False, True)
    fl = dilated_flops(1, a.n, a.n, 16, 128, SEG, DIL, False)
    lines = ["| kernel | BM, BN, warps, stages | check (max rel err vs default) | ms | TFLOP/s |",
             "|---|---|---|---|---|"]
    best: dict = {}
    for kernel, kc in cands.items():
        for cfg in kc:
            if time.time() - t0 > a.max_seconds:
                lines.append(f"| {kernel} | {cfg} | not run (time) | | |")
                continue
            os.environ[ENV] = _spec(kernel, cfg)
            try:
                got = _run(32768, False, True)
                err = max(_rel(x, y) for x, y in zip(got, ref, strict=True))
                if not err < 1e-2:
                    lines.append(f"| {kernel} | {cfg} | MISMATCH {err:.2e} | | |")
                    continue
                bwd = kernel != "fwd"
                ms = _time(a.n, False, bwd)
                tf = (3.5 if bwd else 1.0) * fl / ms / 1e9
                lines.append(f"| {kernel} | {cfg} | {err:.1e} | {ms:.2f} | {tf:.0f} |")
                if kernel not in best or ms < best[kernel][1]:
                    best[kernel] = (cfg, ms)
            except Exception as e:  # compile failures (shared memory), keep sweeping
                lines.append(f"| {kernel} | {cfg} | ERR {type(e).__name__}: {str(e)[:50]} | | |")
            finally:
                os.environ.pop(ENV, None)
                torch.cuda.empty_cache()
            print(lines[-1], flush=True)
    combo = ";".join(_spec(kk, c) for kk, (c, _) in best.items())
    lines += ["", f"best per kernel: `{ENV}=\"{combo}\"`", "",
              "| causal | config | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s |", "|---|---|---|---|---|"]
    for causal in (False, True):
        flc = dilated_flops(1, a.n, a.n, 16, 128, SEG, DIL, causal)
        for name, spec in (("default", ""), ("best", combo)):
            os.environ[ENV] = spec
            f_ms, b_ms = _time(a.n, causal, False), _time(a.n, causal, True)
            lines.append(f"| {causal} | {name} | {f_ms:.2f} | {b_ms:.2f} | {3.5 * flc / b_ms / 1e9:.0f} |")
            print(lines[-1], flush=True)
    os.environ.pop(ENV, None)
    head = [
        "# Triton block-config sweep",
        "",
        f"- command: `{' '.join(['python3'] + sys.argv)}`",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}",
        f"- N = {a.n}, bf16, batch 1, 16 heads x 128, w={SEG}, r={DIL}; sweep not causal",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
