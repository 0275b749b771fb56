"""Host cost of a fused training call, on the CPU, with stand-in launches (issue 23 item 3).

No GPU here, so the kernels are replaced by no-ops and the direct-launch machinery is told that
the (CPU) tensors sit on "device 0": every launch takes the path it takes on an H100 once warm
(``direct_launch.DirectKernel``'s kept launcher, or a training plan's), but the launcher does
nothing. What remains is the Python and torch work of one call: the front door, the autograd
Function, argument building, allocations, fills. Outputs are garbage (nothing computes them).

Allocations and fills are real CPU work here: a zero-fill of a 4 MiB buffer costs the CPU a
memset (~100 us) where a GPU's host pays one kernel launch (~5 us). So the script times two
shapes: the issue's (N = 4096, 8 heads x 64; float16 here, where the issue's bf16 is bf16 on the
GPU: the Triton path refuses bf16 under the interpreter, and the host work is the same) and the same call on 128 KiB buffers
(``--small``: N = 512, 8 heads x 16: the same launches, other grid sizes), and counts
the aten allocation / fill ops of one call (a dispatch mode), which is the number that carries
over to the GPU.

    PYTHONPATH=src python benchmarks/host_cost_cpu.py [--calls 2000] [--profile] [--small]

Prints the median host time per call of ``fwd`` (no grad) and ``fwd+bwd`` (forward, then
``torch.autograd.grad``), as benchmarks/common.training_calls builds them (impl="triton": the
CPU's ``auto`` would pick the torch path).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU passes triton_ops' device check
# glibc returns large freed blocks to the OS (munmap) and page-faults them back in at the next
# allocation: hundreds of us of kernel time per call that a GPU's caching allocator never pays.
# Keep them in the heap (set before the process starts: re-exec once).
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296",
           "MALLOC_TOP_PAD_": "268435456"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in _MALLOC.items()):
    os.environ.update(_MALLOC)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import training_calls  # noqa: E402


class _NoKernel:
    """Stands in for a ``triton.jit`` kernel: launching it does nothing and returns a stand-in
    ``CompiledKernel`` (whose launcher, see :func:`install_stand_ins`, does nothing either)."""

    def __init__(self, real):
        self.arg_names = list(getattr(real, "arg_names", ()))
        self.real = real

    def __getitem__(self, grid):
        return self._call

    def _call(self, *args, **kw):
        return _COMPILED


class _Compiled:
    function = 0
    packed_metadata = ()


_COMPILED = _Compiled()


def _noop_go(stream, args):
    return None


def _noop_grid_go(gx, gy, gz, stream, args):
    return None


def install_stand_ins() -> None:
    """CPU tensors count as CUDA device 0, the five training kernels are no-ops, and their
    launchers (``direct_launch.launcher``, ``grid_launcher``) are no-op functions."""
    from dilated_attention.kernels import direct_launch, triton_launch

    direct_launch.tensor_device = lambda t: 0
    direct_launch.current_device = lambda: 0
    direct_launch.current_stream = lambda i: 0
    direct_launch.unavailable_reason = lambda: None
    direct_launch.launcher = lambda compiled, grid: _noop_go
    direct_launch.grid_launcher = lambda compiled: _noop_grid_go  # packed documents' plans
    for name in ("_FWD_FOLDED", "_FWD", "_DELTA", "_DKDV", "_DQ"):
        dk = getattr(triton_launch, name)
        if not isinstance(dk.kernel, _NoKernel):
            dk.kernel = _NoKernel(dk.kernel)


class _CountOps(TorchDispatchMode):
    ALLOC = ("empty", "zeros", "full", "ones", "empty_like", "zeros_like", "new_empty", "new_zeros",
             "empty_strided")  # fmt: skip
    FILL = ("zero_", "fill_", "zeros", "full", "zeros_like", "ones")

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _median_us(fn, calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--small", action="store_true", help="N = 512, 8 heads x 16 (128 KiB buffers)")
    p.add_argument("--profile", action="store_true", help="cProfile 200 fwd+bwd calls, top 30")
    p.add_argument("--no-plans", action="store_true",
                   help="triton_launch.USE_PLANS = False: the per-call launch path (A/B)")  # fmt: skip
    args = p.parse_args(argv)
    if args.small:
        args.n, args.headdim = 512, 16
    torch.set_num_threads(1)
    install_stand_ins()
    from dilated_attention.kernels import triton_launch

    if args.no_plans:
        if not hasattr(triton_launch, "USE_PLANS"):
            raise SystemExit("this version has no training plans")
        triton_launch.USE_PLANS = False
    plans = getattr(triton_launch, "USE_PLANS", None)
    seg, dil = (512, 1024, 2048), (1, 2, 4)
    fns = training_calls(args.n, args.heads, args.headdim, torch.float16, seg, dil, "cpu", "triton")
    rows = []
    for name in ("fwd", "fb"):
        fn = fns[name]
        calls = args.calls if name == "fwd" else max(200, args.calls // 2)
        us = _median_us(fn, calls, warmup=20)
        with _CountOps() as c:
            fn()
        allocs = {k: v for k, v in c.ops.items() if k in _CountOps.ALLOC or k in _CountOps.FILL}
        rows.append((name, us, allocs))
    print(f"N={args.n} B=1 H={args.heads} D={args.headdim} fp16, branches {seg} / {dil}, causal, "
          f"stand-in launches, {torch.get_num_threads()} thread, training plans: "
          f"{'n/a (before plans)' if plans is None else ('on' if plans else 'off')}")  # fmt: skip
    for name, us, allocs in rows:
        print(f"  {name:4s} median host time per call: {us:8.1f} us   allocation/fill ops: {allocs}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fns["fb"]()
        prof.disable()
        for key in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
            print(f"\n===== fwd+bwd, top 30 by {key} (200 calls)\n{s.getvalue()}")


if __name__ == "__main__":
    main()
