"""Empty inputs (batch, length or heads of size 0, head dim 0) give empty outputs and gradients,
like scaled_dot_product_attention.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from helpers import ALL_IMPLS, DEV, qkv


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize(
    "shape,extra",
    [
        ((1, 0, 16), dict(causal=True)),  # seqlen_q = 0, seqlen_k > 0
        ((1, 0, 16), dict(key_padding_mask=True)),
        ((0, 16, 16), dict(key_padding_mask=True)),  # batch 0 with a mask
        ((0, 16, 16), dict(dropout_p=0.5)),  # batch 0 with dropout
    ],
)
@pytest.mark.parametrize("branches", [([8], [2]), ([3], [3])])  # ([3], [3]): an IndexError before
def test_empty_inputs(impl, shape, extra, branches):
    b, nq, nk = shape
    q, k, v = qkv(b, nq, nk, 2, 1, 4, requires_grad=True)
    kw = dict(extra)
    if kw.pop("key_padding_mask", None):
        kw["key_padding_mask"] = torch.zeros(b, nk, dtype=torch.bool)
    out, lse = dilated_attention(q, k, v, *branches, impl=impl, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (b, 2, nq)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and (g == 0).all()


@pytest.mark.parametrize("impl", ["auto", *ALL_IMPLS])
def test_headdim_zero_like_sdpa(impl):
    """headdim 0: SDPA returns an empty output; here too, with lse = log(number of keys), for
    every impl (impl="triton" refused it as "headdim 1 not supported" before)."""
    q = torch.randn(1, 8, 2, 0, device=DEV)
    out, lse = dilated_attention(q, q, q, [4], [1], causal=True, impl=impl, return_lse=True)
    assert out.shape == q.shape
    want = torch.log(torch.tensor([1, 2, 3, 4, 1, 2, 3, 4], dtype=torch.float32, device=DEV))
    torch.testing.assert_close(lse, want.expand(1, 2, 8))
