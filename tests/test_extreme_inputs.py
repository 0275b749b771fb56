"""Extreme inputs (large logits, long rows, all-padding rows) in half precision: finite and
close to the float64 reference. Triton rows run in the interpreter on the CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from helpers import DEV, HAS_TRITON, qkv


EXTREME = [
    # (name, N, seg, dil, pad all keys but one)
    ("N=1", 1, [4], [2], False),
    ("N=2", 2, [4], [1], False),
    ("w=1", 8, [1], [1], False),
    ("r=w", 16, [4, 8], [4, 8], False),
    ("one key left", 16, [8, 16], [1, 2], True),
]


def _extreme_case(impl, dtype, name, n, seg, dil, pad, causal, device):
    d = 16
    q, k, v = qkv(2, n, n, 2, 1, d, dtype=torch.float32, device=device)
    q = (q * 100).to(dtype).requires_grad_()  # logits ~ 100 * sqrt(d) * scale
    k = (k * 100).to(dtype).requires_grad_()
    v = v.to(dtype).requires_grad_()
    kpm = None
    if pad:
        kpm = torch.ones(2, n, dtype=torch.bool, device=device)
        kpm[:, 0] = False
    out, lse = dilated_attention(q, k, v, seg, dil, causal=causal, key_padding_mask=kpm,
                                 return_lse=True, impl=impl)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref = dilated_attention(*(t.detach().double() for t in (q, k, v)), seg, dil, causal=causal,
                            key_padding_mask=kpm, impl="reference")
    assert torch.isfinite(out).all(), f"{impl} {name}: non-finite output"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), f"{impl} {name}: lse"
    for g in grads:
        assert torch.isfinite(g).all(), f"{impl} {name}: non-finite gradient"
    # the output is a convex combination of v rows: within the v range, close to the reference
    assert (out.double() - ref).abs().max() < 0.1 * (1 + ref.abs().max())


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", EXTREME, ids=[c[0] for c in EXTREME])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_inputs_cpu(impl, dtype, case, causal):
    _extreme_case(impl, dtype, *case, causal, "cpu")


@pytest.mark.skipif(not HAS_TRITON or DEV != "cpu", reason="triton interpreter rows")
@pytest.mark.parametrize("case", EXTREME, ids=[c[0] for c in EXTREME])
def test_extreme_inputs_triton_interpreter(case):
    _extreme_case("triton", torch.float16, *case, True, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["reference", "torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", EXTREME, ids=[c[0] for c in EXTREME])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_inputs_cuda(impl, dtype, case, causal):
    _extreme_case(impl, dtype, *case, causal, "cuda")
