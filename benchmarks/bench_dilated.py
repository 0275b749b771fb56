"""Benchmark: dilated attention (impl="triton", impl="torch") next to dense SDPA (issue 3).

Useful TFLOP/s as docs/spec.md ("Measuring speed") defines them (``dilated_attention.flops``: closed-form pair counts from the
branch geometry; fwd+bwd = 3.5 x forward; dense SDPA counts 4*N^2*H*D, halved when causal),
forward and forward+backward median times (triton.testing.do_bench), peak memory of one
forward+backward and the memory ratio = peak / bytes of (q, k, v, out, dout, dq, dk, dv), i.e.
1/8 of the ratio to one q-sized tensor. The first call's peak in a fresh process (what decides
whether N = 2M fits) and the CPU ledger of every buffer: ``benchmarks/mem_account.py``.

    PYTHONPATH=src python3 benchmarks/bench_dilated.py --max-n 262144 --out bench.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.flops import dense_flops, dilated_flops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, results_header  # noqa: E402


def _bench(fn, warmup=25, rep=100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _peak_fwd_bwd(fn_fwd_bwd) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn_fwd_bwd()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def run_row(impl, n, causal, args, seg, dil):
    """Returns dict(fwd_ms, fb_ms, peak, ratio) or a dict with 'error'."""
    dev, dt = "cuda", torch.bfloat16
    b, h, d = args.batch, args.heads, args.headdim
    torch.cuda.empty_cache()
    res: dict = {}
    try:
        q, k, v, do = (torch.randn(b, n, h, d, device=dev, dtype=dt) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        if impl == "sdpa":
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            dot = do.transpose(1, 2)

            def fwd():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            grads = [qt, kt, vt]

            def fb():
                fwd().backward(dot)
        else:

            def fwd():
                return dilated_attention(q, k, v, seg, dil, causal=causal, impl=impl)

            grads = [q, k, v]

            def fb():
                fwd().backward(do)

        with torch.no_grad():
            fwd_ms = _bench(fwd, args.warmup, args.rep)
        res = dict(fwd_ms=fwd_ms)
        fb()  # compile + warm
        for t in grads:
            t.grad = None
        fb_ms = _bench(fb, args.warmup, args.rep)
        for t in grads:
            t.grad = None
        peak = _peak_fwd_bwd(fb)
        eight = 8 * q.numel() * q.element_size()
        res = dict(fwd_ms=fwd_ms, fb_ms=fb_ms, peak=peak, ratio=peak / eight)
    except torch.cuda.OutOfMemoryError:
        res["error"] = "OOM"
    except Exception as e:  # report the row, keep benchmarking the others
        res["error"] = f"ERR {type(e).__name__}: {str(e)[:60]}"
    finally:
        q = k = v = do = grads = None  # noqa: F841
        torch.cuda.empty_cache()
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-n", type=int, default=32768)
    p.add_argument("--max-n", type=int, default=1048576, help="largest N (powers of two from --min-n)")
    p.add_argument("--torch-max-n", type=int, default=131072, help="skip impl='torch' above this N")
    p.add_argument("--dense-max-n", type=int, default=131072, help="skip dense SDPA above this N")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--segments", type=str, default="2048,4096,8192,16384,32768")
    p.add_argument("--dilations", type=str, default="1,2,4,8,16")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--out", type=str, default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_dilated.py needs a CUDA GPU")
    import triton

    seg = [int(x) for x in args.segments.split(",")]
    dil = [int(x) for x in args.dilations.split(",")]
    ns = []
    n = args.min_n
    while n <= args.max_n:
        ns.append(n)
        n *= 2
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    b, h, d = args.batch, args.heads, args.headdim
    rows = []
    dense_tf: dict = {}
    for causal in causals:
        for n in ns:
            for impl in ("sdpa", "torch", "triton"):
                if impl == "sdpa" and n > args.dense_max_n:
                    continue
                if impl == "torch" and n > args.torch_max_n:
                    continue
                r = run_row(impl, n, causal, args, seg, dil)
                if impl == "sdpa":
                    fl = dense_flops(b, n, h, d, causal)
                else:
                    fl = dilated_flops(b, n, n, h, d, seg, dil, causal)
                r.update(impl=impl, n=n, causal=causal, flops=fl)
                if "fwd_ms" in r:
                    r["tf_fwd"] = fl / r["fwd_ms"] / 1e9
                if "error" not in r:
                    r["tf_fb"] = 3.5 * fl / r["fb_ms"] / 1e9
                    if impl == "sdpa":
                        dense_tf[causal] = (r["tf_fwd"], r["tf_fb"], n)
                rows.append(r)
                msg = f"fwd {r['fwd_ms']:.2f} ms {r['tf_fwd']:.0f} TF/s | " if "fwd_ms" in r else ""
                if "error" in r:
                    msg += r["error"]
                else:
                    msg += (
                        f"fwd+bwd {r['fb_ms']:.2f} ms {r['tf_fb']:.0f} TF/s | "
                        f"peak {r['peak'] / 2**30:.2f} GiB ({r['ratio']:.2f}x)"
                    )
                print(f"N={n:>8} causal={causal!s:5} {impl:6}: {msg}", flush=True)

    # speedup of triton over torch and fraction of dense, per (N, causal)
    by = {(r["impl"], r["n"], r["causal"]): r for r in rows}
    lines = [
        "| N | causal | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd % dense | "
        "fwd+bwd % dense | vs torch (fwd+bwd) | peak GiB | mem ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            f = f"{r['fwd_ms']:.2f} | {r['tf_fwd']:.0f}" if "fwd_ms" in r else " | "
            lines.append(f"| {r['n']} | {r['causal']} | {r['impl']} | {f} | {r['error']} | | | | | | |")
            continue
        dt = dense_tf.get(r["causal"])
        pct_f = pct_b = speed = ""
        if dt and r["impl"] != "sdpa":
            star = "" if dt[2] == r["n"] else "*"
            pct_f = f"{100 * r['tf_fwd'] / dt[0]:.0f}%{star}"
            pct_b = f"{100 * r['tf_fb'] / dt[1]:.0f}%{star}"
        t = by.get(("torch", r["n"], r["causal"]))
        if r["impl"] == "triton" and t and "error" not in t:
            speed = f"{t['fb_ms'] / r['fb_ms']:.2f}x"
        lines.append(
            f"| {r['n']} | {r['causal']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['tf_fwd']:.0f} | "
            f"{r['fb_ms']:.2f} | {r['tf_fb']:.0f} | {pct_f} | {pct_b} | {speed} | "
            f"{r['peak'] / 2**30:.2f} | {r['ratio']:.2f} |"
        )
    head = results_header("Dilated attention benchmark (issue 3)", "cuda", command_line("python3")) + [
        f"- shape: bf16, batch {b}, {h} heads x {d}; branches w={seg}, r={dil}, head_assignment=all",
        "- TFLOP/s are useful FLOPs (docs/spec.md); fwd+bwd = 3.5 x forward FLOPs; `*` = dense measured "
        "at a smaller N (dense TFLOP/s is flat in N); mem ratio = peak fwd+bwd allocated / bytes "
        "of q, k, v, out, dout, dq, dk, dv",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
