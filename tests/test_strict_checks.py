"""Strict argument types (no silent bool/int/float coercion) and contiguous outputs.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import DilatedAttention, dilated_attention
from helpers import ALL_IMPLS, DEV, qkv


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(causal="no"), TypeError, "causal must be a bool"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(dilation_rates=[True, 2], segment_lengths=[8, 8]), TypeError, "bool True"),
        (dict(segment_lengths=[8, False], dilation_rates=[1, 1]), TypeError, "bool False"),
        (dict(segment_lengths="16", dilation_rates="1"), TypeError, "sequences of ints"),
        (dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
        (dict(softmax_scale="0.25"), TypeError, "softmax_scale must be a real number"),
        (dict(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
        (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    ],
)
def test_strict_argument_types(kwargs, exc, match):
    q, k, v = qkv(1, 16, 16, 2, 2, 4, dtype=torch.float32)
    args = dict(segment_lengths=[8], dilation_rates=[1])
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        dilated_attention(q, k, v, **args)


def test_module_rejects_bad_scale_at_construction():
    with pytest.raises(ValueError, match="softmax_scale"):
        DilatedAttention([8], [1], softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_scale"):
        DilatedAttention([8], [1], softmax_scale="0.25")
    with pytest.raises(TypeError, match="attention_dropout"):
        DilatedAttention([8], [1], attention_dropout="0.1")


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("nq", [16, 12])
def test_outputs_contiguous(impl, dtype, nq):
    if impl == "triton" and dtype == torch.float64:
        pytest.skip("triton: no float64")
    if impl == "triton" and dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("triton: bf16 is refused under the interpreter (test_frontdoor.py)")
    q, _, _ = qkv(2, nq, 16, 2, 2, 16, dtype=dtype, device=DEV)
    _, k, v = qkv(2, 16, 16, 2, 2, 16, dtype=dtype, device=DEV)
    out = dilated_attention(q, k, v, [8], [2], impl=impl)
    assert out.is_contiguous()
    out.view(2, nq, -1)
