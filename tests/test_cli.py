"""CLI smoke tests: each subcommand runs, prints its table, and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys

from dilated_attention.cli import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "reference, torch" in out


def test_verify_passes_on_cpu(tmp_path, capsys):
    assert main(["verify", "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "all passed" in out and "FAIL" not in out
    data = json.loads((tmp_path / "v.json").read_text())
    assert len(data["rows"]) >= 8


def test_bench_small(tmp_path, capsys):
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    rc = main(["bench", "--seqlens", "256", "--causal", "false", "true", "--iters", "1", "--warmup", "0",
               "--markdown", str(md), "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dense SDPA" in out and "torch" in out
    res = json.loads(js.read_text())["results"]
    assert {r["impl"] for r in res} >= {"dense SDPA", "torch"} and all(r["fwd_tflops"] > 0 for r in res)
    assert "command" in md.read_text()


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "dilated_attention", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "verify" in r.stdout
