"""DilatedAttention / MultiheadDilatedAttention: equivalence to the functional API, MAGNETO
details, GQA, state_dict, torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

from dilated_attention import DilatedAttention, MultiheadDilatedAttention, dilated_attention

SEG, DIL = [8, 16], [1, 2]


def test_dilated_attention_module_is_the_function(seed):
    q, k, v = (torch.randn(2, 30, 4, 8, dtype=torch.float64) for _ in range(3))
    kpm = torch.rand(2, 30) < 0.2
    m = DilatedAttention(SEG, DIL, impl="torch")
    out = m(q, k, v, is_causal=True, key_padding_mask=kpm)
    ref = dilated_attention(q, k, v, SEG, DIL, causal=True, key_padding_mask=kpm, impl="reference")
    torch.testing.assert_close(out, ref)
    assert "segment_lengths=[8, 16]" in repr(m)


@pytest.mark.parametrize("impl", ["reference", "torch", "auto"])
def test_decode_is_the_kvcache_call_with_the_module_settings(seed, impl):
    """DilatedAttention.decode: what a model needs to decode against a KV cache, without reading
    the module's fields (branches, scale, head assignment, impl; "reference" decodes on torch)."""
    from dilated_attention import dilated_attention_with_kvcache

    seg, dil = [8, 16], [1, 2]
    m = DilatedAttention(seg, dil, softmax_scale=0.3, head_assignment="split", impl=impl)
    q = torch.randn(2, 1, 4, 8, dtype=torch.float64)
    kc, vc = (torch.randn(2, 40, 2, 8, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([17, 33], dtype=torch.int32)
    want = dilated_attention_with_kvcache(q, kc, vc, lens, seg, dil, causal=True, softmax_scale=0.3,
                                          head_assignment="split", impl="torch" if impl == "reference" else impl)
    torch.testing.assert_close(m.decode(q, kc, vc, lens), want)
    assert DilatedAttention([8, 12, 16], [1, 2, 4]).period == 48


def test_model_asks_its_attention_module():
    """models/longnet.py reads none of DilatedAttention's fields (it calls decode / period)."""
    import ast
    import pathlib

    import dilated_attention.models.longnet as longnet

    fields = {"segment_lengths", "dilation_rates", "softmax_scale", "head_assignment", "impl"}
    bad = [f"line {n.lineno}: .attention.{n.attr}" for n in ast.walk(ast.parse(pathlib.Path(longnet.__file__).read_text()))
           if isinstance(n, ast.Attribute) and n.attr in fields and isinstance(n.value, ast.Attribute)
           and n.value.attr == "attention"]
    assert not bad, bad


def test_attention_dropout_only_in_training(seed):
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    m = DilatedAttention([8], [1], attention_dropout=0.5).eval()
    torch.testing.assert_close(m(q, k, v), m(q, k, v))
    m.train()
    assert not torch.allclose(m(q, k, v), m(q, k, v))


def _mha_by_hand(m, x, causal):
    b, n, e = x.shape
    q = m.q_proj(x).view(b, n, m.num_heads, m.head_dim)
    k = m.k_proj(x).view(b, n, m.num_kv_heads, m.head_dim)
    v = m.v_proj(x).view(b, n, m.num_kv_heads, m.head_dim)
    a = dilated_attention(q, k, v, SEG, DIL, causal=causal, impl="reference").reshape(b, n, e)
    return m.out_proj(torch.nn.functional.layer_norm(a, (e,), m.norm.weight, m.norm.bias, m.norm.eps))


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_matches_by_hand(seed, num_kv_heads, causal):
    m = MultiheadDilatedAttention(32, 4, SEG, DIL, num_kv_heads=num_kv_heads, dtype=torch.float64, impl="torch")
    x = torch.randn(2, 37, 32, dtype=torch.float64, requires_grad=True)
    out, weights = m(x, x, x, is_causal=causal)
    assert weights is None and out.shape == x.shape
    ref = _mha_by_hand(m, x, causal)
    torch.testing.assert_close(out, ref)
    g1 = torch.autograd.grad(out.sum(), [x, *m.parameters()])
    g2 = torch.autograd.grad(ref.sum(), [x, *m.parameters()])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_magneto_init_and_state_dict():
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(256, 8, SEG, DIL, gamma_init=3.0, num_kv_heads=2)
    assert m.k_proj.weight.shape == (64, 256)
    # xavier_normal_: std = gain * sqrt(2 / (fan_in + fan_out))
    std_q = m.q_proj.weight.std().item()
    std_v = m.v_proj.weight.std().item()
    assert abs(std_q - math.sqrt(2 / 512)) < 0.1 * math.sqrt(2 / 512)
    assert abs(std_v - 3.0 * math.sqrt(2 / 320)) < 0.1 * 3.0 * math.sqrt(2 / 320)
    assert (m.q_proj.bias == 0).all()
    keys = set(m.state_dict())
    assert keys == {f"{p}.{t}" for p in ("q_proj", "k_proj", "v_proj", "out_proj", "norm") for t in ("weight", "bias")}
    m2 = MultiheadDilatedAttention(256, 8, SEG, DIL, gamma_init=3.0, num_kv_heads=2)
    m2.load_state_dict(m.state_dict())
    x = torch.randn(1, 20, 256)
    torch.testing.assert_close(m(x, x, x)[0], m2(x, x, x)[0])
    no_ln = MultiheadDilatedAttention(32, 4, SEG, DIL, layer_norm=False, bias=False)
    assert no_ln.norm is None and no_ln.q_proj.bias is None


def test_torch_compile_forward_backward(seed):
    m = MultiheadDilatedAttention(32, 4, SEG, DIL, num_kv_heads=2, impl="torch")
    x = torch.randn(2, 40, 32, requires_grad=True)
    out, _ = m(x, x, x, is_causal=True)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    cm = torch.compile(m)
    out_c, _ = cm(x, x, x, is_causal=True)
    (gx_c,) = torch.autograd.grad(out_c.square().sum(), x)
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_c, gx, rtol=1e-4, atol=1e-4)


# ------------------------------------------------ nn.MultiheadAttention's forward signature
def _mha(**kw):
    return MultiheadDilatedAttention(32, 4, SEG, DIL, dtype=torch.float64, impl="torch", **kw)


def test_forward_takes_multihead_attention_order(seed):
    """mha(x, x, x, key_padding_mask) works as with nn.MultiheadAttention; is_causal is last."""
    m = _mha(num_kv_heads=2)
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    kpm = torch.rand(2, 29) < 0.3
    kpm[:, 0] = False
    pos, _ = m(x, x, x, kpm)
    kw, _ = m(x, x, x, key_padding_mask=kpm)
    torch.testing.assert_close(pos, kw)
    assert not torch.allclose(pos, m(x, x, x)[0])  # the mask is used, not ignored
    causal, none = m(x, x, x, kpm, False, None, True, True)  # all eight, positionally
    assert none is None
    torch.testing.assert_close(causal, m(x, x, x, key_padding_mask=kpm, is_causal=True)[0])
    b, n, e = x.shape
    q = m.q_proj(x).view(b, n, 4, 8)
    k = m.k_proj(x).view(b, n, 2, 8)
    v = m.v_proj(x).view(b, n, 2, 8)
    a = dilated_attention(q, k, v, SEG, DIL, causal=True, key_padding_mask=kpm, impl="reference")
    torch.testing.assert_close(causal, m.out_proj(m.norm(a.reshape(b, n, e))))


def test_batch_first_false_takes_sequence_first(seed):
    torch.manual_seed(seed)
    bf = _mha()
    sf = _mha(batch_first=False)
    sf.load_state_dict(bf.state_dict())
    x = torch.randn(3, 21, 32, dtype=torch.float64)  # (B, N, E)
    mem = torch.randn(3, 40, 32, dtype=torch.float64)  # cross-attention keys, longer than queries
    kpm = torch.rand(3, 40) < 0.2
    for causal in (False, True):
        ref, _ = bf(x, mem, mem, kpm, is_causal=causal)
        out, _ = sf(x.transpose(0, 1), mem.transpose(0, 1), mem.transpose(0, 1), kpm, is_causal=causal)
        assert out.shape == (21, 3, 32)
        torch.testing.assert_close(out.transpose(0, 1), ref)
    assert "batch_first=False" in repr(sf)


def test_causal_attn_mask_means_is_causal(seed):
    m = _mha()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    ref, _ = m(x, x, x, is_causal=True)
    bool_mask = torch.nn.Transformer.generate_square_subsequent_mask(19).isinf()
    float_mask = torch.nn.Transformer.generate_square_subsequent_mask(19, dtype=torch.float64)
    for mask in (bool_mask, float_mask):
        torch.testing.assert_close(m(x, x, x, attn_mask=mask)[0], ref)
        torch.testing.assert_close(m(x, x, x, attn_mask=mask, is_causal=True)[0], ref)


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda m, x: m(x, x, x, need_weights=True), ValueError, "need_weights"),
        (lambda m, x: m(x, x, x, attn_mask=torch.zeros(19, 19, dtype=torch.bool)), ValueError, "attn_mask"),
        (lambda m, x: m(x, x, x, attn_mask=torch.ones(19, 19).tril().bool()), ValueError, "attn_mask"),
        (lambda m, x: m(x, x, x, is_causal=torch.tensor(True)), TypeError, "is_causal must be a bool"),
        (lambda m, x: m(x, x, x, is_causal=1), TypeError, "is_causal must be a bool"),
        (lambda m, x: m(x, x, x, True), TypeError, "key_padding_mask must be a bool tensor.*is_causal by keyword"),
        (lambda m, x: m(x, x, x, torch.zeros(2, 19)), TypeError, "key_padding_mask must be a bool tensor"),
        (lambda m, x: m(x, x, x, torch.zeros(19, 2, dtype=torch.bool)), ValueError, r"\(batch, seqlen_k\) = \(2, 19\)"),
        (lambda m, x: m(x, x[:1], x[:1]), ValueError, "batch 2 but key/value have batch 1"),
        (lambda m, x: m(x, x, x[:, :5]), ValueError, "key and value must have the same"),
        (lambda m, x: m(x, x[:, :5], x[:, :5]), ValueError, "query length 19 > key length 5"),
        (lambda m, x: m(x[..., :16], x, x), ValueError, "query's last dimension is 16.*embed_dim=32"),
        (lambda m, x: m(x, x, x[0]), ValueError, "value must be 3-D"),
    ],
)
def test_forward_errors_are_clear(call, err, match):
    m = _mha()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    with pytest.raises(err, match=match):
        call(m, x)


