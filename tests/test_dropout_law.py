"""The reference's dropout law: each branch occurrence of a (query, key) pair is dropped
independently (docs/spec.md).
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_dropout_drops_each_branch_occurrence_independently(seed, impl):
    """Two identical branches count every pair twice. With q = 0 the undropped weight of each
    pair is 1 / (2 N); with v one-hot the output row is the dropped weight row. Independent
    drops of the two occurrences give weights {0, 1, 2} / (2 N (1 - p)) with probabilities
    p^2, 2p(1-p), (1-p)^2; dropping the pair once gives only {0, 2} (the reference's old law)."""
    n, p, b = 8, 0.5, 64
    q = torch.zeros(b, n, 2, n, dtype=torch.float64)
    k = torch.randn(b, n, 2, n, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64)[None, :, None, :].expand(b, n, 2, n).contiguous()
    out = dilated_attention(q, k, v, [n, n], [1, 1], dropout_p=p, softmax_scale=1.0, impl=impl)
    levels = (out * 2 * n * (1 - p)).round()
    assert torch.allclose(out * 2 * n * (1 - p), levels, atol=1e-9)
    freq = [(levels == lv).double().mean().item() for lv in (0, 1, 2)]
    for got, want in zip(freq, (p * p, 2 * p * (1 - p), (1 - p) ** 2), strict=True):
        assert abs(got - want) < 0.03, (impl, freq)
    # expectation: the dropped output is unbiased
    assert abs(out.mean().item() - 1 / n) < 0.01
