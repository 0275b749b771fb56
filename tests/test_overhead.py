"""Host overhead (issue 23, items 3, 8, 9): no host synchronisation in a training or decode call
(CUDA, under ``torch.cuda.set_sync_debug_mode("error")``), ``import dilated_attention`` pulls in
nothing from ``torch._dynamo``, and ``benchmarks/bench_overhead.py --tiny`` runs on the CPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import dilated_attention as da

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_import_does_not_load_dynamo():
    """Nothing from torch._dynamo at import (a module-level torch.compiler decorator would load it
    and cost every user its import time)."""
    code = "import sys, torch; import dilated_attention; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.slow  # runs the whole benchmark script (9 s)
def test_bench_overhead_tiny_runs(tmp_path):
    out = tmp_path / "overhead.md"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_overhead.py"), "--tiny", "--iters", "3", "--warmup", "1",
         "--e2e-steps", "1", "--out", str(out)],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    for row in ("decode", "training", "host", "end to end"):
        assert row in text, row
    assert "| " in res.stdout


@pytest.mark.slow  # runs the benchmark script in a subprocess (~5 s)
def test_host_cost_cpu_runs():
    """benchmarks/host_cost_cpu.py (issue 23 item 3's CPU yardstick) runs: it broke silently once
    (bf16 through the Triton path, refused under the interpreter since 2026-11-28)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/host_cost_cpu.py"), "--calls", "20", "--small"],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("median host time per call") == 2, res.stdout


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_host_sync_training_decode_and_module(seed, dtype):
    dev = "cuda"
    seg, dil = [64, 128, 256], [1, 2, 4]
    q = torch.randn(2, 512, 8, 64, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 512, 2, 64, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 512, 2, 64, device=dev, dtype=dtype, requires_grad=True)
    mha = da.MultiheadDilatedAttention(256, 8, seg, dil, num_kv_heads=2, device=dev, dtype=dtype)
    x = torch.randn(2, 512, 256, device=dev, dtype=dtype)
    qd = torch.randn(2, 1, 8, 64, device=dev, dtype=dtype)
    kd, vd = (torch.randn(2, 700, 2, 64, device=dev, dtype=dtype) for _ in range(2))
    lens = torch.full((2,), 700, dtype=torch.int32, device=dev)

    def step():
        out = da.dilated_attention(q, k, v, seg, dil, causal=True, impl="auto")
        out.sum().backward()
        y, _ = mha(x, x, x, is_causal=True)
        y.float().sum().backward()
        with torch.no_grad():
            da.dilated_attention(qd, kd, vd, seg, dil, causal=True)
            da.dilated_attention_with_kvcache(qd, kd, vd, lens, seg, dil, causal=True)

    step()  # first calls: one-time probes and compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
