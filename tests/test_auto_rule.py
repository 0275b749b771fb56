"""The ``impl="auto"`` rule (kernels/auto_rule.py) on synthetic measurement tables, and the
fallback for head dims the Triton kernel does not support."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.kernels import auto_rule
from dilated_attention.kernels.auto_rule import CallShape, Measured, choose_impl

LONGNET = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))
MANY = ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64))
PAPER = ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12))


def shape(branches=LONGNET, n=131072, causal=False, grad=True, b=1, h=16, hkv=16, d=128, p=0.0):
    return CallShape(b, n, h, hkv, d, "bf16", tuple(branches), causal, grad, p)


def row(s, torch_ms, triton_ms):
    return Measured(s, (("torch", torch_ms), ("triton", triton_ms)))


def test_default_without_measurements():
    assert auto_rule.MEASURED == () or isinstance(auto_rule.MEASURED, tuple)
    assert choose_impl(shape(), table=()) == "triton"
    assert choose_impl(shape(causal=True, grad=False), table=()) == "triton"


def test_dropout_and_unavailable_triton_give_torch():
    table = (row(shape(), 100.0, 10.0),)
    assert choose_impl(shape(p=0.1), table=table) == "torch"
    assert choose_impl(shape(), triton_ok=False, table=table) == "torch"
    assert choose_impl(shape(), table=table) == "triton"


def test_picks_the_fastest_of_the_nearest_row():
    table = (
        row(shape(LONGNET), 50.0, 40.0),  # triton wins on LongNet
        row(shape(MANY, n=65536, b=2), 60.0, 120.0),  # torch wins with r up to 64
    )
    assert choose_impl(shape(LONGNET), table=table) == "triton"
    assert choose_impl(shape(MANY, n=65536, b=2), table=table) == "torch"
    # an unmeasured call near the many-branch row (r up to 32, 6 branches)
    assert choose_impl(shape(MANY[:6], n=65536), table=table) == "torch"
    # near LongNet (N doubled)
    assert choose_impl(shape(LONGNET, n=262144), table=table) == "triton"


def test_causal_and_grad_classes_are_separate():
    table = (
        row(shape(causal=False, grad=True), 10.0, 20.0),  # torch wins non-causal training
        row(shape(causal=True, grad=True), 20.0, 10.0),
    )
    assert choose_impl(shape(causal=False), table=table) == "torch"
    assert choose_impl(shape(causal=True), table=table) == "triton"
    # no forward-only row measured: default
    assert choose_impl(shape(causal=False, grad=False), table=table) == "triton"


def test_rows_without_a_triton_time_count_as_torch():
    table = (Measured(shape(), (("torch", 10.0), ("triton", None))),)
    assert choose_impl(shape(), table=table) == "torch"


def test_ties_go_to_the_earlier_row():
    s = shape()
    table = (row(s, 10.0, 20.0), row(s, 20.0, 10.0))
    assert choose_impl(s, table=table) == "torch"


def test_features_see_the_geometry():
    f = auto_rule.features
    assert f(shape(LONGNET))[0] == 4  # log2 r_max
    assert f(shape(MANY))[1] == 7
    assert f(shape(PAPER))[3] == 0  # 16384 % 6 != 0
    assert f(shape(LONGNET))[4] == 1 and f(shape(LONGNET, causal=True))[4] == 0
    assert f(shape(PAPER))[4] == 0  # r_max 12 does not divide w_min 2048
    assert f(shape(hkv=1))[5] == 4
    assert auto_rule.dtype_name(torch.bfloat16) == "bf16"


# ------------------------------------------------------------------ head dims under auto
ODD_HEADDIMS = [8, 24, 80, 96, 100, 256, 7]

# Runs in a fresh process with TRITON_INTERPRET=1 (the interpreter mode is fixed per process),
# so the Triton kernel is "available" on the CPU and only the head dim can rule it out.
_INTERP_SCRIPT = r"""
import json, sys, torch
from dilated_attention import dilated_attention
try:
    from dilated_attention.kernels.select import pick_impl, triton_unavailable_reason
except ImportError:
    from dilated_attention.kernels.select import pick_impl, triton_unavailable_reason
res = {}
for d in [int(x) for x in sys.argv[1].split(",")]:
    q, k, v = (torch.randn(1, 24, 2, d, dtype=torch.float32, requires_grad=True) for _ in range(3))
    r = dict(reason=triton_unavailable_reason(q, k), auto=pick_impl("auto", q, k, 0.0))
    out = dilated_attention(q, k, v, (8, 16), (1, 2), impl="auto")
    ref = dilated_attention(q.double(), k.double(), v.double(), (8, 16), (1, 2), impl="reference")
    r["auto_err"] = (out.double() - ref).abs().max().item()
    out.sum().backward()
    r["grad_finite"] = bool(torch.isfinite(q.grad).all())
    try:
        dilated_attention(q, k, v, (8, 16), (1, 2), impl="triton")
        r["triton_error"] = None
    except ValueError as e:
        r["triton_error"] = str(e)
    res[d] = r
print(json.dumps(res))
"""


@pytest.mark.slow  # a fresh process in interpreter mode
def test_headdims_auto_falls_back_triton_raises():
    """Triton runs (interpreter) for its head dims; for every other one ``auto`` picks torch
    and is exact, and ``impl='triton'`` raises a ValueError naming the head dim and the fix."""
    pytest.importorskip("triton")
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    src = pathlib.Path(auto_rule.__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    dims = ODD_HEADDIMS + [64]
    proc = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT, ",".join(map(str, dims))],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for d in dims:
        r = res[str(d)]
        assert r["auto_err"] < 1e-5 and r["grad_finite"], (d, r)
        if d == 64:
            # the kernel can run (interpreter), but auto never picks the interpreter on the CPU
            assert r["reason"] is None and r["auto"] == "torch" and r["triton_error"] is None, (d, r)
        else:
            assert r["auto"] == "torch", (d, r)
            assert f"headdim {d}" in r["reason"] and "impl='torch'" in r["reason"], (d, r)
            assert r["triton_error"] and f"headdim {d}" in r["triton_error"], (d, r)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [80, 96, 256])
def test_odd_headdims_cuda(seed, d):
    """On the GPU: auto runs the torch path for head dims the kernel lacks (bf16, fwd + bwd
    against the float64 reference), impl='triton' raises naming the head dim."""
    q, k, v = (torch.randn(1, 512, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    seg, dil = (64, 128), (1, 2)
    out = dilated_attention(q, k, v, seg, dil, impl="auto")
    ref = dilated_attention(*(t.detach().double() for t in (q, k, v)), seg, dil, impl="reference")
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match=f"headdim {d}"):
        dilated_attention(q, k, v, seg, dil, impl="triton")
