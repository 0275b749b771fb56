"""The one timer and results header (dilated_attention.timing, re-exported by benchmarks/common.py)."""

from __future__ import annotations

import pathlib
import sys
import time

import pytest
import torch

from dilated_attention import timing


def test_median_ms_counts_warmup_and_iters_and_takes_the_median():
    calls, delays = [], iter([0.0, 0.0, 0.001, 0.030, 0.002])  # 2 warmup, then 3 timed

    def fn():
        calls.append(1)
        time.sleep(next(delays))

    ms = timing.median_ms(fn, "cpu", warmup=2, iters=3)
    assert len(calls) == 5
    assert 1.5 < ms < 25  # the median (2 ms), not the mean (11 ms) or the 30 ms outlier


@pytest.mark.parametrize("warmup, iters, match", [(0, 0, "iters=0"), (-1, 1, "warmup=-1")])
def test_median_ms_rejects_bad_counts(warmup, iters, match):
    with pytest.raises(ValueError, match=match):
        timing.median_ms(lambda: None, "cpu", warmup, iters)


def test_results_header_names_command_device_versions_date():
    lines = timing.results_header("T", "cpu", command="python x.py --a 1", extra=["shape: tiny"])
    text = "\n".join(lines)
    assert lines[0] == "# T"
    assert "- command: `python x.py --a 1`" in text and f"torch {torch.__version__}" in text
    assert "- device: " in text and "- date: " in text and text.endswith("- shape: tiny")


def test_benchmarks_use_the_shared_helper():
    """benchmarks/common.py re-exports the package's timer (one timer, not a copy), and no
    benchmark script or cli.py builds its own CUDA-event timer loop besides the two that need
    theirs (bench_decode.py's graph timer, probe_ring_overlap.py's barrier per call)."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import common
    finally:
        sys.path.remove(str(bench))
    assert common.median_ms is timing.median_ms
    own = {"bench_decode.py", "probe_ring_overlap.py", "bench_overhead.py", "bench_varlen.py"}
    copies = [f.name for f in sorted(bench.glob("*.py"))
              if "Event(enable_timing=True)" in f.read_text() and f.name not in own]
    cli = pathlib.Path(timing.__file__).with_name("cli.py")
    assert not copies and "Event(enable_timing=True)" not in cli.read_text(), copies
