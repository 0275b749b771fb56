"""The dK/dV kernel split in two launches (``config={"dkdv_split": ...}``: a dV-only pass, then a
dK-only pass, ``PASS`` 1 and 2 of ``dilated_bwd_dkdv_kernel``; an experiment of issue 24,
benchmarks/ab_dkdv_split.py): the same bits as the one-launch kernel (``PASS`` 0), through the
per-call path and through a training plan, one sequence and packed documents, causal or not,
GQA, a key padding mask, several branches (hi/lo accumulators). Under the interpreter on the
CPU; on CUDA the same test runs the compiled kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dilated_attention.branches import branch_head_ranges  # noqa: E402
from dilated_attention.kernels import select  # noqa: E402
from dilated_attention.kernels import triton_launch as L  # noqa: E402
from dilated_attention.reference import dilated_attention_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEV == "cpu" and not select.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _grads(q, k, v, do, kpm, seg, dil, causal, config, docs, plans, monkeypatch):
    monkeypatch.setattr(L, "USE_PLANS", plans)
    monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    hr = branch_head_ranges(q.shape[2], len(seg), "all")
    scale = q.shape[-1] ** -0.5
    out, lse = L.forward(q, k, v, kpm, seg, dil, causal, scale, hr, config=config, docs=docs)
    return L.backward(do, q, k, v, kpm, out, lse, seg, dil, causal, scale, hr, config=config, docs=docs)


@pytest.mark.parametrize("plans", [False, True], ids=["per-call", "plan"])
@pytest.mark.parametrize("case", ["causal-gqa", "kpm", "packed-causal"])
def test_split_passes_give_the_one_launch_bits(seed, monkeypatch, plans, case):
    d = 16 if DEV == "cpu" else 64
    n, h, hkv = 96, 4, 2
    seg, dil = (16, 32, 96), (1, 2, 4)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    causal, kpm, docs = case != "kpm", None, None
    b = 1 if case.startswith("packed") else 2
    q = torch.randn(b, n, h, d, dtype=dtype, device=DEV)
    k = torch.randn(b, n, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, n, hkv, d, dtype=dtype, device=DEV)
    do = torch.randn(b, n, h, d, dtype=dtype, device=DEV)
    if case == "kpm":
        kpm = torch.rand(b, n, device=DEV) < 0.25
    if case.startswith("packed"):
        cu = torch.tensor([0, 7, 7, 50, 96], dtype=torch.int32, device=DEV)
        docs = L.Docs(cu, cu, 46, 46)  # documents of 7, 0, 43 and 46 rows
    split = dict(dkdv_split=L.default_configs(d)["dkdv"])
    want = _grads(q, k, v, do, kpm, seg, dil, causal, None, docs, plans, monkeypatch)
    got = _grads(q, k, v, do, kpm, seg, dil, causal, split, docs, plans, monkeypatch)
    for name, a, g in zip(("dq", "dk", "dv"), want, got, strict=True):
        assert torch.equal(a, g), name
    assert want[1].abs().sum() > 0 and want[2].abs().sum() > 0  # not two all-zero results
    if docs is None:  # and both against the float64 reference (packed: test_triton_varlen*.py)
        x64 = [t.double().requires_grad_() for t in (q, k, v)]
        out, _ = dilated_attention_reference(*x64, seg, dil, causal=causal, key_padding_mask=kpm)
        ref = torch.autograd.grad(out, x64, do.double())
        tol = 2e-4 if dtype == torch.float32 else 5e-2
        for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(g.double(), r, atol=tol, rtol=tol, msg=name)


def test_dkdv_split_config_is_checked():
    with pytest.raises(ValueError, match="dkdv BN % BM == 0"):
        L.resolve_configs(64, {"dkdv_split": (64, 32, 4, 2)})
    with pytest.raises(ValueError, match="dkdv_split"):
        L.resolve_configs(64, {"dkdv_splt": (64, 64, 4, 2)})
    cfg = L.resolve_configs(64, {"dkdv_split": (32, 64, 4, 2)})
    assert L._dkdv_launches(cfg) == ((32, 64, 4, 2), (1, 2))
    assert L._dkdv_launches(L.resolve_configs(64)) == (L.default_configs(64)["dkdv"], (0,))
