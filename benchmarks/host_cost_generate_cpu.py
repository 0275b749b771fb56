"""Host cost of one eager decode step of ``LongNetLM.generate`` on the CPU (issue 23 item 6).

What it times: exactly the step that ``generate(..., decode="eager")`` runs per token, i.e.
``model._decode_step(b, t, "eager")(tok, pos)`` followed by the greedy ``_sample`` (argmax), on
a model with the ``small`` preset's structure (its layer count, heads, branches, GQA off) but
tiny widths (head dim 8, FFN 2 x dim), so that the arithmetic is negligible and the host work
dominates, as it does on the GPU. The KV cache is set up with ``setup_cache`` and a short prompt
prefilled, as ``generate`` does; then ``--steps`` decode steps per round, the median per step.

Modes (``--mode``):

- ``gpu-like`` (default): the decode attention takes the Triton route with no-op launches (the
  stand-ins of ``host_cost_decode_cpu.py``: ``impl="auto"`` picks Triton, the plan's launches
  do nothing), the rotary takes the fused kernel with a no-op ``kernel[grid]`` (what
  ``Rotary.rotate`` does on CUDA), and where the tree has them the decode step's fused add /
  GELU LayerNorms run with a launch that only zeroes their outputs; outputs are garbage, only the host work counts. What stays
  out: the CUDA-only costs (allocations, launches, Triton's JIT ``run`` of the rotary kernel).
- ``cpu``: the real CPU paths (torch decode, torch rotary): exact outputs, and the host work of
  the torch decode path (many small ops) on top.

Prints the median us per step (median over ``--rounds`` rounds of the per-step median), the
Python and C function calls per step under cProfile, and with ``--profile N`` the N functions
with the most own time::

    PYTHONPATH=src python benchmarks/host_cost_generate_cpu.py [--mode gpu-like] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pathlib
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from dilated_attention import flags  # noqa: E402
from common import eager_decoder  # noqa: E402
from dilated_attention.models.longnet import LongNetConfig, LongNetLM  # noqa: E402


class _NoKernel:
    def __getitem__(self, grid):
        return lambda *a, **kw: None


def _gpu_like() -> None:
    import host_cost_decode_cpu as hc

    hc._stand_ins()  # Triton decode with no-op launches and stand-in device queries
    from dilated_attention.kernels import triton_rotary

    triton_rotary._rotary_kernel = _NoKernel()
    if hasattr(triton_rotary, "_ROTARY_CACHE"):  # the decode step's rotation + cache write
        triton_rotary._ROTARY_CACHE.kernel = _NoKernel()
    flags.set_fused_rotary(True)
    from dilated_attention.kernels import triton_layernorm

    if hasattr(triton_layernorm, "_PRO_LN"):  # the decode step's fused add / GELU LayerNorms
        triton_layernorm._PRO_LN.kernel = _ZeroingKernel((2, 3))
        flags.set_triton_layernorm(True)  # taken as on CUDA (no autocast here: nothing else moves)


class _ZeroingKernel:
    """A no-op launch that zeroes its output tensors (positions ``outs`` of the arguments) with
    one C memset each: garbage (denormals, NaN) would make the CPU's next matmuls slow."""

    def __init__(self, outs):
        self.outs = outs

    def __getitem__(self, grid):
        def go(*a, **kw):
            for i in self.outs:
                t = a[i]
                ctypes.memset(t.data_ptr(), 0, t.numel() * t.element_size())

        return go


def _zeroing_reduce(nbytes: int) -> None:
    """The plans' stand-in reduce launch zeroes the attention output (one C memset) instead of
    leaving it uninitialised: denormal or NaN garbage makes the CPU's matmuls slow, a cost no
    GPU has."""
    from dilated_attention.kernels import triton_decode as td

    for plan in td._PLANS.values():
        at = -(len(plan.reduce_tail) + 2)  # (..., wp, lpw, outp, lsep, *reduce_tail)
        plan.reduce_go = lambda *a, _at=at: ctypes.memset(a[_at], 0, nbytes)


def _count_ops(fn, n: int) -> tuple[float, float]:
    """Torch operators per call of ``fn`` (all, and those that are not views or metadata: each
    of these is a kernel launch or an allocation on a GPU), counted by a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = [0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[0] += 1
            if not func.is_view and func.__name__.split(".")[0] not in ("empty", "empty_like", "detach"):
                counts[1] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(n):
            fn()
    return counts[0] / n, counts[1] / n


def build(args):
    base = LongNetConfig.preset("small")
    dim = base.n_head * args.head_dim
    cfg = LongNetConfig.preset(
        "small", dim=dim, ffn_dim=2 * dim, n_kv_head=args.kv_heads, n_layer=args.layers or base.n_layer
    )
    torch.manual_seed(0)
    model = LongNetLM(cfg).to(dtype=args.dtype).eval()
    return cfg, model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("gpu-like", "cpu"), default="gpu-like")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="n_kv_head (default: n_head, no GQA)")
    p.add_argument("--layers", type=int, default=None, help="default: the small preset's")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=300, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, help="print the N functions with most own time")
    args = p.parse_args(argv)
    # one intra-op thread: the host of a GPU step is one thread, and on a busy 2-core box an
    # OpenMP barrier in a small op (gelu, a bf16 matmul) can cost milliseconds
    torch.set_num_threads(1)
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.mode == "gpu-like":
        _gpu_like()
    cfg, model = build(args)
    b, t = 1, args.prompt
    total_steps = args.steps * args.rounds + 400
    torch.manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (b, t))
    clock = time.perf_counter_ns
    with torch.no_grad():
        one, _ = eager_decoder(model, prompt, t + total_steps + 1)
        for _ in range(100):  # warm-up: plans, fast-path entries
            one()
        if args.mode == "gpu-like":
            import host_cost_decode_cpu as hc

            hc._arm_plans()
            _zeroing_reduce(b * cfg.n_head * cfg.head_dim * prompt.new_empty((), dtype=args.dtype).element_size())
        for _ in range(50):
            one()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            one()
        prof.disable()
        stats = pstats.Stats(prof)
        calls = stats.total_calls / 200
        ops = _count_ops(one, 20)
        meds = []
        for _ in range(args.rounds):
            ts = []
            for _ in range(args.steps):
                t0 = clock()
                one()
                ts.append(clock() - t0)
            meds.append(statistics.median(ts) / 1e3)
    model.clear_cache()
    print(
        f"mode {args.mode}, {str(args.dtype).removeprefix('torch.')}, {cfg.n_layer} layers, "
        f"{cfg.n_head}/{cfg.kv_heads} heads x {cfg.head_dim}, prompt {t}: "
        f"median {statistics.median(meds):.1f} us/step (rounds {min(meds):.1f}-{max(meds):.1f}), "
        f"{calls:.0f} function calls/step, {ops[0]:.0f} torch ops/step ({ops[1]:.0f} not views: "
        "about one kernel each on a GPU)"
    )
    if args.profile:
        stats.sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
