"""The generate benchmarks' CPU smoke runs (``--tiny``): ``bench_decode.py``'s generate rows
(fastest of ``--reps`` runs per length) and ``profile_decode_step.py``'s table, both arms."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_decode  # noqa: E402
import profile_decode_step  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the --tiny smoke runs are CPU runs")


def _rows(text):
    return [ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()]


def test_bench_decode_generate_rows(tmp_path, monkeypatch):
    runs = []
    real = bench_decode._tokens_per_s

    def spy(model, prompt, n_short, n_long, decode, reps=3):
        runs.append(reps)
        return real(model, prompt, n_short, n_long, decode, reps)

    monkeypatch.setattr(bench_decode, "_tokens_per_s", spy)
    out = tmp_path / "gen.md"
    bench_decode.main(["--tiny", "--no-latency", "--reps", "2", "--out", str(out)])
    rows = _rows(out.read_text())
    assert runs == [2, 2] and len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3].endswith("x")


def test_profile_decode_step_table(tmp_path):
    out = tmp_path / "pds.md"
    profile_decode_step.main(["--tiny", "--out", str(out)])
    text = out.read_text()
    rows = _rows(text)
    assert [r.split("|")[2].strip() for r in rows] == ["dilated", "dense"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[2:5])  # eager b2b, sync, host issue
        assert cells[5] == "nan"  # no graph on the CPU
        assert float(cells[8]) > 0 and float(cells[9]) > 0  # aten ops, Python calls
    assert "## 200 dilated" in text and "function calls" in text