def _mha_spec(m, query, key, value, causal, seg=(8, 16), dil=(1, 2)):
    """MultiheadDilatedAttention by hand around the independent spec loop (tests/spec_loop.py)."""
    from spec_loop import spec

    b, nq, e = query.shape
    nk = key.shape[1]
    q = m.q_proj(query).view(b, nq, m.num_heads, m.head_dim)
    k = m.k_proj(key).view(b, nk, m.num_kv_heads, m.head_dim)
    v = m.v_proj(value).view(b, nk, m.num_kv_heads, m.head_dim)
    a, _ = spec(q.detach(), k.detach(), v.detach(), seg, dil, causal=causal)
    a = a.reshape(b, nq, e)
    return m.out_proj(torch.nn.functional.layer_norm(a, (e,), m.norm.weight, m.norm.bias, m.norm.eps))


def test_multihead_cross_attention_distinct_key_and_value(seed):
    m = MultiheadDilatedAttention(16, 2, [8, 16], [1, 2], dtype=torch.float64, impl="torch")
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    key, value = torch.randn(2, 20, 16, dtype=torch.float64), torch.randn(2, 20, 16, dtype=torch.float64)
    with torch.no_grad():
        out, _ = m(x, key, value)
        torch.testing.assert_close(out, _mha_spec(m, x, key, value, False))


