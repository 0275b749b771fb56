"""Every bad input gives a clear ValueError/TypeError naming the values; nothing runs silently wrong."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import DilatedAttention, MultiheadDilatedAttention, dilated_attention


def _qkv(b=1, n=16, h=4, hkv=4, d=8, dtype=torch.float32):
    return torch.randn(b, n, h, d, dtype=dtype), torch.randn(b, n, hkv, d, dtype=dtype), torch.randn(b, n, hkv, d, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(segment_lengths=[], dilation_rates=[]), ValueError, "empty"),
        (dict(segment_lengths=[8, 16], dilation_rates=[1]), ValueError, "same length"),
        (dict(segment_lengths=[0], dilation_rates=[1]), ValueError, ">= 1"),
        (dict(segment_lengths=[8], dilation_rates=[-2]), ValueError, ">= 1"),
        (dict(segment_lengths=[2], dilation_rates=[8]), ValueError, "swapped"),
        (dict(segment_lengths=8, dilation_rates=1), TypeError, "sequences"),
        (dict(segment_lengths=[8.5], dilation_rates=[1]), TypeError, "ints"),
        (dict(segment_lengths=[8], dilation_rates=[1], impl="cuda"), ValueError, "impl must be one of"),
        (dict(segment_lengths=[8], dilation_rates=[1], head_assignment="some"), ValueError, "head_assignment"),
        (dict(segment_lengths=[8], dilation_rates=[1], dropout_p=1.0), ValueError, "dropout_p"),
        (dict(segment_lengths=[8], dilation_rates=[1], softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        dilated_attention(q, k, v, **kwargs)


def test_bad_tensors():
    q, k, v = _qkv()
    seg, dil = [8], [2]
    with pytest.raises(ValueError, match="4 dims"):
        dilated_attention(q[0], k[0], v[0], seg, dil)
    with pytest.raises(TypeError, match="share a dtype"):
        dilated_attention(q, k.double(), v, seg, dil)
    with pytest.raises(TypeError, match="floating"):
        dilated_attention(q.int(), k.int(), v.int(), seg, dil)
    with pytest.raises(ValueError, match="same shape"):
        dilated_attention(q, k, v[:, :8], seg, dil)
    with pytest.raises(ValueError, match="batch"):
        dilated_attention(q, torch.cat([k, k]), torch.cat([v, v]), seg, dil)
    with pytest.raises(ValueError, match="head dims"):
        dilated_attention(q, k[..., :4], v[..., :4], seg, dil)
    q6 = torch.randn(1, 16, 6, 8)
    with pytest.raises(ValueError, match=r"nheads \(6\) must be a multiple of nheads_kv \(4\)"):
        dilated_attention(q6, k, v, seg, dil)
    with pytest.raises(ValueError, match="seqlen_q"):
        dilated_attention(torch.randn(1, 20, 4, 8), k, v, seg, dil)
    with pytest.raises(TypeError, match="torch.Tensor"):
        dilated_attention(q.numpy(), k, v, seg, dil)


def test_bad_masks():
    q, k, v = _qkv(b=2)
    with pytest.raises(TypeError, match="torch.bool"):
        dilated_attention(q, k, v, [8], [1], key_padding_mask=torch.zeros(2, 16))
    with pytest.raises(ValueError, match=r"\(batch, seqlen_k\) = \(2, 16\)"):
        dilated_attention(q, k, v, [8], [1], key_padding_mask=torch.zeros(2, 15, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(batch, seqlen_k\)"):
        dilated_attention(q, k, v, [8], [1], key_padding_mask=torch.zeros(16, dtype=torch.bool))


def test_explicit_triton_never_falls_back_silently():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="impl='triton' cannot run here"):
        dilated_attention(q, k, v, [8], [1], impl="triton")


def test_auto_runs_everywhere_and_matches_reference(seed):
    q, k, v = _qkv(dtype=torch.float64)
    out = dilated_attention(q, k, v, [8], [2], impl="auto")
    torch.testing.assert_close(out, dilated_attention(q, k, v, [8], [2], impl="reference"))


def test_module_argument_errors():
    with pytest.raises(ValueError, match="swapped"):
        DilatedAttention([1, 2], [8, 16])  # fkodom's order by mistake
    with pytest.raises(ValueError, match="impl"):
        DilatedAttention([8], [1], impl="fast")
    with pytest.raises(ValueError, match="multiple of num_heads"):
        MultiheadDilatedAttention(30, 4, [8], [1])
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiheadDilatedAttention(32, 4, [8], [1], num_kv_heads=3)
    m = MultiheadDilatedAttention(32, 4, [8], [1])
    with pytest.raises(ValueError, match="batch_first"):
        m(torch.randn(16, 32), torch.randn(16, 32), torch.randn(16, 32))


def test_value_head_dim_must_match_key():
    # k and v of the same batch, length and heads but another head dim: the shape rule names them
    q = k = torch.randn(1, 8, 2, 4)
    v = torch.randn(1, 8, 2, 6)
    for impl in ("reference", "torch"):
        with pytest.raises(ValueError, match="k and v must have the same shape"):
            dilated_attention(q, k, v, [4], [1], impl=impl)
