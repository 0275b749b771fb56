"""Where the host time of one eager call goes (issue 23): cProfile over back-to-back calls.

Profiles the two calls whose host cost dominates (bench_overhead.py's shapes): an eager decode step
through ``dilated_attention_with_kvcache`` (1 token, 32 q / 8 kv x 128, bf16, cache 32K, LongNet
branches) and a training call (N = 4096, 8 x 64, branches 512..2048 / 1..4, causal, fwd+bwd).
Prints the top functions by self time and by cumulative time, per call::

    python benchmarks/profile_host.py [--calls 200] [--top 30] [--no-plans]

``--no-plans``: the training call through the per-call launch path (``triton_launch.USE_PLANS``
False), for an A/B of the training launch plans.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

import dilated_attention as da


def _report(prof: cProfile.Profile, calls: int, top: int, title: str) -> None:
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(f"\n===== {title}: top {top} by {key} ({calls} calls; divide by {calls} for per call)")
        print(s.getvalue())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--no-plans", action="store_true",
                   help="training calls through the per-call launch path (triton_launch.USE_PLANS = False)")
    p.add_argument("--gpu-time", action="store_true",
                   help="also: wall per call, GPU kernel time per call and the aten ops per call (torch.profiler)")
    args = p.parse_args(argv)
    if args.no_plans:
        from dilated_attention.kernels import triton_launch

        triton_launch.USE_PLANS = False
    dev, dt = torch.device("cuda"), torch.bfloat16
    seg, dil = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    k, v = (torch.randn(1, 32768, 8, 128, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((1,), 32768, dtype=torch.int32, device=dev)

    def decode():
        return da.dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=True)

    n, tseg, tdil = 4096, (512, 1024, 2048), (1, 2, 4)
    qq, kk, vv = (torch.randn(1, n, 8, 64, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(1, n, 8, 64, device=dev, dtype=dt)

    def train():
        out = da.dilated_attention(qq, kk, vv, tseg, tdil, causal=True, impl="auto")
        torch.autograd.grad(out, (qq, kk, vv), do)

    def train_fwd():
        return da.dilated_attention(qq, kk, vv, tseg, tdil, causal=True, impl="auto")

    cases = (("decode 32K", decode, args.calls, False),
             ("training N=4096 fwd", train_fwd, args.calls, False),
             ("training N=4096 fwd+bwd", train, max(20, args.calls // 5), True))
    for title, fn, calls, grad in cases:
        with torch.set_grad_enabled(grad):
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            prof.disable()
        _report(prof, calls, args.top, title)
    if args.gpu_time:
        summary = [_gpu_time(title, fn, grad) for title, fn, _, grad in cases]
        print("\n| call | wall us/call (loop) | GPU kernel us/call | kernels/call | host-side aten ops/call |")
        print("|---|---:|---:|---:|---:|")
        for row in summary:
            print("| %s | %.1f | %.1f | %.1f | %.1f |" % row)


def _gpu_time(title, fn, grad, calls: int = 50):
    """(title, wall us per call of a back-to-back loop, GPU kernel us per call, kernels per call,
    aten ops per call) and the aten ops' table: is the call host-bound, and by how much?"""
    import time

    from torch.profiler import ProfilerActivity, profile

    with torch.set_grad_enabled(grad):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / calls * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    kern = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    gpu = sum(e.time_range.elapsed_us() for e in kern) / calls
    aten = [e for e in prof.events() if e.name.startswith("aten::") and str(e.device_type).endswith("CPU")]
    print(f"\n===== {title}: aten ops by count ({calls} calls)")
    counts: dict = {}
    for e in aten:
        counts[e.name] = counts.get(e.name, 0) + 1
    for name, c in sorted(counts.items(), key=lambda x: -x[1])[:25]:
        print(f"  {c / calls:6.1f}/call  {name}")
    names: dict = {}
    for e in kern:
        names[e.name[:70]] = names.get(e.name[:70], 0) + e.time_range.elapsed_us()
    for name, t in sorted(names.items(), key=lambda x: -x[1])[:12]:
        print(f"  GPU {t / calls:8.1f} us/call  {name}")
    return (title, wall, gpu, len(kern) / calls, len(aten) / calls)


if __name__ == "__main__":
    main()
