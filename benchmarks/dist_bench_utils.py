"""Shared plumbing of the torchrun benchmarks (bench_ring.py, bench_sequence_parallel.py):
process-group setup, device sync, peak memory and a timer that reports the slowest rank."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist


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
    """Mean seconds per call; with a group, the max over its ranks (after a barrier)."""
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
