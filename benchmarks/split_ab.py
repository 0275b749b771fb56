"""``gluon_bwd.SPLIT_PHASES`` off or on, interleaved in one process: does it cost time (issue 24)?

The split-phase Gluon backward runs every branch's dK/dV kernels before any dQ kernel, so that
dk and dv are cast and freed before dq's float32 accumulator exists: peak 1.25x the 8 tensors
instead of 1.50x (H200, 2026-11-29). The kernels' work is the same; only its order and the
block-major lse / delta rows (built twice) differ. One run per arm in separate calls gave
+0.1..+8.9% and -2.1% on four rows, inside the spread of the same code across calls; this
script settles it: per row of ``benchmarks/sweep.py`` named by ``--rows``, same inputs, for
``--rounds`` rounds it times ``impl="triton"`` forward+backward with the switch off, then on
(``--iters`` calls each, CUDA events, the shared timer), and records each arm's peak memory over
one forward+backward. Reported per row: each arm's median over the rounds (min-max), the ratio
on / off of the medians and of each round's pair, and the peaks as multiples of the 8 tensors.

    PYTHONPATH=src python3 benchmarks/split_ab.py --rows headline,headline-causal --out $OUT/split_ab.md
    bash scripts/gpu_check.sh split-ab

Exit 2 without an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import command_line, median_ms, results_header, run_info  # noqa: E402
from sweep import _DT, eight_tensor_bytes, rows_named  # noqa: E402

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.branches import branch_head_ranges  # noqa: E402
from dilated_attention.kernels import gluon_bwd  # noqa: E402

ARMS = (("off", False), ("on", True))


def run_row(r, rounds: int, iters: int) -> dict:
    dev = torch.device("cuda")
    dt = _DT[r.dtype]
    q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device=dev, dtype=dt)
    k = torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    heads = branch_head_ranges(r.nheads, len(r.seg), "all")
    branches = [(w, d, hs, he) for w, d, (hs, he) in zip(r.seg, r.dil, heads, strict=True)]
    why = gluon_bwd.problem(q, k, v, r.causal, branches, q.shape[2])
    if why is not None:  # the switch would change nothing: no A/B to run
        return {"row": r.name, "error": f"the Gluon backward does not take this row: {why}"}

    def fb():
        out = dilated_attention(*xs, r.seg, r.dil, causal=r.causal, impl="triton")
        torch.autograd.grad(out, xs, do)

    res = {"row": r.name, "ms": {a: [] for a, _ in ARMS}, "peak_ratio": {}}
    keep = gluon_bwd.SPLIT_PHASES
    try:
        for name, on in ARMS:  # warm both arms, then the peak of one call each
            gluon_bwd.SPLIT_PHASES = on
            fb()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fb()
            torch.cuda.synchronize()
            res["peak_ratio"][name] = torch.cuda.max_memory_allocated() / eight_tensor_bytes(r)
        for i in range(rounds):
            for name, on in ARMS:
                gluon_bwd.SPLIT_PHASES = on
                res["ms"][name].append(median_ms(fb, "cuda", 1, iters))
            print(f"  {r.name:28} round {i}: off {res['ms']['off'][-1]:.2f} on {res['ms']['on'][-1]:.2f} ms",
                  flush=True)
    finally:
        gluon_bwd.SPLIT_PHASES = keep
    return res


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def markdown(results: list[dict], meta: dict, rounds: int, iters: int) -> str:
    lines = results_header("gluon_bwd.SPLIT_PHASES off / on, interleaved (issue 24)", info=meta)
    lines += [
        f"- {rounds} rounds per row, each timing off then on ({iters} forward+backward calls each: median, "
        "CUDA events); peak = torch.cuda.max_memory_allocated over one forward+backward / bytes of "
        "q, k, v, out, dout, dq, dk, dv",
        "",
        "| row | off ms, median (min-max) | on ms, median (min-max) | on / off (medians) | "
        "on / off per round, min-max | peak off | peak on |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        if "skipped" in res or "error" in res:
            lines.append(f"| {res['row']} | {res.get('skipped') or res.get('error')} |" + " |" * 5)
            continue
        off, on = res["ms"]["off"], res["ms"]["on"]
        pairs = [b / a for a, b in zip(off, on, strict=True)]
        lines.append(
            f"| {res['row']} | {_spread(off)} | {_spread(on)} | "
            f"{statistics.median(on) / statistics.median(off):.3f} | {min(pairs):.3f}-{max(pairs):.3f} | "
            f"{res['peak_ratio']['off']:.2f}x | {res['peak_ratio']['on']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", required=True, help="comma-separated sweep.py row names")
    p.add_argument("--out", help="markdown results file")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=300.0, help="start no row after this many seconds")
    args = p.parse_args(argv)
    try:
        want = rows_named(args.rows.split(","))
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1 or args.iters < 1:
        p.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("split_ab.py needs an sm_90 GPU (the Gluon backward)", file=sys.stderr)
        return 2
    meta = run_info(torch.device("cuda"), command_line("python3"))
    t0 = time.perf_counter()
    results = []
    for row in want:
        if time.perf_counter() - t0 > args.budget_s:
            results.append({"row": row.name, "skipped": f"skipped: budget {args.budget_s:.0f} s"})
            continue
        print(f"[{time.perf_counter() - t0:6.1f} s] {row.name}", flush=True)
        torch.manual_seed(0)
        try:
            results.append(run_row(row, args.rounds, args.iters))
        except Exception as e:  # report the row, keep going
            results.append({"row": row.name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                f.write(markdown(results, meta, args.rounds, args.iters))
    print(markdown(results, meta, args.rounds, args.iters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
