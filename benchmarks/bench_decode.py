"""Benchmark: KV-cache decoding (issue 14): per-call attention latency and generate tokens/s.

Part 1, one attention call of one new token (batch 1, 32 query / 8 kv heads x 128, bf16, LongNet
branches w = 2048..32768, r = 1..16, causal) against caches of 4K .. 1M positions:

- ``decode``        :func:`dilated_attention_with_kvcache` (Triton split + reduce), eager launch
                    (CUDA events around one call)
- ``eager b2b``     wall time per call of 200 back-to-back eager calls (host included, one
                    synchronisation at the end, no CUDA graph), through
                    :func:`dilated_attention_with_kvcache` and through ``dilated_attention(q, k[:, :n],
                    v[:, :n])``, with ``dense b2b`` (SDPA over the cache) in the same run: the
                    issue 23 item 2 row (target <= 35 us and no slower than dense at >= 4K)
- ``decode graph``  the same call captured in a CUDA graph; ``graph x20`` is a graph of 20 calls
                    per replay divided by 20 (GPU time per call without the replay's launch)
- ``previous``      what ``dilated_attention(impl="auto")`` ran for seqlen_q = 1 before the
                    decode path: the fused prefill kernel (``dilated_attention_triton``)
- ``dense SDPA``    ``scaled_dot_product_attention`` over the whole cache (GQA via enable_gqa)

and the effective bandwidth of the decode path (K/V bytes of the selected keys per call / time).
A small sweep of the kernel's knobs (keys per split, warps) at two lengths follows.

Part 2, ``LongNetLM.generate`` of the ``small`` preset in bf16 (greedy, CUDA-graph decode step)
at 32K and 128K prompt tokens, against the same model with dense attention
(``LongNetConfig.with_attention("dense", ...)``: one branch covering the context, decoded by the
same machinery): tokens/s of the decode loop alone, from runs of two lengths (the prefill and the
graph capture cancel out), the fastest of ``--reps`` alternated runs of each length.

    PYTHONPATH=src python benchmarks/bench_decode.py --out benchmarks/results
    PYTHONPATH=src python benchmarks/bench_decode.py --tiny --out /tmp   # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.decode import dilated_attention_with_kvcache
from dilated_attention.models import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, device_name, median_ms, results_header, utc_now  # noqa: E402

LONGNET = ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16))
LENGTHS = (4096, 16384, 32768, 131072, 524288, 1048576)


def _previous_path():
    """The prefill kernel entry point that impl='auto' used for seqlen_q = 1 before the decode
    path."""
    from dilated_attention.kernels.triton_ops import dilated_attention_triton

    return dilated_attention_triton


def _time_events(fn, iters: int) -> float:
    """Median microseconds of ``fn``, one call at a time after 3 warmup calls: the shared timer
    (``common.median_ms``: CUDA events on the GPU)."""
    return median_ms(fn, "cuda", 3, iters) * 1e3


def _time_graph(fn, iters: int, calls: int = 1) -> float:
    """Median microseconds per call of a CUDA graph holding ``calls`` calls of ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return _time_events(g.replay, iters) / calls


