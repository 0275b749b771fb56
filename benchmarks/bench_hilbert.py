"""Benchmark: cost of ordering="hilbert" (issue 6) next to plain dilated attention and dense SDPA.

For a grid of H x W tokens (default 512 x 512 = 262144), bf16, 16 heads x 128, the LongNet
branches w = 2048..32768, r = 1..16, it times forward+backward (median of
triton.testing.do_bench, or of CUDA events without triton) of

- ``DilatedAttention(...)``                                  (row-major order)
- ``DilatedAttention(..., ordering="hilbert", grid=(H, W))`` (reorder q, k, v, restore out)
- the permutation alone (q, k, v gathered in, out gathered back, and the backward gathers)
- dense ``scaled_dot_product_attention`` at the same shape (skip with ``--no-dense``)

and reports the overhead of ordering="hilbert" in percent of the plain forward+backward, plus
the locality of each branch's segments (mean 2-D distance of token pairs that share a segment,
sampled) in both orders. Plain and hilbert runs are interleaved ``--rounds`` times and the
median taken, so that clock drift does not show up as overhead.

    python benchmarks/bench_hilbert.py --out benchmarks/results/hilbert_<gpu>_<date>.md
    python benchmarks/bench_hilbert.py --small          # CPU smoke run (float32, tiny sizes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from dilated_attention import DilatedAttention, hilbert_permutation
from dilated_attention.ordering import permute_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, results_header  # noqa: E402


def _timer(device: str, warmup_ms: int, rep_ms: int):
    """Returns bench(fn) -> median milliseconds: triton.testing.do_bench on a GPU with Triton
    (warmup and repetitions in ms), else the shared timer (common.median_ms)."""
    if device == "cuda":
        try:
            import triton.testing

            return lambda fn: triton.testing.do_bench(
                fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"
            )
        except ImportError:
            return lambda fn: median_ms(fn, device, 1, 20)
    return lambda fn: median_ms(fn, device, 1, 5)


def locality(
    height: int, width: int, seg: int, dil: int, order: torch.Tensor, samples: int = 200_000
) -> float:
    """Mean Euclidean grid distance of random token pairs attended together in branch (seg, dil).

    A pair is (i, j) in the same segment of ``seg`` and in the same dilation class (same
    in-segment index mod ``dil``), i != j; positions are indices into ``order`` (row-major cell
    ids in sequence order). Sampled, ``samples`` pairs (exact enough for 3 digits).
    """
    n = order.numel()
    g = torch.Generator().manual_seed(0)
    i = torch.randint(0, n, (samples,), generator=g)
    start = (i // seg) * seg
    length = torch.clamp(n - start, max=seg)
    ncls = (length - (i - start) % dil + dil - 1) // dil  # members of i's dilation class
    keep = ncls > 1
    i, start, ncls = i[keep], start[keep], ncls[keep]
    c = (i - start) % dil
    # another member of the class, uniformly, excluding i itself
    mi = (i - start) // dil
    mj = (torch.rand(i.shape, generator=g) * (ncls - 1)).long()
    mj = mj + (mj >= mi).long()
    j = start + c + mj * dil
    ci, cj = order[i], order[j]
    dy = (ci // width - cj // width).double()
    dx = (ci % width - cj % width).double()
    return float(torch.sqrt(dx * dx + dy * dy).mean())


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--segments", type=str, default="2048,4096,8192,16384,32768")
    p.add_argument("--dilations", type=str, default="1,2,4,8,16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--impl", type=str, default="auto")
    p.add_argument("--rounds", type=int, default=3, help="interleaved plain/hilbert rounds")
    p.add_argument("--no-dense", action="store_true", help="skip the dense SDPA baseline")
    p.add_argument(
        "--small", action="store_true", help="CPU-sized run: 32x32 grid, 4x32 heads, fp32"
    )
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--out", type=str, default=None, help="write the markdown report here")
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    if device == "cpu" and not args.small:
        print("no CUDA GPU: falling back to --small CPU sizes", flush=True)
        args.small = True
    if args.small:
        args.height, args.width, args.heads, args.headdim = 32, 32, 4, 32
        args.segments, args.dilations = "64,128,256", "1,2,4"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seg = [int(x) for x in args.segments.split(",")]
    dil = [int(x) for x in args.dilations.split(",")]
    hh, ww = args.height, args.width
    n, b, h, d = hh * ww, args.batch, args.heads, args.headdim
    bench = _timer(device, args.warmup, args.rep)

    t0 = time.perf_counter()
    hilbert_permutation(hh, ww)
    perm_build_ms = 1e3 * (time.perf_counter() - t0)

    q, k, v, do = (torch.randn(b, n, h, d, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    plain = DilatedAttention(seg, dil, impl=args.impl)
    hil = DilatedAttention(seg, dil, impl=args.impl, ordering="hilbert", grid=(hh, ww))

    def fb(mod):
        def run():
            out = mod(q, k, v, is_causal=args.causal)
            torch.autograd.grad(out, (q, k, v), do)

        return run

    def permute_only():
        qq, kk, vv = (permute_sequence(t, (hh, ww)) for t in (q, k, v))
        out = permute_sequence(qq + kk + vv, (hh, ww), inverse=True)  # stands in for attention
        torch.autograd.grad(out, (q, k, v), do)

    def add_only():  # the stand-in's own cost, subtracted from permute_only
        torch.autograd.grad(q + k + v, (q, k, v), do)

    results: dict[str, list[float]] = {"plain": [], "hilbert": []}
    for _ in range(args.rounds):
        results["plain"].append(bench(fb(plain)))
        results["hilbert"].append(bench(fb(hil)))
        print(
            f"plain {results['plain'][-1]:.3f} ms, hilbert {results['hilbert'][-1]:.3f} ms",
            flush=True,
        )
    t_plain = statistics.median(results["plain"])
    t_hil = statistics.median(results["hilbert"])
    t_perm = max(bench(permute_only) - bench(add_only), 0.0)
    t_dense = None
    if not args.no_dense:
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2)

        def dense():
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
            torch.autograd.grad(out, (qt, kt, vt), dot)

        t_dense = bench(dense)
    overhead = 100 * (t_hil - t_plain) / t_plain

    perm, _ = hilbert_permutation(hh, ww)
    rowmajor = torch.arange(n)
    loc = []
    for w_, r_ in zip(seg, dil, strict=True):
        a = locality(hh, ww, w_, r_, rowmajor)
        c = locality(hh, ww, w_, r_, perm)
        loc.append(f"| {w_} | {r_} | {a:.2f} | {c:.2f} | {c / a:.3f} |")

    lines = results_header("Hilbert ordering overhead (issue 6)", device) + [
        f"- shape: {dtype}, batch {b}, grid {hh}x{ww} (N = {n}), {h} heads x {d}, causal={args.causal}; "
        f"branches w={seg}, r={dil}; impl={args.impl!r}",
        f"- building the permutation (once per grid, cached): {perm_build_ms:.0f} ms on the CPU",
        "",
        "| variant | fwd+bwd ms | vs plain |",
        "|---|---|---|",
        f"| DilatedAttention (row-major) | {t_plain:.3f} | 100% |",
        f"| DilatedAttention ordering=hilbert | {t_hil:.3f} | {100 * t_hil / t_plain:.1f}% |",
        f"| permutation alone (4 gathers fwd, 4 bwd) | {t_perm:.3f} | {100 * t_perm / t_plain:.1f}% |",
    ]
    if t_dense is not None:
        lines.append(f"| dense SDPA | {t_dense:.3f} | {100 * t_dense / t_plain:.1f}% |")
    lines += [
        "",
        f'**Overhead of ordering="hilbert": {overhead:+.1f}% of plain fwd+bwd** '
        f"(target < 5%; rounds: plain {_fmt(results['plain'])}, hilbert {_fmt(results['hilbert'])} ms)",
        "",
        "Locality: mean 2-D distance (grid cells) between tokens attended together in a branch",
        "",
        "| w | r | row-major | hilbert | ratio |",
        "|---|---|---|---|---|",
        *loc,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
