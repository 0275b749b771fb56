"""A kernel switch off or on, interleaved in one process (default ``gluon_bwd.SPLIT_PHASES``; issue 24).

``--switch MOD.NAME`` A/Bs another module switch of ``dilated_attention.kernels`` read per call
(e.g. ``gluon_fwd.PDL``, the dependent launches), ``--direction fwd`` / ``both`` times the
forward too (under no_grad).

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
DIRECTIONS = ("fb", "fwd", "both")


def resolve_switch(name: str):
    """(module, attribute) of ``MOD.NAME`` under ``dilated_attention.kernels``; ValueError
    naming what is missing."""
    import importlib

    mod_name, _, attr = name.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"--switch wants MOD.NAME (e.g. gluon_fwd.PDL), got {name!r}")
    try:
        mod = importlib.import_module(f"dilated_attention.kernels.{mod_name}")
    except ImportError as e:
        raise ValueError(f"--switch {name!r}: no module dilated_attention.kernels.{mod_name}") from e
    if not isinstance(getattr(mod, attr, None), bool):
        raise ValueError(f"--switch {name!r}: {mod_name} has no boolean {attr}")
    return mod, attr


def run_row(r, rounds: int, iters: int, switch=(gluon_bwd, "SPLIT_PHASES"), direction: str = "fb") -> dict:
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

    def fwd():
        with torch.no_grad():
            dilated_attention(*xs, r.seg, r.dil, causal=r.causal, impl="triton")

    fns = {"fb": fb, "fwd": fwd}
    dirs = ("fwd", "fb") if direction == "both" else (direction,)
    mod, attr = switch
    res = {"row": r.name, "ms": {a: [] for a, _ in ARMS}, "peak_ratio": {}}
    res["fwd_ms"] = {a: [] for a, _ in ARMS}
    keep = getattr(mod, attr)
    try:
        for name, on in ARMS:  # warm both arms, then the peak of one call each
            setattr(mod, attr, on)
            fwd()
            fb()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fb()
            torch.cuda.synchronize()
            res["peak_ratio"][name] = torch.cuda.max_memory_allocated() / eight_tensor_bytes(r)
        for i in range(rounds):
            for name, on in ARMS:
                setattr(mod, attr, on)
                for dname in dirs:
                    (res["ms"] if dname == "fb" else res["fwd_ms"])[name].append(
                        median_ms(fns[dname], "cuda", 1, iters))
            print(f"  {r.name:28} round {i}: " + ", ".join(
                f"{key} off {res[key]['off'][-1]:.2f} on {res[key]['on'][-1]:.2f} ms"
                for key in ("fwd_ms", "ms") if res[key]["off"]), flush=True)  # fmt: skip
    finally:
        setattr(mod, attr, keep)
    return res


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def markdown(results: list[dict], meta: dict, rounds: int, iters: int, switch: str = "gluon_bwd.SPLIT_PHASES") -> str:
    lines = results_header(f"{switch} off / on, interleaved (issue 24)", info=meta)
    lines += [
        f"- {rounds} rounds per row, each timing off then on ({iters} calls each: median, CUDA events); "
        "fwd+bwd rows time forward+backward, fwd rows the forward under no_grad; peak = "
        "torch.cuda.max_memory_allocated over one forward+backward / bytes of q, k, v, out, dout, dq, dk, dv",
        "",
        "| row | direction | off ms, median (min-max) | on ms, median (min-max) | on / off (medians) | "
        "on / off per round, min-max | peak off | peak on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        if "skipped" in res or "error" in res:
            lines.append(f"| {res['row']} | | {res.get('skipped') or res.get('error')} |" + " |" * 5)
            continue
        for key, label in (("fwd_ms", "fwd"), ("ms", "fwd+bwd")):
            off, on = res.get(key, {}).get("off"), res.get(key, {}).get("on")
            if not off:
                continue
            pairs = [b / a for a, b in zip(off, on, strict=True)]
            lines.append(
                f"| {res['row']} | {label} | {_spread(off)} | {_spread(on)} | "
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
    p.add_argument("--switch", default="gluon_bwd.SPLIT_PHASES",
                   help="MOD.NAME: a boolean switch of a dilated_attention.kernels module, read per call")
    p.add_argument("--direction", choices=DIRECTIONS, default="fb", help="what to time (both: fwd and fwd+bwd)")
    args = p.parse_args(argv)
    try:
        switch = resolve_switch(args.switch)
    except ValueError as e:
        p.error(str(e))
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
            results.append(run_row(row, args.rounds, args.iters, switch, args.direction))
        except Exception as e:  # report the row, keep going
            results.append({"row": row.name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                f.write(markdown(results, meta, args.rounds, args.iters, args.switch))
    print(markdown(results, meta, args.rounds, args.iters, args.switch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
