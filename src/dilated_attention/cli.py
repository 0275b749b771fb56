"""The ``dilated-attention`` command line: info, verify, bench, train.

Every option is checked by argparse (types, choices, positive sizes, consistent branch lists, a
device that exists here); a bad value exits with status 2 and a one-line error, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import __version__
from .api import available_impls, dilated_attention
from .argtypes import HelpFormatter, Parser
from .argtypes import bool_arg as _bool_arg
from .argtypes import device_arg as _device_arg
from .argtypes import nonnegative_int as _nonnegative_int
from .argtypes import positive_int as _positive_int
from .flops import dense_flops, dilated_flops
from .kernels.select import triton_unavailable_reason
from .timing import device_name, median_ms, results_header, run_info, versions

# `bench` default branches on a GPU: w = 2048 * 2^i, r = 2^i (the geometric series the README's
# tables use). Not the LongNet paper's preset, whose rates are (1, 2, 4, 6, 12): that one is
# models.LongNetConfig's default; pass --dilations 1 2 4 6 12 to bench it.
BENCH_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
BENCH_DILATIONS = (1, 2, 4, 8, 16)

DESCRIPTION = """\
Exact LongNet dilated attention: check, measure and train.

  dilated-attention info      versions, devices, which impls can run here
  dilated-attention verify    every available impl vs impl="reference", forward + backward
  dilated-attention bench     time, useful FLOP/s and peak memory vs dense SDPA
  dilated-attention train     train a LongNet LM on a shipped long-range task

