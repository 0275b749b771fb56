"""Where the Gluon kernels start to pay: same-process A/B of eager training calls (issue 24, issue 23).

``gluon_fwd.MIN_ROWS`` (batch x seqlen x heads) keeps smaller calls on the Triton kernels, whose
plans launch them directly, because the Gluon kernels launch through Triton's Python launcher
with tensor descriptors built per call. That floor was set without a measurement (2026-11-28);
this script measures it. Arms, interleaved per round (A, B, C, A, B, C, ...) so that host drift
cancels out:

- ``gluon``: ``flags.set_gluon_forward(True)`` with ``MIN_ROWS = 0`` (and, with ``--bwd``,
  ``flags.set_gluon_backward(True)``);
- ``triton``: both Gluon switches off (the Triton kernels, direct launches);
- ``sdpa``: causal dense SDPA on the same data.

Rows: causal ``impl="triton"`` calls, batch 1, forward under no_grad and forward+backward, at
the sizes of :data:`SIZES` (issue 23's small call first). Per round and arm: the shared timer's
median (``dilated_attention.timing.median_ms``: CUDA events around each call) and the mean per
call of a back-to-back loop with one synchronisation at the end (host time included, what a
training loop sees); reported as the median over rounds.

    PYTHONPATH=src python3 benchmarks/gluon_floor.py --out $OUT/gluon_floor.md [--bwd] [--sizes 0,1]
    PYTHONPATH=src python3 benchmarks/gluon_floor.py --profile 50 [--bwd]   # where the host time goes

``--profile CALLS``: no table; ``cProfile`` of CALLS calls of the gluon arm at the first size
(forward, or forward+backward with ``--bwd``), the top functions by own time and by cumulative
time, and the same for the triton arm.

Exit 2 where the Gluon forward cannot run (no sm_90 GPU, no Gluon).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, results_header, training_calls  # noqa: E402

# (N, heads, headdim, segment lengths, dilation rates)
SIZES = [
    (4096, 8, 64, (512, 1024, 2048), (1, 2, 4)),
    (16384, 8, 64, (512, 1024, 2048), (1, 2, 4)),
    (16384, 16, 128, (2048, 4096, 8192, 16384), (1, 2, 4, 8)),
    (32768, 8, 64, (2048, 4096, 8192, 16384), (1, 2, 4, 8)),
    (65536, 16, 128, (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)),
]


def loop_us(fn, iters: int) -> float:
    """Mean microseconds per call of ``iters`` back-to-back calls, one synchronisation at the end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def armed(gluon: bool, bwd: bool, fn, direct: bool = False):
    """``fn`` with the Gluon switches set for its duration (``direct``: gluon_fwd.DIRECT_LAUNCH
    in the gluon arm)."""
    from dilated_attention import flags
    from dilated_attention.kernels import gluon_fwd

    def run():
        floor, block, was_direct = gluon_fwd.MIN_ROWS, gluon_fwd.D64_MIN_BLOCK, gluon_fwd.DIRECT_LAUNCH
        flags.set_gluon_forward(gluon)
        flags.set_gluon_backward(gluon and bwd)
        gluon_fwd.MIN_ROWS = gluon_fwd.D64_MIN_BLOCK = 0  # the floor measured here, not D64's rule
        gluon_fwd.DIRECT_LAUNCH = gluon and direct
        try:
            return fn()
        finally:
            gluon_fwd.MIN_ROWS, gluon_fwd.D64_MIN_BLOCK, gluon_fwd.DIRECT_LAUNCH = floor, block, was_direct
            flags.set_gluon_forward(None)
            flags.set_gluon_backward(None)

    return run


def measure(size, bwd: bool, args) -> list[str]:
    n, h, d, seg, dil = size
    c = training_calls(n, h, d, torch.bfloat16, list(seg), list(dil), torch.device("cuda"), "triton")
    rows = []
    for what, fn, dense in (("fwd", c["fwd"], c["dense_fwd"]), ("fwd+bwd", c["fb"], c["dense_fb"])):
        arms = {"gluon": armed(True, bwd, fn, args.direct), "triton": armed(False, bwd, fn), "sdpa": dense}
        ev = {a: [] for a in arms}
        lp = {a: [] for a in arms}
        for f in arms.values():
            f()
            f()
        for _ in range(args.rounds):
            for a, f in arms.items():
                ev[a].append(median_ms(f, "cuda", args.warmup, args.iters) * 1e3)
                lp[a].append(loop_us(f, args.iters))
        m = {a: (statistics.median(ev[a]), statistics.median(lp[a])) for a in arms}
        rows.append(
            f"| {n} | {h} x {d} | {len(seg)} | {what} | {m['gluon'][0]:.1f} | {m['triton'][0]:.1f} | "
            f"{m['sdpa'][0]:.1f} | {m['gluon'][1]:.1f} | {m['triton'][1]:.1f} | {m['sdpa'][1]:.1f} | "
            f"{m['triton'][1] / m['gluon'][1]:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def profile(size, bwd: bool, calls: int, top: int = 25, direct: bool = False) -> None:
    """cProfile of ``calls`` gluon-arm and triton-arm calls at ``size`` (host time per function)."""
    import cProfile
    import io
    import pstats

    n, h, d, seg, dil = size
    c = training_calls(n, h, d, torch.bfloat16, list(seg), list(dil), torch.device("cuda"), "triton")
    fn = c["fb"] if bwd else c["fwd"]
    for name, f in (("gluon", armed(True, bwd, fn, direct)), ("triton", armed(False, bwd, fn))):
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
        prof.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
            print(f"## {name} arm, N {n}, {h} x {d}, {len(seg)} branches, "
                  f"{'fwd+bwd' if bwd else 'fwd'}, {calls} calls, by {key}")  # fmt: skip
            print(buf.getvalue(), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bwd", action="store_true", help="the gluon arm also runs the Gluon backward")
    p.add_argument("--direct", action="store_true",
                   help="the gluon arm launches the Gluon kernels directly (gluon_fwd.DIRECT_LAUNCH)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="markdown file to write")
    p.add_argument("--sizes", default=None, help="comma-separated indices into SIZES (default: all)")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="cProfile CALLS calls at the first size instead of the table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("gluon_floor: needs an sm_90 (Hopper) GPU")
        return 2
    from dilated_attention.kernels import gluon_fwd

    if gluon_fwd.kernel_module() is None:
        print(f"gluon_floor: Gluon is missing: {gluon_fwd.import_error()}")
        return 2
    sizes = SIZES if args.sizes is None else [SIZES[int(i)] for i in args.sizes.split(",")]
    if args.profile:
        profile(sizes[0], args.bwd, args.profile, direct=args.direct)
        return 0
    lines = [*results_header("Gluon kernels vs Triton kernels on small eager calls (issue 24 / 23)",
                             "cuda", extra=[f"Gluon backward in the gluon arm: {args.bwd}",
                                            f"direct launches in the gluon arm: {args.direct}",
                                            f"current gluon_fwd.MIN_ROWS: {gluon_fwd.MIN_ROWS}"]), "",
             "Causal, batch 1, bf16, `impl=\"triton\"`; median over rounds of: event = the shared "
             "timer's median per call (us), loop = mean per call of back-to-back calls with one "
             "synchronisation (us, host included).", "",
             "| N | heads | branches | call | gluon event | triton event | sdpa event | gluon loop | "
             "triton loop | sdpa loop | triton / gluon (loop) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for size in sizes:
        lines += measure(size, args.bwd, args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
