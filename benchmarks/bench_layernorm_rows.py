"""Where the models' Triton LayerNorm starts to pay (``models.longnet.LAYERNORM_AUTO_MIN_ROWS``).

A LongNet block's pre-LayerNorm as the model runs it: ``AutocastLayerNorm(dim)`` on the float32
residual stream under a bf16 autocast, followed by the three q / k / v projections
(``nn.Linear(dim, dim)`` each), with the Triton kernel (``flags.set_triton_layernorm(True)``: the
output written in bf16) and without (``nn.LayerNorm``: a float32 output that each Linear casts).
Per row count M (tokens x batch): the wall time per call of back-to-back eager calls (host
included: ``iters`` calls, one synchronisation at the end), forward under ``no_grad`` (a decode
step's shape at small M) and forward + backward. The kernel's launch costs host time that the
casts it saves only repay from some M up: the smallest M from which it is faster in both passes
is printed last.

    python benchmarks/bench_layernorm_rows.py --out $OUT/layernorm_rows.md   # H100: ~20 s
    TRITON_INTERPRET=1 python benchmarks/bench_layernorm_rows.py --tiny        # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from dilated_attention import flags
from dilated_attention.models.longnet import AutocastLayerNorm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import results_header, run_info, write_report  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def per_call_us(fn, dev: torch.device, iters: int, rounds: int) -> float:
    """Median over ``rounds`` of the wall time per call of ``iters`` back-to-back calls."""
    fn()
    _sync(dev)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (Triton's interpreter)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.dim, args.rows, args.iters, args.rounds = 32, [1, 8], 2, 1
    info = run_info(dev, None if argv is None else " ".join(["python", sys.argv[0], *argv]))
    ln = AutocastLayerNorm(args.dim).to(dev)
    proj = torch.nn.ModuleList(torch.nn.Linear(args.dim, args.dim) for _ in range(3)).to(dev)

    def call(x, grad):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = ln(x)
            outs = [lin(y) for lin in proj]
        if grad:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    rows = []
    try:
        for m in args.rows:
            x = torch.randn(m, args.dim, device=dev)
            xg = x.clone().requires_grad_()
            res = {}
            for on in (True, False):
                flags.set_triton_layernorm(on)
                with torch.no_grad():
                    res[on, "fwd"] = per_call_us(lambda: call(x, False), dev, args.iters, args.rounds)
                res[on, "fwd+bwd"] = per_call_us(lambda: call(xg, True), dev, args.iters, args.rounds)
            rows.append((m, res))
            print(m, {f"{'kernel' if k[0] else 'nn'} {k[1]}": round(v, 1) for k, v in res.items()}, flush=True)
    finally:
        flags.set_triton_layernorm(None)
    lines = results_header(
        f"The models' Triton LayerNorm against nn.LayerNorm by row count: {info['device']}", info=info,
        extra=[f"AutocastLayerNorm({args.dim}) on a float32 input under bf16 autocast, then 3 x "
               f"nn.Linear({args.dim}, {args.dim}) (a block's pre-LN and its q/k/v projections); wall us per "
               f"call of {args.iters} back-to-back eager calls, median of {args.rounds} rounds"],
    )  # fmt: skip
    lines += ["", "| rows M | kernel fwd us | nn fwd us | kernel / nn fwd | kernel fwd+bwd us | nn fwd+bwd us "
              "| kernel / nn fwd+bwd |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    first = None
    for m, r in rows:
        f, b = r[True, "fwd"] / r[False, "fwd"], r[True, "fwd+bwd"] / r[False, "fwd+bwd"]
        lines.append(f"| {m} | {r[True, 'fwd']:.1f} | {r[False, 'fwd']:.1f} | {f:.2f} | "
                     f"{r[True, 'fwd+bwd']:.1f} | {r[False, 'fwd+bwd']:.1f} | {b:.2f} |")  # fmt: skip
        if f < 1 and b < 1:
            first = m if first is None else first
        else:
            first = None  # the smallest M from which every larger one wins too
    lines += ["", f"- the kernel is faster in both passes from M = {first} rows up (of those measured)"
              if first is not None else "- the kernel is not faster in both passes at the largest M measured"]
    write_report("\n".join(lines) + "\n", args.out, "layernorm_rows", dev, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