Semantics and FLOP counting: docs/spec.md. Run "dilated-attention COMMAND --help" for options.
"""

# names accepted by --dtype (the torch name or its short form)
DTYPES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def _dtype_arg(s: str) -> torch.dtype:
    try:
        return DTYPES[s.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"{s!r} is not a dtype; use one of {', '.join(DTYPES)}"
        ) from None


def _device(arg: str | None) -> torch.device:
    if arg:
        return torch.device(arg)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    for k, v in versions().items():
        print(f"{k:>18}: {v}")
    print(f"{'cuda available':>18}: {torch.cuda.is_available()}")
    for i in range(torch.cuda.device_count()):
        print(f"{'device ' + str(i):>18}: {torch.cuda.get_device_name(i)}")
    dev = _device(args.device)
    probe_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    probe = torch.empty(1, 1, 1, 64, device=dev, dtype=probe_dtype)
    print(f"{'impls on ' + dev.type:>18}: {', '.join(available_impls(probe))}")
    reason = triton_unavailable_reason(probe)
    if reason:
        print(f"{'triton':>18}: not here ({reason})")
    return 0


# -------------------------------------------------------------------------------------- verify
def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


VERIFY_CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, segments, dilations, head_assignment)
    (2, 97, 97, 4, 4, 64, (16, 32), (1, 2), "all"),
    (1, 200, 200, 6, 2, 64, (24, 48, 96), (1, 4, 6), "all"),
    (1, 129, 129, 8, 8, 128, (32, 64), (1, 4), "split"),
    (2, 17, 150, 4, 1, 64, (64, 128), (1, 2), "all"),
]


def _run_impl(impl, q, k, v, case, causal, do):
    _, _, _, _, _, _, seg, dil, ha = case
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = dilated_attention(qq, kk, vv, seg, dil, causal=causal, head_assignment=ha, impl=impl)
    out.backward(do)
    return out.detach(), qq.grad, kk.grad, vv.grad


def cmd_verify(args) -> int:
    dev = _device(args.device)
    dtypes = [torch.bfloat16, torch.float16] if dev.type == "cuda" else [torch.float32]
    if args.dtype:
        dtypes = [args.dtype]
    ref_dtype = torch.float64
    impls = [i for i in available_impls(torch.empty(1, 1, 1, 64, device=dev, dtype=dtypes[0])) if i != "reference"]
    rows, failed = [], False
    torch.manual_seed(args.seed)
    total, done = len(VERIFY_CASES) * 2 * len(dtypes), 0
    for case in VERIFY_CASES:
        b, nq, nk, h, hkv, d, seg, dil, ha = case
        for causal in (False, True):
            for dt in dtypes:
                done += 1
                q = torch.randn(b, nq, h, d, device=dev, dtype=dt)
                k = torch.randn(b, nk, hkv, d, device=dev, dtype=dt)
                v = torch.randn(b, nk, hkv, d, device=dev, dtype=dt)
                do = torch.randn(b, nq, h, d, device=dev, dtype=dt)
                ref = _run_impl("reference", q.to(ref_dtype), k.to(ref_dtype), v.to(ref_dtype), case, causal, do.to(ref_dtype))
                base = None
                for impl in impls:
                    res = _run_impl(impl, q, k, v, case, causal, do)
                    errs = [_rel_err(x, r) for x, r in zip(res, ref, strict=True)]
                    nan = any(not torch.isfinite(x).all() for x in res)
                    if impl == "torch":
                        base = errs
                        # the baseline itself: within the precision of its dtype
                        tol = 1e-5 if dt in (torch.float32, torch.float64) else 2e-2
                        ok = all(e <= tol for e in errs)
                    else:  # docs/spec.md, "Measuring speed": <= 2x the same-dtype torch error, plus a small atol
                        ok = all(e <= 2 * bse + 1e-3 for e, bse in zip(errs, base or errs, strict=True))
                    ok = ok and not nan
                    failed |= not ok
                    rows.append(
                        [impl, str(dt).replace("torch.", ""), f"{b}x{nq}/{nk}x{h}/{hkv}x{d}",
                         f"w={list(seg)} r={list(dil)} {ha}", "yes" if causal else "no",
                         *[f"{e:.2e}" for e in errs], "ok" if ok else "FAIL"]
                    )
                # progress on stderr as each check ends (a GPU's first calls compile for minutes;
                # a run stopped early still says how far it got), the table on stdout at the end
                mine = rows[len(rows) - len(impls):]
                print(f"verify {done}/{total}: {mine[0][2]} {mine[0][3]} causal={mine[0][4]} {mine[0][1]}: "
                      + ", ".join(f"{r[0]} {r[-1]}" for r in mine), file=sys.stderr, flush=True)  # fmt: skip
    hdr = ["impl", "dtype", "B x Nq/Nk x H/Hkv x D", "branches", "causal", "out", "dq", "dk", "dv", "result"]
    print(f"verify on {dev} ({device_name(dev)}), relative L2 error vs impl='reference' in float64")
    _print_table(hdr, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": hdr, "rows": rows, "versions": versions()}, f, indent=1)
    print("verify:", "FAILED" if failed else "all passed")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------- bench
def _bench_one(name, attn, q, k, v, do, device, warmup, iters, flops_f, flops_fb, io_bytes):
    row = {"impl": name}
    try:
        with torch.no_grad():
            t_f = median_ms(lambda: attn(q, k, v), device, warmup, iters)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

        def fb():
            o = attn(qq, kk, vv)
            torch.autograd.grad(o, (qq, kk, vv), do)

        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t_fb = median_ms(fb, device, warmup, iters)
        row.update(fwd_ms=t_f, fwdbwd_ms=t_fb, fwd_tflops=flops_f / t_f / 1e9, fwdbwd_tflops=flops_fb / t_fb / 1e9)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base + io_bytes * 3 / 8  # q, k, v live
            row.update(peak_gib=peak / 2**30, mem_ratio=peak / io_bytes)
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    except ValueError as e:  # an impl that cannot run these inputs says why (api.py's errors)
        row["error"] = f"not run: {e}"
    return row


def cmd_bench(args) -> int:
    """Time every impl next to dense SDPA, then print (and write) the table."""
    dev = _device(args.device)
    meta, results = _bench_run(args, dev)
    _bench_report(args, dev, meta, results)
    return 0


def _bench_run(args, dev) -> tuple[dict, list]:
    """(the run's settings and versions, one result row per (N, causal, impl))."""
    on_gpu = dev.type == "cuda"
    dt = args.dtype or (torch.bfloat16 if on_gpu else torch.float32)
    seg, dil = _bench_branches(args, on_gpu)
    seqlens = args.seqlens or ([32768, 65536, 131072] if on_gpu else [512, 1024, 2048])
    heads, hd = args.heads or (16 if on_gpu else 4), args.headdim or (128 if on_gpu else 64)
    impls = args.impls or [i for i in available_impls(torch.empty(1, 1, 1, hd, device=dev, dtype=dt)) if i != "reference"]
    warmup, iters = (args.warmup, args.iters) if args.iters else ((3, 10) if on_gpu else (1, 3))
    results = []
    try:
        from tqdm import tqdm

        it = tqdm([(n, c) for n in seqlens for c in args.causal], desc="bench", file=sys.stderr)
    except ImportError:
        it = [(n, c) for n in seqlens for c in args.causal]
    for n, causal in it:
        g = torch.Generator(device=dev).manual_seed(n)
        q, k, v, do = (torch.randn(args.batch, n, heads, hd, device=dev, dtype=dt, generator=g) for _ in range(4))
        io_bytes = 8 * q.numel() * q.element_size()  # q, k, v, out, dout, dq, dk, dv
        df, dfb = (dense_flops(args.batch, n, heads, hd, causal, b) for b in (False, True))
        f, fb = (dilated_flops(args.batch, n, n, heads, hd, seg, dil, causal, backward=b) for b in (False, True))

        def dense(q_, k_, v_, c=causal):
            return torch.nn.functional.scaled_dot_product_attention(
                q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=c
            ).transpose(1, 2)

        rows = [_bench_one("dense SDPA", dense, q, k, v, do, dev, warmup, iters, df, dfb, io_bytes)]
        for impl in impls:
            def attn(q_, k_, v_, impl=impl, c=causal):
                return dilated_attention(q_, k_, v_, seg, dil, causal=c, impl=impl)

            rows.append(_bench_one(impl, attn, q, k, v, do, dev, warmup, iters, f, fb, io_bytes))
        for r in rows:
            r.update(seqlen=n, causal=causal)
            results.append(r)
        del q, k, v, do
    meta = {
        **run_info(dev, " ".join(sys.argv)),  # command, device, versions, date (timing.py)
        "dtype": str(dt), "batch": args.batch, "heads": heads, "headdim": hd,
        "segment_lengths": list(seg), "dilation_rates": list(dil),
    }
    return meta, results


_RUN_INFO_KEYS = ("command", "device", "versions", "date")  # timing.run_info's, in the header


def _bench_report(args, dev, meta: dict, results: list) -> None:
    """The table on stdout; --json, --markdown and --plot files."""
    on_gpu = dev.type == "cuda"
    dt, seg, dil, heads, hd = meta["dtype"], meta["segment_lengths"], meta["dilation_rates"], meta["heads"], meta["headdim"]
    # useful FLOP/s in units that show digits: TFLOP/s on a GPU, GFLOP/s on a CPU
    unit, scale = ("TFLOP/s", 1.0) if on_gpu else ("GFLOP/s", 1e3)  # the results hold TFLOP/s
    hdr = ["N", "causal", "impl", "fwd ms", f"fwd {unit}", "fwd+bwd ms", f"fwd+bwd {unit}"]
    if on_gpu:  # CPU tensors have no allocator statistics to read a peak from
        hdr += ["peak GiB", "peak / 8 tensors"]
    table, errors = [], []
    for r in results:
        if "error" in r:
            table.append([r["seqlen"], r["causal"], r["impl"], r["error"].split(":")[0]] + [""] * (len(hdr) - 4))
            errors.append(f"N={r['seqlen']} causal={r['causal']} {r['impl']}: {r['error']}")
            continue
        row = [
            r["seqlen"], r["causal"], r["impl"], f"{r['fwd_ms']:.2f}", _rate(r["fwd_tflops"] * scale),
            f"{r['fwdbwd_ms']:.2f}", _rate(r["fwdbwd_tflops"] * scale),
        ]
        if on_gpu:
            row += [f"{r['peak_gib']:.2f}" if "peak_gib" in r else "n/a",
                    f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "n/a"]
        table.append(row)
    print(f"\nbench on {meta['device']} | {dt} | batch {args.batch} | {heads} heads x {hd} | "
          f"w={list(seg)} r={list(dil)} | useful {unit} as in docs/spec.md (dense: its own FLOPs)")
    _print_table(hdr, table)
    for e in errors:
        print(e)
    if not on_gpu:
        print("peak memory: n/a on the CPU (measured from CUDA allocator statistics on a GPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    if args.markdown:
        settings = [f"{key}: `{val}`" for key, val in meta.items() if key not in _RUN_INFO_KEYS]
        with open(args.markdown, "w") as f:
            f.write("\n".join(results_header("bench: dilated attention vs dense SDPA", info=meta, extra=settings)))
            f.write("\n\n" + _md_table(hdr, table) + "\n")
            for e in errors:
                f.write(f"\n- {e}")
    if args.plot:
        _plot(results, args.plot, meta)


def _rate(x: float) -> str:
    """Three significant digits, so that small rates (tiny CPU runs) do not print as 0.0."""
    return f"{x:.1f}" if x >= 100 else f"{x:.3g}"


def _bench_branches(args, on_gpu: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    seg = tuple(args.segments) if args.segments else (BENCH_SEGMENTS if on_gpu else (64, 128, 256))
    dil = tuple(args.dilations) if args.dilations else (BENCH_DILATIONS if on_gpu else (1, 2, 4))
    return seg, dil


def _check_outputs(args, parser: argparse.ArgumentParser, options=("json", "markdown", "plot")) -> None:
    """Every output file's folder exists and is writable, checked before anything runs (a
    benchmark's results are not lost at the end)."""
    import os

    for name in options:
        path = getattr(args, name, None)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            parser.error(f"--{name} {path} is a folder; give a file name")
        if not os.path.isdir(folder):
            parser.error(f"--{name} {path}: the folder {folder} does not exist; create it or choose another path")
        if not os.access(folder, os.W_OK):
            parser.error(f"--{name} {path}: the folder {folder} is not writable")
        if name == "plot":
            # matplotlib picks the format from the extension: an unknown one failed after the run
            try:
                from matplotlib.backend_bases import FigureCanvasBase
            except ImportError:  # the run says so itself (the plot is an extra)
                continue
            ext = os.path.splitext(path)[1].lstrip(".").lower()
            formats = sorted(FigureCanvasBase.get_supported_filetypes())
            if ext not in formats:
                parser.error(f"--plot {path}: the extension must be one of {', '.join('.' + f for f in formats)}")


def _check_bench(args, parser: argparse.ArgumentParser) -> None:
    """Cross-option checks argparse cannot express; parser.error exits 2 with one line."""
    _check_outputs(args, parser)
    if (args.segments is None) != (args.dilations is None):
        given, missing = ("--segments", "--dilations") if args.segments else ("--dilations", "--segments")
        parser.error(f"{given} given without {missing}: give one dilation rate per segment length")
    if args.segments is not None:
        if len(args.segments) != len(args.dilations):
            parser.error(
                f"--segments has {len(args.segments)} values but --dilations has "
                f"{len(args.dilations)}: give one dilation rate per segment length"
            )
        for w, r in zip(args.segments, args.dilations, strict=True):
            if r > w:
                parser.error(
                    f"dilation rate {r} > segment length {w}: each r must be <= its w "
                    "(the order is --segments W... --dilations R...)"
                )


def _plot(results, path, meta) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'dilated-attention[plot]')", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwdbwd_tflops", "forward+backward")):
        for impl in sorted({r["impl"] for r in results}):
            for causal in sorted({r["causal"] for r in results}):
                pts = [(r["seqlen"], r[key]) for r in results if r["impl"] == impl and r["causal"] == causal and key in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{impl}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['device']} {meta['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _print_table(hdr, rows) -> None:
    cols = list(zip(*([hdr] + [[str(c) for c in r] for r in rows]), strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    line = "  ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def _md_table(hdr, rows) -> str:
    out = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    fmt = {"formatter_class": HelpFormatter}
    p = Parser(prog="dilated-attention", description=DESCRIPTION, **fmt)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    device_help = "cpu, cuda or cuda:N (default: cuda if available, else cpu)"

    pi = sub.add_parser("info", help="versions, devices, available impls", **fmt)
    pi.add_argument("--device", type=_device_arg, default=None, help=device_help)
    pi.set_defaults(fn=cmd_info)

    pv = sub.add_parser("verify", help="check every available impl against the reference", **fmt)
    pv.add_argument("--device", type=_device_arg, default=None, help=device_help)
    pv.add_argument(
        "--dtype", type=_dtype_arg, default=None, metavar="DTYPE",
        help="fp32/float32, bf16/bfloat16, fp16/float16 or fp64/float64 "
        "(default: bf16 and fp16 on a GPU, fp32 on the CPU)",
    )
    pv.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    pv.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON to FILE")
    pv.set_defaults(fn=cmd_verify, check=lambda a: _check_outputs(a, pv, ("json",)))

    _add_bench_parser(sub, fmt, device_help)

    try:
        from .train import add_train_arguments, check_or_exit, run_or_exit
    except ImportError:
        pass
    else:
        pt = sub.add_parser("train", help="train a LongNet LM on a shipped long-range task", **fmt)
        add_train_arguments(pt)  # the flags and checks of python -m dilated_attention.train
        pt.set_defaults(fn=lambda a: run_or_exit(a, pt), check=lambda a: check_or_exit(a, pt))
    return p


def _add_bench_parser(sub, fmt: dict, device_help: str) -> None:
    pb = sub.add_parser("bench", help="time dilated attention against dense SDPA", **fmt)
    pb.add_argument("--device", type=_device_arg, default=None, help=device_help)
    pb.add_argument(
        "--dtype", type=_dtype_arg, default=None, metavar="DTYPE",
        help="as in verify (default: bf16 on a GPU, fp32 on the CPU)",
    )
    pb.add_argument("--batch", type=_positive_int, default=1, help="batch size")
    pb.add_argument("--heads", type=_positive_int, default=None, help="query heads (default: 16 on a GPU, 4 on the CPU)")
    pb.add_argument("--headdim", type=_positive_int, default=None, help="head dim (default: 128 on a GPU, 64 on the CPU)")
    pb.add_argument(
        "--seqlens", type=_positive_int, nargs="+", default=None, metavar="N",
        help="sequence lengths (default: 32768 65536 131072 on a GPU, 512 1024 2048 on the CPU)",
    )
    pb.add_argument(
        "--segments", type=_positive_int, nargs="+", default=None, metavar="W",
        help=f"segment lengths, one per branch (default: {' '.join(map(str, BENCH_SEGMENTS))} on a GPU, "
        "64 128 256 on the CPU)",
    )
    pb.add_argument(
        "--dilations", type=_positive_int, nargs="+", default=None, metavar="R",
        help="dilation rates, one per --segments value, each <= its segment (default: "
        f"{' '.join(map(str, BENCH_DILATIONS))} on a GPU, 1 2 4 on the CPU; the LongNet paper's "
        "preset is 1 2 4 6 12)",
    )
    pb.add_argument(
        "--causal", type=_bool_arg, nargs="+", default=[False], metavar="BOOL",
        help="causal settings to run, e.g. --causal false true (default: false)",
    )
    pb.add_argument(
        "--impls", nargs="+", default=None, choices=["torch", "triton", "reference"],
        help="impls to time besides dense SDPA (default: every one that can run here, but reference)",
    )
    pb.add_argument("--warmup", type=_nonnegative_int, default=3, help="untimed calls first (used with --iters)")
    pb.add_argument(
        "--iters", type=_positive_int, default=None,
        help="timed calls, median reported (default: 10 after 3 warmup on a GPU, 3 after 1 on the CPU)",
    )
    pb.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    pb.add_argument("--markdown", default=None, metavar="FILE", help="write a results file (command, versions, table)")
    pb.add_argument("--plot", default=None, metavar="PNG", help="plot useful FLOP/s to this PNG (needs matplotlib)")
    pb.set_defaults(fn=cmd_bench, check=lambda a: _check_bench(a, pb))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:  # cross-option checks; they exit 2 through the subcommand's parser.error
        check(args)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