def test_causal_attn_mask_bottom_right_when_queries_shorter(seed):
    m = MultiheadDilatedAttention(16, 2, [8, 16], [1, 2], dtype=torch.float64, impl="torch")
    x, mem = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 20, 16, dtype=torch.float64)
    nq, nk = 5, 20
    bottom_right = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)  # masked: j > i, i = nk - nq + t
    with torch.no_grad():
        out, _ = m(x, mem, mem, attn_mask=bottom_right)
        torch.testing.assert_close(out, m(x, mem, mem, is_causal=True)[0])
        torch.testing.assert_close(out, _mha_spec(m, x, mem, mem, True))
        with pytest.raises(ValueError, match="attn_mask"):
            m(x, mem, mem, attn_mask=torch.ones(nq, nk, dtype=torch.bool).triu(1))  # top-left: another mask


def test_layer_norm_eps_is_used(seed):
    m = MultiheadDilatedAttention(16, 2, [8, 16], [1, 2], layer_norm_eps=0.5, dtype=torch.float64, impl="torch")
    assert m.norm.eps == 0.5
    x = torch.randn(2, 12, 16, dtype=torch.float64) * 0.1
    with torch.no_grad():
        torch.testing.assert_close(m(x, x, x)[0], _mha_spec(m, x, x, x, False))


def test_module_softmax_scale_is_used(seed):
    from spec_loop import spec

    q, k, v = (torch.randn(1, 20, 2, 8, dtype=torch.float64) for _ in range(3))
    m = DilatedAttention([8, 16], [1, 2], softmax_scale=0.9, impl="torch")
    want, _ = spec(q, k, v, (8, 16), (1, 2), causal=True, scale=0.9)
    torch.testing.assert_close(m(q, k, v, is_causal=True), want)
    # decode with several keys per query (a query at a segment's start sees one key: no scale)
    kc, vc = (torch.randn(1, 40, 2, 8, dtype=torch.float64) for _ in range(2))
    q1 = torch.randn(1, 1, 2, 8, dtype=torch.float64)
    want1, _ = spec(q1, kc[:, :30], vc[:, :30], (8, 16), (1, 2), causal=True, scale=0.9)
    torch.testing.assert_close(m.decode(q1, kc, vc, torch.tensor([30], dtype=torch.int32)), want1)


def test_float_attn_mask_with_a_bias_is_rejected():
    m = MultiheadDilatedAttention(16, 2, [8, 16], [1, 2], dtype=torch.float64, impl="torch")
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(19, dtype=torch.float64)
    mask = mask + torch.tril(torch.full((19, 19), 0.5, dtype=torch.float64))  # a bias below the diagonal
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=mask)
