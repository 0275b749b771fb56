"""Autocast: inputs are cast like scaled_dot_product_attention casts them; float64 stays outside.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from helpers import DEV, HAS_TRITON, qkv


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("variant", ["plain", "causal", "mask"])
def test_autocast_casts_inputs_like_sdpa(seed, impl, variant):
    """Under autocast(cpu, bf16), float32 inputs give exactly the bf16 call's result in bf16, on
    every path (before: exact float32 without a mask, bf16 math returned as float32 with one)."""
    q, k, v = qkv(2, 16, 16, 2, 2, 8, dtype=torch.float32, requires_grad=True)
    kw = {}
    if variant == "causal":
        kw["causal"] = True
    if variant == "mask":
        kw["key_padding_mask"] = torch.rand(2, 16) < 0.3
    want = dilated_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), [8], [2], impl=impl, **kw)
    with torch.autocast("cpu", torch.bfloat16):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        got = dilated_attention(q, k, v, [8], [2], impl=impl, **kw)
        mixed = dilated_attention(q.bfloat16(), k, v, [8], [2], impl=impl, **kw)
    assert sdpa.dtype == torch.bfloat16  # the rule we follow
    assert got.dtype == mixed.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(mixed, want, atol=0, rtol=0)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_autocast_leaves_float64_and_mixed_outside_raises(seed):
    q, k, v = qkv(1, 8, 8, 2, 2, 4, dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        out = dilated_attention(q, k, v, [8], [1], impl="torch")
    assert out.dtype == torch.float64  # autocast never casts float64
    with pytest.raises(TypeError, match="share a dtype.*autocast"):
        dilated_attention(q.float().bfloat16(), k.float(), v.float(), [8], [1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton unavailable")
def test_autocast_triton(seed):
    dtype_low = torch.bfloat16 if DEV == "cuda" else torch.float16
    q, k, v = qkv(1, 16, 16, 2, 2, 16, dtype=torch.float32, device=DEV)
    want = dilated_attention(q.to(dtype_low), k.to(dtype_low), v.to(dtype_low), [8], [2], impl="triton")
    with torch.autocast(DEV, dtype_low):
        got = dilated_attention(q, k, v, [8], [2], impl="triton")
    assert got.dtype == dtype_low
    torch.testing.assert_close(got, want, atol=0, rtol=0)
