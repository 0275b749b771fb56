"""One timer and one results header for every measurement this project reports.

Used by ``dilated-attention bench`` (cli.py) and by the scripts in ``benchmarks/`` (through
``benchmarks/common.py``), so that every table is timed the same way and says where it came from:

- :func:`median_ms`: ``warmup`` untimed calls, then ``iters`` timed calls, the median in
  milliseconds. On a GPU each call is bracketed by CUDA events (the time the device spent, not the
  launch time); on the CPU by ``time.perf_counter``.
- :func:`versions`, :func:`device_name`, :func:`run_info`, :func:`results_header`: the lines at
  the top of a results file (command, device, versions, date), and the same as a dict for a
  results JSON.

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


def median_ms(
    fn: Callable[[], object],
    device: torch.device | str,
    warmup: int,
    iters: int,
    before: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of ``iters`` calls of ``fn()`` after ``warmup`` untimed calls.

    CUDA events around each call on a CUDA device, ``time.perf_counter`` on the CPU. ``before``,
    if given, is called before each timed call, outside the timed span (e.g. ``dist.barrier``, so
    that the ranks of a group start each call together)."""
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
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def phases_ms(
    phases: Sequence[Callable[[], object]], device: torch.device | str, iters: int
) -> list[tuple[float, float]]:
    """Per phase of a step, the median (host ms, device ms) over ``iters`` steps: each step runs
    the callables of ``phases`` in order (the device drained before each step, not between its
    phases), with a host clock and, on CUDA, an event at every boundary. A phase's device time
    runs from the event before it to the event after it: when the GPU finished the phase's work,
    or when the host recorded the event, if later. A phase whose device time is about its host
    time kept the GPU waiting for the host. On the CPU the device time is the host time. The last
    pair is the whole step's."""
    if iters < 1:
        raise ValueError(f"iters={iters}: time at least one step (iters >= 1)")
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = len(phases)
    host: list[list[float]] = [[] for _ in range(n + 1)]
    dev: list[list[float]] = [[] for _ in range(n + 1)]
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)] if cuda else []
        clock = [time.perf_counter()]
        if cuda:
            events[0].record()
        for i, fn in enumerate(phases):
            fn()
            clock.append(time.perf_counter())
            if cuda:
                events[i + 1].record()
        if cuda:
            events[-1].synchronize()
        for i in range(n):
            host[i].append((clock[i + 1] - clock[i]) * 1e3)
            dev[i].append(events[i].elapsed_time(events[i + 1]) if cuda else host[i][-1])
        host[n].append((clock[n] - clock[0]) * 1e3)
        dev[n].append(events[0].elapsed_time(events[n]) if cuda else host[n][-1])
    return [(statistics.median(h), statistics.median(d)) for h, d in zip(host, dev, strict=True)]


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


def run_info(device: torch.device | str, command: str | None = None) -> dict:
    """Where a measurement came from, for a results file or its JSON: command, device, versions,
    date (the fields of :func:`results_header`)."""
    return {
        "command": command or command_line(),
        "device": device_name(device),
        "versions": versions(),
        "date": utc_now(),
    }


def results_header(
    title: str,
    device: torch.device | str | None = None,
    command: str | None = None,
    extra: Sequence[str] = (),
    info: dict | None = None,
) -> list[str]:
    """The markdown lines at the top of a results file: title, command, device, versions, date,
    then ``extra`` lines (each written as a bullet). ``info`` (from :func:`run_info`, taken at
    the start of a run) stands for ``device`` and ``command``."""
    if info is None:
        if device is None:
            raise ValueError("results_header needs the device or the run_info() of the run")
        info = run_info(device, command)
    vers = ", ".join(f"{k} {val}" for k, val in info["versions"].items() if val is not None)
    lines = [
        f"# {title}",
        "",
        f"- command: `{info['command']}`",
        f"- device: {info['device']}",
        f"- versions: {vers}",
        f"- date: {info['date']}",
    ]
    lines += [f"- {e}" for e in extra]
    return lines