def _time_wall(fn, iters: int, calls: int = 200) -> float:
    """Median over ``iters // 10`` (at least 5) runs of the wall microseconds per call of
    ``calls`` back-to-back calls of ``fn`` (host time included: no graph, one synchronisation
    at the end of each run)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    ts = []
    for _ in range(max(5, iters // 10)):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(ts)


def _time_cpu(fn, iters: int) -> float:
    """Median microseconds of ``fn`` on the CPU after one warmup call (``common.median_ms``)."""
    return median_ms(fn, "cpu", 1, iters) * 1e3


def _selected_keys(seg, dil, n: int) -> int:
    """Keys one query row at the last position of n reads per branch, summed over branches."""
    i = n - 1
    total = 0
    for w, r in zip(seg, dil, strict=True):
        s0 = i // w * w
        c = (i - s0) % r
        total += len(range(s0 + c, i + 1, r))
    return total


def attention_latency(args, dev, dtype) -> tuple[list[dict], list[dict]]:
    seg, dil = args.seg, args.dil
    h, hkv, d = args.heads, args.kv_heads, args.headdim
    lengths = args.lengths
    cap = max(lengths)
    torch.manual_seed(0)
    k = torch.randn(1, cap, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(1, cap, hkv, d, device=dev, dtype=dtype)
    q = torch.randn(1, 1, h, d, device=dev, dtype=dtype)
    seqlens = torch.zeros(1, dtype=torch.int32, device=dev)
    cuda = dev == "cuda"
    previous = _previous_path() if cuda else None
    rows = []
    for n in lengths:
        seqlens.fill_(n)
        dec = lambda: dilated_attention_with_kvcache(q, k, v, seqlens, seg, dil, causal=True)
        kn, vn = k[:, :n], v[:, :n]
        row = dict(n=n)
        with torch.no_grad():
            if cuda:
                row["decode"] = _time_events(dec, args.iters)
                row["graph"] = _time_graph(dec, args.iters)
                row["graph20"] = _time_graph(dec, args.iters, calls=20)
                row["previous"] = _time_events(
                    lambda kn=kn, vn=vn: previous(q, kn, vn, seg, dil, causal=True, scale=d**-0.5,
                                                  key_padding_mask=None, head_assignment="all"),
                    max(5, args.iters // 10),
                )  # fmt: skip
                qkv = q.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2)  # (B, H, N, D)
                dense = lambda qkv=qkv: F.scaled_dot_product_attention(*qkv, enable_gqa=True)
                row["dense"] = _time_events(dense, args.iters)
                row["eager_b2b"] = _time_wall(dec, args.iters)
                row["api_b2b"] = _time_wall(
                    lambda kn=kn, vn=vn: dilated_attention(q, kn, vn, seg, dil, causal=True), args.iters
                )
                row["dense_b2b"] = _time_wall(dense, args.iters)
            else:
                row["decode"] = _time_cpu(dec, args.iters)
                row["dense"] = _time_cpu(
                    lambda kn=kn, vn=vn: F.scaled_dot_product_attention(
                        q.transpose(1, 2), kn.transpose(1, 2).repeat_interleave(h // hkv, 1),
                        vn.transpose(1, 2).repeat_interleave(h // hkv, 1),
                    ),
                    args.iters,
                )  # fmt: skip
        keys = _selected_keys(seg, dil, n)
        row["keys"] = keys
        best = row.get("graph20", row["decode"])
        row["gbs"] = keys * hkv * d * 2 * k.element_size() / (best * 1e-6) / 1e9
        rows.append(row)
        print(f"  n={n}: " + ", ".join(f"{a}={b:.1f}" for a, b in row.items() if a != "n"), flush=True)
    sweep = []
    if cuda and args.sweep:
        from dilated_attention.decode import _branch_rows
        from dilated_attention.kernels.triton_decode import decode_triton

        br = _branch_rows(h, seg, dil, "all")
        br = [tuple(br[i : i + 4]) for i in range(0, len(br), 4)]
        for n in (131072, cap):
            seqlens.fill_(n)
            for bn in (32, 64, 128, 256):
                for nw in (2, 4, 8):
                    fn = lambda bn=bn, nw=nw: decode_triton(
                        q, k, v, seqlens, None, br, True, d**-0.5, block_n=bn, num_warps=nw
                    )
                    with torch.no_grad():
                        us = _time_graph(fn, args.iters, calls=20)
                    sweep.append(dict(n=n, block_n=bn, num_warps=nw, us=us))
        seqlens.fill_(cap)
    del k, v
    return rows, sweep


def _tokens_per_s(model, prompt, n_short, n_long, decode, reps=3) -> float:
    def run(n):
        if prompt.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, n, temperature=0.0, decode=decode)
        if prompt.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(n_short)  # warm-up: kernel compilation
    # the fastest of `reps` runs of each length, alternated: one difference of single runs swung
    # 1.4x-50x on 2026-11-27 (a run's fixed cost, the prefill, the cache allocation and the graph
    # capture, varies by more than the decode loop of 128 tokens takes)
    shorts, longs = [], []
    for _ in range(reps):
        shorts.append(run(n_short))
        longs.append(run(n_long))
    return (n_long - n_short) / max(min(longs) - min(shorts), 1e-9)


def generate_throughput(args, dev, dtype) -> list[dict]:
    rows = []
    decode = args.decode if dev == "cuda" else "eager"
    for ctx in args.contexts:
        base = LongNetConfig.preset(args.preset)
        total = ctx + args.new_long
        torch.manual_seed(0)
        prompt = torch.randint(0, base.vocab_size, (1, ctx), device=dev)
        row = dict(ctx=ctx)
        for kind in ("dilated", "dense"):
            cfg = base.with_attention(kind, total)
            torch.manual_seed(0)
            model = LongNetLM(cfg).to(device=dev, dtype=dtype).eval()
            row[kind] = _tokens_per_s(model, prompt, args.new_short, args.new_long, decode, args.reps)
            del model
            if dev == "cuda":
                torch.cuda.empty_cache()
            print(f"  ctx={ctx} {kind}: {row[kind]:.1f} tokens/s", flush=True)
        row["speedup"] = row["dilated"] / row["dense"]
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="directory (or .md file) for the markdown report")
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke run (float32)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the knob sweep")
    p.add_argument(
        "--decode", choices=("graph", "compile", "eager"), default="graph",
        help="generate's decode step: one CUDA graph (default), torch.compile(mode="
        "'reduce-overhead') (fuses the step's small kernels; compiles once per model: slower run) "
        "or eager (no graph: every launch from the host, issue 23 item 6's eager loop)",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=3, help="runs of each length in part 2 (the fastest counts)")
    p.add_argument("--no-latency", dest="latency", action="store_false", help="only part 2")
    p.add_argument("--no-generate", dest="generate", action="store_false", help="only part 1")
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.seg, args.dil = (64, 128, 256), (1, 2, 4)
        args.heads, args.kv_heads, args.headdim = 4, 2, 32
        args.lengths = (256, 1024, 4096)
        args.contexts, args.preset = (300,), "tiny"
        args.new_short, args.new_long = 2, 6
        args.iters = args.iters or 5
        dtype = torch.float32
    else:
        args.seg, args.dil = LONGNET
        args.heads, args.kv_heads, args.headdim = 32, 8, 128
        args.lengths = LENGTHS
        args.contexts, args.preset = (32768, 131072), "small"
        args.new_short, args.new_long = 32, 288
        args.iters = args.iters or 100
        dtype = torch.bfloat16
    t_start = time.perf_counter()
    lat, sweep, gen = [], [], []
    if args.latency:
        print("attention latency per call (us):", flush=True)
        lat, sweep = attention_latency(args, dev, dtype)
    if args.generate:
        print("generate tokens/s:", flush=True)
        gen = generate_throughput(args, dev, dtype)
    cmd = "PYTHONPATH=src " + command_line()
    lines = results_header("KV-cache decoding (issue 14)", dev, cmd, [
        f"total run {time.perf_counter() - t_start:.0f} s",
        f"attention: batch 1, 1 new token, {args.heads} q / {args.kv_heads} kv heads x "
        f"{args.headdim}, {str(dtype).removeprefix('torch.')}, causal, branches w = {list(args.seg)}, "
        f"r = {list(args.dil)}",
    ])
    lines += [""]
    if lat:
        lines += ["## One attention call (microseconds, median)", ""]
    if lat and dev == "cuda":
        lines += [
            "| cache length | decode (eager) | decode (graph) | decode (graph x20, per call) | previous (auto before) | dense SDPA | keys read | decode GB/s | dense / decode |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in lat:
            lines.append(
                f"| {r['n']} | {r['decode']:.1f} | {r['graph']:.1f} | {r['graph20']:.1f} | "
                f"{r['previous']:.1f} | {r['dense']:.1f} | {r['keys']} | {r['gbs']:.0f} | "
                f"{r['dense'] / r['graph20']:.1f}x |"
            )
        lines += [
            "",
            "## Eager back-to-back calls, wall time per call including the host (microseconds, no CUDA graph)",
            "",
            "| cache length | dilated_attention_with_kvcache | dilated_attention (1 row) | dense SDPA | dense / with_kvcache |",
            "|---|---|---|---|---|",
        ]
        for r in lat:
            lines.append(
                f"| {r['n']} | {r['eager_b2b']:.1f} | {r['api_b2b']:.1f} | {r['dense_b2b']:.1f} | "
                f"{r['dense_b2b'] / r['eager_b2b']:.2f}x |"
            )
    elif lat:
        lines += ["| cache length | decode | dense SDPA | keys read |", "|---|---|---|---|"]
        for r in lat:
            lines.append(f"| {r['n']} | {r['decode']:.1f} | {r['dense']:.1f} | {r['keys']} |")
    if sweep:
        lines += [
            "",
            "## Decode kernel knobs (graph x20, microseconds per call)",
            "",
            "| cache length | keys per split | warps | us |",
            "|---|---|---|---|",
        ]
        lines += [f"| {s['n']} | {s['block_n']} | {s['num_warps']} | {s['us']:.1f} |" for s in sweep]
    lines += [] if not gen else [
        "",
        f"## generate, preset {args.preset!r} ({str(dtype).removeprefix('torch.')}, greedy, "
        f"decode step {({'graph': 'in a CUDA graph', 'compile': 'torch.compile reduce-overhead', 'eager': 'eager, no graph'}[args.decode]) if dev == 'cuda' else 'eager'})",
        "",
        f"tokens/s of the decode loop ({args.new_long} - {args.new_short} tokens, prefill excluded; the "
        f"fastest of {args.reps} alternated runs of each length)",
        "",
        "| context | dilated tokens/s | dense tokens/s | dilated / dense |",
        "|---|---|---|---|",
    ]
    lines += [] if not gen else [
        f"| {r['ctx']} | {r['dilated']:.1f} | {r['dense']:.1f} | {r['speedup']:.2f}x |" for r in gen
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        path = args.out
        if not path.endswith(".md"):
            os.makedirs(path, exist_ok=True)
            names = ("h100", "h200", "a100", "l40s")
            tag = next((t for t in names if t in device_name(dev).lower()), "cpu" if dev == "cpu" else "gpu")
            parts = ["decode"] + (["compile"] if args.decode == "compile" else [])
            parts += ([] if args.latency else ["generate-only"]) + ([] if args.generate else ["latency-only"])
            path = os.path.join(path, f"{'_'.join(parts)}_{tag}_{utc_now()[:10]}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    print(text)


if __name__ == "__main__":
    main()
