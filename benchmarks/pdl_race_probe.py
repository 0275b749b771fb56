"""Do the Gluon kernels' dependent launches (``gluon_fwd.PDL``) ever change a result? (CUDA)

Written in the thirty-sixth session, after the whole CUDA suite on an H200 (8 pytest workers
sharing the GPU) failed 12 Gluon-vs-reference tests, all causal, in runs of consecutive tests on
a few workers, where earlier sessions' runs (4 workers) had passed. Per case and arm (PDL on /
off), ``--reps`` times: q, k, v cast from float64 right before the call (a kernel writes them
just before the first Gluon launch, as a projection does in a model), forward and backward
through ``impl="triton"``, each result compared bitwise with the arm's first and with the
float64 reference. A dependent launch that reads rows before their writer completed gives
results that differ between repetitions; the same kernels without the attribute do not.

    PYTHONPATH=src:tests python3 benchmarks/pdl_race_probe.py --reps 20

Prints one row per (case, arm): the Gluon forward's launches, distinct results, max error
against the reference, the Triton kernels' error beside it (Gluon forward off; the same to three
digits where the error is the inputs' rounding to 16 bits, which both kernels see). Exit 1 if any arm gave more than one distinct result.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from gluon_cases import err, qkv, run  # noqa: E402

from dilated_attention import call_cache, flags  # noqa: E402
from dilated_attention.kernels import gluon_fwd  # noqa: E402

# (B, N, H, Hkv, D, seg, dil, head_assignment): the failing tests' geometries (the switches
# they need are on as shipped)
CASES = {
    "tail-batched-2x5000x8/4x128": (2, 5000, 8, 4, 128, [1024, 2048, 4096], [1, 2, 4], "all"),
    "tail-batched-2x4500x6/6x64": (2, 4500, 6, 6, 64, [2048, 4096], [2, 6], "all"),
    "even-1x8192x4/1x128": (1, 8192, 4, 1, 128, [2048, 8192], [2, 8], "all"),
    "even-1x4096x8/8x128-split": (1, 4096, 8, 8, 128, [1024, 2048, 4096], [1, 2, 4], "split"),
    "uneven-1x4096x8/4x128": (1, 4096, 8, 4, 128, [1024, 2048, 4096], [1, 3, 6], "all"),
    "tail-1x4500x6/6x64": (1, 4500, 6, 6, 64, [2048, 4096], [2, 6], "all"),
}


def count_gluon_launches() -> list[int]:
    """Wrap ``gluon_fwd.launch_branch`` (the Gluon forward's launches) with a counter, so that a
    row says whether the Gluon kernels ran at all."""
    n = [0]
    real = gluon_fwd.launch_branch

    def counted(*a, **kw):
        n[0] += 1
        return real(*a, **kw)

    gluon_fwd.launch_branch = counted
    return n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--causal", default="1", help="comma list of 0/1")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    bad = 0
    launches = count_gluon_launches()
    print("| case | dtype | causal | arm | Gluon fwd launches | distinct out / grads | max err out | max err dq | "
          "triton err out / dq |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.cases.split(","):
        b, n, h, hkv, d, seg, dil, ha = CASES[name]
        for dt in a.dtypes.split(","):
            dtype = getattr(torch, dt)
            for causal in (bool(int(c)) for c in a.causal.split(",")):
                torch.manual_seed(a.seed)
                q, k, v = qkv(b, n, h, hkv, d, torch.float64, "cuda")
                do = torch.randn_like(q)
                kw = dict(causal=causal, head_assignment=ha)
                ref = run(q, k, v, do, seg, dil, torch.float64, impl="reference", **kw)
                flags.set_gluon_forward(False)
                call_cache.clear()
                base = run(q, k, v, do, seg, dil, dtype, impl="triton", **kw)
                flags.set_gluon_forward(True)
                call_cache.clear()
                for arm in (True, False):
                    gluon_fwd.PDL = arm
                    first, distinct, e_out, e_dq = None, 0, 0.0, 0.0
                    launches[0] = 0
                    for _ in range(a.reps):
                        got = run(q, k, v, do, seg, dil, dtype, impl="triton", **kw)
                        flat = [got[0], got[1], *got[2]]
                        if first is None:
                            first, distinct = flat, 1
                        elif not all(torch.equal(x, y) for x, y in zip(flat, first, strict=True)):
                            distinct += 1
                        e_out = max(e_out, err(got[0], ref[0]))
                        e_dq = max(e_dq, err(got[2][0], ref[2][0]))
                    bad += distinct > 1
                    print(f"| {name} | {dt} | {causal} | PDL {'on' if arm else 'off'} | {launches[0]} | {distinct} of {a.reps} | "
                          f"{e_out:.3g} | {e_dq:.3g} | {err(base[0], ref[0]):.3g} / {err(base[2][0], ref[2][0]):.3g} |",
                          flush=True)
                gluon_fwd.PDL = True
    print(f"arms with more than one distinct result: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
