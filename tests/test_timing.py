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


def test_phases_ms_times_each_phase_in_order():
    """phases_ms: the phases run in order once per step; one (host, device) pair per phase and
    one for the step, each the median over the steps; on the CPU the device time is the host
    time; the step's time covers its phases."""
    calls = []

    def slow():
        calls.append("slow")
        time.sleep(0.004)

    got = timing.phases_ms([lambda: calls.append("a"), slow, lambda: calls.append("c")], "cpu", 3)
    assert calls == ["a", "slow", "c"] * 3
    assert len(got) == 4 and all(h == d for h, d in got)
    assert got[1][0] >= 4.0 > got[0][0] and got[1][0] > got[2][0]
    assert got[3][0] >= got[1][0]
    with pytest.raises(ValueError, match="iters=0"):
        timing.phases_ms([slow], "cpu", 0)


def test_results_header_names_command_device_versions_date():
    lines = timing.results_header("T", "cpu", command="python x.py --a 1", extra=["shape: tiny"])
    text = "\n".join(lines)
    assert lines[0] == "# T"
    assert "- command: `python x.py --a 1`" in text and f"torch {torch.__version__}" in text
    assert "- device: " in text and "- date: " in text and text.endswith("- shape: tiny")


def test_median_ms_calls_before_outside_the_timed_span():
    """``before`` (a barrier in probe_ring_overlap.py) runs once before each timed call, not
    before the warmup calls, and its time is not counted."""
    order = []
    ms = timing.median_ms(lambda: order.append("fn"), "cpu", warmup=1, iters=3,
                          before=lambda: (order.append("before"), time.sleep(0.05)))
    assert order == ["fn"] + ["before", "fn"] * 3
    assert ms < 25  # the 50 ms sleeps are outside the timed span


def test_run_info_is_the_header_of_a_run():
    info = timing.run_info("cpu", command="python y.py")
    assert set(info) == {"command", "device", "versions", "date"} and info["command"] == "python y.py"
    assert info["versions"]["torch"] == torch.__version__
    lines = timing.results_header("T", info=info, extra=["x"])
    assert lines == ["# T", "", "- command: `python y.py`", f"- device: {info['device']}",
                     lines[4], f"- date: {info['date']}", "- x"] and lines[4].startswith("- versions: ")
    with pytest.raises(ValueError, match="device"):
        timing.results_header("T")


BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(f for f in BENCH.glob("*.py") if f.name != "common.py")


def test_benchmarks_use_the_shared_helper():
    """benchmarks/common.py re-exports the package's timer (one timer, not a copy); no benchmark
    script or cli.py builds its own CUDA-event timer or its own results header (command, device,
    versions, date come from timing.results_header / run_info)."""
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    assert common.median_ms is timing.median_ms and common.results_header is timing.results_header
    cli = pathlib.Path(timing.__file__).with_name("cli.py")
    own_timer = [f.name for f in [*SCRIPTS, cli] if "Event(enable_timing=True)" in f.read_text()]
    assert not own_timer, own_timer
    own_header = [f.name for f in [*SCRIPTS, cli]
                  if any(m in f.read_text() for m in ('"- command:', "torch.__version__", "python_version()"))]
    assert not own_header, own_header


def test_no_duplicated_import_fallbacks():
    """No ``try: import X / except ImportError:`` in a benchmark script whose handler imports the
    same thing again or defines a copy of what the try imports."""
    import ast

    bad = []
    for f in SCRIPTS:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Try):
                continue
            names = {a.asname or a.name for n in node.body if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
            for h in node.handlers:
                if not (isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")):
                    continue
                again = {a.asname or a.name for n in ast.walk(h) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
                defined = {n.name for n in ast.walk(h) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
                if names & (again | defined):
                    bad.append(f"{f.name}:{node.lineno} {sorted(names & (again | defined))}")
    assert not bad, bad
