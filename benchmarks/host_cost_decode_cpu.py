"""Host cost of one eager Triton decode call on the CPU, with stand-in launchers (issue 23 item 2).

What it times: the Python work of a decode call up to and including the two kernel launches,
with the launches replaced by no-ops. The shapes are issue 23's (1 new token, 32 q / 8 kv heads
x 128, bf16, LongNet branches (2048..32768)/(1..16), causal, batch 1, cache 4096); the tensors
are CPU tensors and the plan is put on its GPU branch (``plan.cuda = True``: the per-stream
workspace) with stand-in stream/device/capture queries, as ``tests/test_decode_plan.py`` does. So
the numbers leave out the CUDA-only costs (``torch.empty`` on CUDA, the C launches, the current
stream query) and are for before/after comparisons on one machine, not absolute GPU figures.

Both routes: ``dilated_attention_with_kvcache(q, k, v, cache_seqlens_tensor, ...)`` and
``dilated_attention(q_one_row, k, v, ...)``, each with ``impl="triton"`` (on the CPU ``"auto"``
picks the torch path) and ``impl="auto"`` with the decode rule told that the device can run the
kernel (``q.is_cuda`` is what differs on a GPU). Median per call over ``--calls`` calls, in
``--rounds`` interleaved rounds, and the number of Python and C function calls per call under
cProfile (the figure that carries over to a slower host best; the route's own lambda not
counted; the stand-ins of the three CUDA state queries count as one call each, as the C
functions they stand for do); prints one table row per route::

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_cost_decode_cpu.py [--calls 20000]

Growing-cache rows (``growing``): the cache grows by one token per call, as a caller that slices
its buffer (``k[:, :filled]``, ``integrations/hf.py``'s plain decode step) or concatenates a new
cache per step (Hugging Face's dynamic cache) passes it: a view of one buffer with length
``cache + i`` on call i of a round, either with the buffer's strides ("view") or with the strides
a fresh ``torch.cat`` of that length has ("cat strides", an ``as_strided`` view, so that no copy
is timed). Only the host work is timed: a call that builds a plan launches through the no-op
stand-in of ``kernel[grid]``, so Triton's own first-call path (tens of microseconds on the H100
host) is not in these numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import dilated_attention as da  # noqa: E402
from dilated_attention.kernels import direct_launch, select  # noqa: E402
from dilated_attention.kernels import triton_decode as td  # noqa: E402


class _NoKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing, returns None."""

    def __getitem__(self, grid):
        return lambda *a, **kw: None


def _noop(*args):  # stands in for Triton's C launch (grid, stream, function, ..., kernel arguments)
    return None


def _stand_ins() -> None:
    td._decode_split_kernel = _NoKernel()
    td._decode_reduce_kernel = _NoKernel()
    direct_launch.current_stream = lambda i: 7
    direct_launch.capturing = lambda: False
    direct_launch.current_device = lambda: -1  # a CPU tensor's get_device()
    if not direct_launch.hooks_idle():  # keep the real query where it says "idle"
        direct_launch.hooks_idle = lambda: True
    # the decode rule's "auto" on a GPU: the kernel can run and q is on CUDA
    orig = select.pick_decode_impl

    def pick(impl, q):
        return "triton" if impl == "auto" else orig(impl, q)

    for mod in (select, da.api, da.decode):
        if hasattr(mod, "pick_decode_impl"):
            mod.pick_decode_impl = pick


def _arm_plans() -> None:
    form = (_noop, (1, 1, 1), (None,) * 9)  # direct_launch.launch_form's layout
    for plan in td._PLANS.values():
        plan.cuda = True
        plan._keep_launchers(form, form)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache", type=int, default=4096)
    args = p.parse_args(argv)
    _stand_ins()
    dt = torch.float16  # (bf16 is refused under the interpreter; the host path is the same)
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    q = torch.randn(1, 1, 32, 128, dtype=dt)
    k, v = (torch.randn(1, args.cache, 8, 128, dtype=dt) for _ in range(2))
    lens = torch.full((1,), args.cache, dtype=torch.int32)
    per_round = max(1, args.calls // args.rounds)
    # the growing caches: call i of a round (and of the warm-up and profile loops) sees cache + i
    # tokens of one buffer
    kb, vb = (torch.randn(1, args.cache + max(per_round, 200), 8, 128, dtype=dt) for _ in range(2))
    row = 8 * 128

    def view(buf, n):
        return buf[:, :n]

    def cat_like(buf, n):  # the strides of a fresh (1, n, 8, 128) tensor, as torch.cat gives
        return buf.as_strided((1, n, 8, 128), (n * row, row, 128, 1))

    routes = {
        "with_kvcache triton": lambda i: da.dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=True, impl="triton"),
        "with_kvcache auto": lambda i: da.dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=True),
        "dilated_attention triton": lambda i: da.dilated_attention(q, k, v, seg, dil, causal=True, impl="triton"),
        "dilated_attention auto": lambda i: da.dilated_attention(q, k, v, seg, dil, causal=True),
        "with_kvcache triton, growing view": lambda i: da.dilated_attention_with_kvcache(
            q, view(kb, args.cache + i), view(vb, args.cache + i), lens, seg, dil, causal=True, impl="triton"),
        "dilated_attention triton, growing view": lambda i: da.dilated_attention(
            q, view(kb, args.cache + i), view(vb, args.cache + i), seg, dil, causal=True, impl="triton"),
        "dilated_attention triton, growing (cat strides)": lambda i: da.dilated_attention(
            q, cat_like(kb, args.cache + i), cat_like(vb, args.cache + i), seg, dil, causal=True, impl="triton"),
    }  # fmt: skip
    with torch.no_grad():
        for fn in routes.values():
            for i in range(32):  # every specialisation class of the growing lengths
                fn(i)
        _arm_plans()
        for fn in routes.values():
            for i in range(200):
                fn(i)
        ncalls = {}
        for name, fn in routes.items():
            prof = cProfile.Profile()
            prof.enable()
            for i in range(200):
                fn(i)
            prof.disable()
            ncalls[name] = pstats.Stats(prof).total_calls / 200 - 1  # not the route's lambda
        plans_before = len(td._PLANS)
        med: dict[str, list[float]] = {n: [] for n in routes}
        mean: dict[str, list[float]] = {n: [] for n in routes}
        clock = time.perf_counter_ns
        for _ in range(args.rounds):
            for name, fn in routes.items():
                ts = []
                t_all = clock()
                for i in range(per_round):
                    t0 = clock()
                    fn(i)
                    ts.append(clock() - t0)
                mean[name].append((clock() - t_all) / per_round / 1e3)
                med[name].append(statistics.median(ts) / 1e3)
    print(f"| route (CPU, stand-in launches, cache {args.cache}) | median us/call | mean us/call (loop) | calls/call |")
    print("|---|---|---|---|")
    for name in routes:
        print(f"| {name} | {statistics.median(med[name]):.2f} | {statistics.median(mean[name]):.2f} | {ncalls[name]:.0f} |")
    print(f"\ndecode plans: {plans_before} after the warm-up, {len(td._PLANS)} after the timed calls "
          f"(the table keeps at most {td._MAX_PLANS})")


if __name__ == "__main__":
    main()
