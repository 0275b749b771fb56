"""Gluon or Triton, per direction, on sweep rows: which kernels should a call take (issue 24).

For each row of ``benchmarks/sweep.py`` named by ``--rows``, same process, same inputs, four arms
of ``impl="triton"`` (the Gluon switches of ``dilated_attention.flags``):

- ``G/G``: Gluon forward, Gluon backward (where ``gluon_fwd.problem`` / ``gluon_bwd.problem``
  let them run);
- ``T/T``: both switches off (the Triton kernels);
- ``T/G``: Triton forward, Gluon backward;
- ``G/T``: Gluon forward, Triton backward.

Forward timed under no_grad for the ``G`` and ``T`` forwards, forward+backward for every arm; the
backward's share is read as fwd+bwd minus the forward of that arm. Timing: the shared timer
(``dilated_attention.timing.median_ms``, CUDA events), after one warm forward and one warm
forward+backward per arm. ``--uneven`` sets ``gluon_fwd.UNEVEN_BLOCKS`` and ``TAIL_SEGMENTS``
(on by default since 2026-11-29; the flag keeps old command lines meaning the same), so that
rows with w % r != 0 or N % w != 0 can take Gluon. ``MIN_ROWS`` and ``D64_MIN_BLOCK`` are set to
0: this script measures the choice they encode.

    PYTHONPATH=src python3 benchmarks/gluon_ab.py --rows 8br-paper-d64-fp16-causal --out $OUT/gluon_ab.md
    bash scripts/gpu_check.sh gluon-ab    # the rows of results/gluon_ab_h200_2026-11-29.md

Exit 2 without an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import command_line, median_ms, results_header, run_info  # noqa: E402
from sweep import _DT, flops, rows_named  # noqa: E402

from dilated_attention import dilated_attention, flags  # noqa: E402
from dilated_attention.branches import branch_head_ranges  # noqa: E402
from dilated_attention.kernels import gluon_bwd, gluon_fwd  # noqa: E402

ARMS = (("G/G", True, True), ("T/T", False, False), ("T/G", False, True), ("G/T", True, False))


def _gluon_reasons(r, q, k, v) -> tuple[str | None, str | None]:
    heads = branch_head_ranges(r.nheads, len(r.seg), "all")
    branches = [(w, d, hs, he) for w, d, (hs, he) in zip(r.seg, r.dil, heads, strict=True)]
    f = gluon_fwd.problem(q, k, v, r.causal, branches)
    b = gluon_bwd.problem(q, k, v, r.causal, branches, q.shape[2])
    return f, b


def run_row(r, iters: int) -> dict:
    dev = torch.device("cuda")
    dt = _DT[r.dtype]
    q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device=dev, dtype=dt)
    k = torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd_reason, bwd_reason = _gluon_reasons(r, q, k, v)

    def call():
        return dilated_attention(*xs, r.seg, r.dil, causal=r.causal, impl="triton")

    def fwd():
        with torch.no_grad():
            call()

    def fb():
        torch.autograd.grad(call(), xs, do)

    res = {"row": r.name, "gluon_fwd_problem": fwd_reason, "gluon_bwd_problem": bwd_reason}
    fwd_ms = {}
    for name, gf, gb in ARMS:
        flags.set_gluon_forward(gf)
        flags.set_gluon_backward(gb)
        try:
            fwd()
            fb()
            torch.cuda.synchronize()
            if gf not in fwd_ms:
                fwd_ms[gf] = median_ms(fwd, "cuda", 1, iters)
            res[name] = {"fwd_ms": fwd_ms[gf], "fb_ms": median_ms(fb, "cuda", 1, iters)}
            res[name]["bwd_ms"] = res[name]["fb_ms"] - res[name]["fwd_ms"]
        except Exception as e:  # report the arm, keep going
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        print(f"  {r.name:28} {name} {res[name]}", flush=True)
    flags.set_gluon_forward(None)
    flags.set_gluon_backward(None)
    res["fwd_flops"] = flops(r)
    res["fb_flops"] = flops(r, True)
    return res


def _ms(res: dict, arm: str, key: str) -> str:
    m = res.get(arm, {})
    return f"{m[key]:.2f}" if key in m else m.get("error", "-")


def _fb(res: dict, arm: str) -> str:
    m = res.get(arm, {})
    if "fb_ms" not in m:
        return m.get("error", "-")
    return f"{m['fb_ms']:.2f} ({res['fb_flops'] / m['fb_ms'] / 1e9:.0f})"


def markdown(results: list[dict], meta: dict, uneven: bool) -> str:
    lines = results_header("Gluon or Triton per direction (issue 24)", info=meta)
    lines += [
        f"- gluon_fwd.UNEVEN_BLOCKS / TAIL_SEGMENTS: {gluon_fwd.UNEVEN_BLOCKS} / "
        f"{gluon_fwd.TAIL_SEGMENTS}" + (" (set by --uneven)" if uneven else ""),
        "",
        "ms per call (median, CUDA events); fwd+bwd TF/s in brackets; bwd = fwd+bwd - fwd "
        "of the arm. G = Gluon kernels, T = Triton kernels, forward/backward.",
        "",
        "| row | fwd G | fwd T | bwd G | bwd T | fb G/G | fb T/T | fb T/G | fb G/T | best fb |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        if "skipped" in res:
            lines.append(f"| {res['row']} | skipped: {res['skipped']} |" + " |" * 8)
            continue
        ms = functools.partial(_ms, res)
        fb = functools.partial(_fb, res)

        ok = {a: res[a]["fb_ms"] for a, _, _ in ARMS if "fb_ms" in res.get(a, {})}
        best = min(ok, key=ok.get) if ok else "-"
        lines.append(
            f"| {res['row']} | {ms('G/G', 'fwd_ms')} | {ms('T/T', 'fwd_ms')} | "
            f"{ms('G/G', 'bwd_ms')} | {ms('T/T', 'bwd_ms')} | {fb('G/G')} | {fb('T/T')} | "
            f"{fb('T/G')} | {fb('G/T')} | {best} |"
        )
    lines.append("")
    for res in results:
        for key in ("gluon_fwd_problem", "gluon_bwd_problem"):
            if res.get(key):
                lines.append(f"- {res['row']}: {key}: {res[key]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", required=True, help="comma-separated sweep.py row names")
    p.add_argument("--out", help="markdown results file")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--budget-s", type=float, default=300.0, help="start no row after this many seconds"
    )
    p.add_argument("--uneven", action="store_true", help="set UNEVEN_BLOCKS and TAIL_SEGMENTS")
    args = p.parse_args(argv)
    try:
        want = rows_named(args.rows.split(","))
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("gluon_ab.py needs an sm_90 GPU", file=sys.stderr)
        return 2
    if args.uneven:
        gluon_fwd.UNEVEN_BLOCKS = True
        gluon_fwd.TAIL_SEGMENTS = True
    # the arms decide; the floors (MIN_ROWS: gluon_floor.py; D64_MIN_BLOCK: this script) are off
    gluon_fwd.MIN_ROWS = gluon_fwd.D64_MIN_BLOCK = 0
    meta = run_info(torch.device("cuda"), command_line("python3"))
    t0 = time.perf_counter()
    results = []
    for row in want:
        if time.perf_counter() - t0 > args.budget_s:
            results.append({"row": row.name, "skipped": f"budget {args.budget_s:.0f} s"})
            continue
        print(f"[{time.perf_counter() - t0:6.1f} s] {row.name}", flush=True)
        torch.manual_seed(0)
        results.append(run_row(row, args.iters))
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                f.write(markdown(results, meta, args.uneven))
    text = markdown(results, meta, args.uneven)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
