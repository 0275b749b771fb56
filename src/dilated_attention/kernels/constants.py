"""Small per-configuration device tables that kernels read (branch tables, split tables).

They are built once per (configuration, device) and kept for the life of the process, so they
must not live in a CUDA-graph memory pool: ``torch.compile(mode="reduce-overhead")`` routes every
allocation of the thread that warms up or records a graph into that graph's private pool, and a
tensor kept alive there after the graph is done is an untracked allocation (an error, and memory
a later replay may overwrite). Building the table from a helper thread puts it in the caching
allocator's ordinary pool whatever the calling thread is doing. The first call for a
configuration must come before any stream capture (the usual warm-up), since it copies from
the host.
"""

from __future__ import annotations

import threading

import torch


def int32_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """``rows`` as an int32 tensor on ``device``, allocated outside any CUDA-graph pool."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int32, device=device)
    box: dict[str, torch.Tensor | BaseException] = {}

    def build() -> None:
        try:
            with torch.cuda.device(device):
                t = torch.tensor(rows, dtype=torch.int32, device=device)
                torch.cuda.current_stream(device).synchronize()
            box["t"] = t
        except BaseException as e:  # re-raised in the caller's thread
            box["t"] = e

    th = threading.Thread(target=build, name="dilated-attention-table")
    th.start()
    th.join()
    if isinstance(box["t"], BaseException):
        raise box["t"]
    return box["t"]
