"""Spawn real gloo process groups for distributed tests (no mocking of torch.distributed).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes with
``torch.multiprocessing.start_processes`` (forkserver), joins them in a process group through a ``file://`` rendezvous in
a fresh temp dir (no ports), and calls ``fn(rank, world_size, *args)`` in each. An exception in any
rank fails the test with that rank's traceback; the other ranks are terminated. ``fn`` must be a
module-level function (it is pickled). Spawning costs seconds per process on a small CPU machine:
run many cases inside one ``fn`` rather than one spawn per case.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60  # a hang becomes an error after this, before pytest-timeout fires


def _worker(rank, world_size, init_file, fn, args):
    torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    # forkserver: ranks fork from a server that imported torch once (fresh "spawn" processes
    # would each import torch again, seconds apiece), and never from the threaded test process
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dilated_attention"])
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _worker, args=(world_size, init_file, fn, args), nprocs=world_size, join=True,
            start_method="forkserver",
        )

