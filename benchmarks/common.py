"""The one timing and report helper of the benchmark scripts.

- ``median_ms(fn, device, warmup, iters)``: CUDA events around each call on a GPU,
  ``time.perf_counter`` on the CPU; the median in milliseconds (the same timer as
  ``dilated-attention bench``: it lives in ``dilated_attention.timing``).
- ``results_header(title, device, ...)``: the top of a results file (command, device, versions,
  date); ``torchrun_header(...)`` adds the process group (world size, backend, NCCL version and
  ``NCCL_*`` environment) for the torchrun scripts.
- the torchrun plumbing: ``setup`` (process group), ``sync``, ``reset_peak``, ``peak_gib`` and
  ``time_fn`` (the mean over a loop, the slowest rank's).

Scripts import it as ``from common import ...``: they run as ``python benchmarks/X.py``, which
puts ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from dilated_attention.timing import (  # noqa: F401  (re-exported for the scripts)
    command_line,
    device_name,
    median_ms,
    results_header,
    run_info,
    utc_now,
    versions,
)


def setup(device: str):
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        # the other ranks wait at a barrier while rank 0 runs the one-GPU baseline: long timeout
        dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                                timeout=datetime.timedelta(minutes=30))
        return torch.device("cuda", local)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("WORLD_SIZE", "1")))))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev) -> float | None:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    return None


def time_fn(fn, dev, warmup, iters, group=None):
    """Mean seconds per call over a loop of ``iters`` calls; with a group, the max over its ranks
    (after a barrier). A loop mean, not a per-call median: the ranks must run the same calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    if group is not None:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    dt = (time.perf_counter() - t0) / iters
    if group is not None:
        t = torch.tensor([dt], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        dt = float(t.item())
    return dt


def torchrun_header(title: str, dev: torch.device, world: int, extra=()) -> list[str]:
    """results_header for a torchrun script: the launch command, the device count and backend,
    the NCCL version and the ``NCCL_*`` environment the run saw."""
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else "-"
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    return results_header(
        title, dev, command=command_line(f"torchrun --nproc_per_node={world}"),
        extra=[f"ranks: {world}; backend {dist.get_backend()}; NCCL {nccl}", f"NCCL env: {env}", *extra],
    )
