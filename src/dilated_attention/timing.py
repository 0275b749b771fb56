"""One timer and one results header for every measurement this project reports.

Used by ``dilated-attention bench`` (cli.py) and by the scripts in ``benchmarks/`` (through
``benchmarks/common.py``), so that every table is timed the same way and says where it came from:

- :func:`median_ms`: ``warmup`` untimed calls, then ``iters`` timed calls, the median in
  milliseconds. On a GPU each call is bracketed by CUDA events (the time the device spent, not the
  launch time); on the CPU by ``time.perf_counter``.
- :func:`versions`, :func:`device_name`, :func:`results_header`: the lines at the top of a results
  file (command, device, versions, date).

Nothing here changes process state (no TF32 switch, no environment variable).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch


def median_ms(fn: Callable[[], object], device: torch.device | str, warmup: int, iters: int) -> float:
    """Median milliseconds of ``iters`` calls of ``fn()`` after ``warmup`` untimed calls.

    CUDA events around each call on a CUDA device, ``time.perf_counter`` on the CPU."""
    if iters < 1:
        raise ValueError(f"iters={iters}: time at least one call (iters >= 1)")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: the number of untimed calls cannot be negative")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def versions() -> dict:
    """The library, python, torch, CUDA and Triton versions (None where absent)."""
    from . import __version__

    info = {
        "dilated_attention": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton
    except ImportError:
        info["triton"] = None
    else:
        info["triton"] = triton.__version__
    return info


def device_name(device: torch.device | str) -> str:
    """The GPU's name on a CUDA device, the processor's otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def utc_now() -> str:
    """The date and time in UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line(launcher: str = "python") -> str:
    """How this process was started, as a user would type it."""
    return " ".join([launcher, *sys.argv])


def results_header(
    title: str, device: torch.device | str, command: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The markdown lines at the top of a results file: title, command, device, versions, date,
    then ``extra`` lines (each written as a bullet)."""
    v = versions()
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)
    lines = [
        f"# {title}",
        "",
        f"- command: `{command or command_line()}`",
        f"- device: {device_name(device)}",
        f"- versions: {vers}",
        f"- date: {utc_now()}",
    ]
    lines += [f"- {e}" for e in extra]
    return lines
