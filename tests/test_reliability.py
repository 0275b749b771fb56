"""No silent wrong answer: second-order gradients, autocast, empty inputs, cached tensors handed
out, the reference's dropout, strict argument checks, contiguous outputs, extreme inputs.

Triton rows run in Triton's interpreter on the CPU (tiny sizes) and compiled on a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dilated_attention import (  # noqa: E402
    DilatedAttention,
    dilated_attention,
    hilbert_permutation,
)
from dilated_attention.ordering import permute_sequence  # noqa: E402
from dilated_attention.api import triton_unavailable_reason  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_probe = torch.empty(1, 1, 1, 16, device=DEV, dtype=torch.float32)
HAS_TRITON = triton_unavailable_reason(_probe) is None
FAST_IMPLS = ["torch"] + (["triton"] if HAS_TRITON else [])
ALL_IMPLS = ["reference", *FAST_IMPLS]


def _qkv(b, nq, nk, h, hkv, d, dtype=torch.float64, device="cpu", requires_grad=False):
    q = torch.randn(b, nq, h, d, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, device=device, requires_grad=requires_grad)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


# ----------------------------------------------------------------------------- 1. second order
GRADGRAD_CASES = [
    dict(seg=[8], dil=[1], causal=False, hkv=2, mask=True, dropout=0.0),  # the issue's shape
    dict(seg=[4, 8], dil=[1, 2], causal=True, hkv=1, mask=False, dropout=0.0),  # GQA/MQA, causal
    dict(seg=[4, 8], dil=[2, 4], causal=False, hkv=2, mask=True, dropout=0.3),  # dropout
    dict(seg=[6], dil=[3], causal=True, hkv=2, mask=True, dropout=0.0),  # w not dividing N
]


@pytest.mark.parametrize("case", GRADGRAD_CASES)
def test_reference_gradgradcheck(seed, case):
    """impl='reference' is twice differentiable: gradgradcheck in float64 (dropout: a fixed seed
    inside the function, so every re-evaluation draws the same masks)."""
    q, k, v = _qkv(1, 8, 8, 2, case["hkv"], 3, requires_grad=True)
    kpm = torch.rand(1, 8) < 0.3 if case["mask"] else None

    def f(q, k, v):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return dilated_attention(
                q, k, v, case["seg"], case["dil"], causal=case["causal"], key_padding_mask=kpm,
                dropout_p=case["dropout"], impl="reference",
            )

    assert torch.autograd.gradgradcheck(f, (q, k, v), atol=1e-6, rtol=1e-5)


def test_second_order_issue_repro_never_wrong(seed):
    """The issue's repro: impl='torch' with a mask gave |hq| = 35.36 (reference 28.29). Now the
    first-order gradient with create_graph=True is exact and the second order raises a clear error."""
    q, k, v = _qkv(1, 8, 8, 1, 1, 4, requires_grad=True)
    kpm = torch.zeros(1, 8, dtype=torch.bool)

    def grads(impl):
        o = dilated_attention(q, k, v, [8], [1], key_padding_mask=kpm, impl=impl)
        (gq,) = torch.autograd.grad(o.sum() ** 2, q, create_graph=True)
        return gq

    gq_ref = grads("reference")
    (hq_ref,) = torch.autograd.grad(gq_ref.sum(), q)
    gq = grads("torch")
    torch.testing.assert_close(gq, gq_ref)
    with pytest.raises(RuntimeError, match="impl='reference' supports them"):
        torch.autograd.grad(gq.sum(), q)
    assert hq_ref.abs().sum() > 0


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("variant", ["plain", "mask", "causal_gqa", "dropout"])
def test_fast_impls_refuse_second_order(seed, impl, variant):
    if impl == "triton" and variant == "dropout":
        pytest.skip("the triton kernel has no dropout")
    dtype = torch.float64 if impl == "torch" else torch.float32
    hkv = 1 if variant == "causal_gqa" else 2
    q, k, v = _qkv(1, 16, 16, 2, hkv, 16, dtype=dtype, device=DEV, requires_grad=True)
    kw = {}
    if variant == "mask":
        kw["key_padding_mask"] = torch.rand(1, 16, device=DEV) < 0.3
    if variant == "causal_gqa":
        kw["causal"] = True
    if variant == "dropout":
        kw["dropout_p"] = 0.2
    o = dilated_attention(q, k, v, [8], [2], impl=impl, **kw)
    gq, gk, gv = torch.autograd.grad((o * o).sum(), (q, k, v), create_graph=True)
    for g in (gq, gk, gv):
        with pytest.raises(RuntimeError, match=f"impl='{impl}'.*impl='reference' supports them"):
            torch.autograd.grad(g.sum(), (q, k, v), retain_graph=True)


def test_create_graph_first_order_still_exact(seed):
    """A create_graph=True backward (no second differentiation) gives the exact first-order gradient."""
    q, k, v = _qkv(2, 12, 12, 2, 1, 4, requires_grad=True)
    do = torch.randn(2, 12, 2, 4, dtype=torch.float64)
    res = {}
    for impl in ("reference", "torch"):
        o = dilated_attention(q, k, v, [4, 8], [1, 2], causal=True, impl=impl)
        res[impl] = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    for a, b in zip(res["torch"], res["reference"], strict=True):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- 2. autocast
@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("variant", ["plain", "causal", "mask"])
def test_autocast_casts_inputs_like_sdpa(seed, impl, variant):
    """Under autocast(cpu, bf16), float32 inputs give exactly the bf16 call's result in bf16, on
    every path (before: exact float32 without a mask, bf16 math returned as float32 with one)."""
    q, k, v = _qkv(2, 16, 16, 2, 2, 8, dtype=torch.float32, requires_grad=True)
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
    q, k, v = _qkv(1, 8, 8, 2, 2, 4, dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        out = dilated_attention(q, k, v, [8], [1], impl="torch")
    assert out.dtype == torch.float64  # autocast never casts float64
    with pytest.raises(TypeError, match="share a dtype.*autocast"):
        dilated_attention(q.float().bfloat16(), k.float(), v.float(), [8], [1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton unavailable")
def test_autocast_triton(seed):
    dtype_low = torch.bfloat16 if DEV == "cuda" else torch.float16
    q, k, v = _qkv(1, 16, 16, 2, 2, 16, dtype=torch.float32, device=DEV)
    want = dilated_attention(q.to(dtype_low), k.to(dtype_low), v.to(dtype_low), [8], [2], impl="triton")
    with torch.autocast(DEV, dtype_low):
        got = dilated_attention(q, k, v, [8], [2], impl="triton")
    assert got.dtype == dtype_low
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ----------------------------------------------------------------------------- 3. empty inputs
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
    q, k, v = _qkv(b, nq, nk, 2, 1, 4, requires_grad=True)
    kw = dict(extra)
    if kw.pop("key_padding_mask", None):
        kw["key_padding_mask"] = torch.zeros(b, nk, dtype=torch.bool)
    out, lse = dilated_attention(q, k, v, *branches, impl=impl, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (b, 2, nq)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and (g == 0).all()


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_headdim_zero_like_sdpa(impl):
    """headdim 0: SDPA returns an empty output; here too, with lse = log(number of keys)."""
    q = torch.randn(1, 8, 2, 0)
    out, lse = dilated_attention(q, q, q, [4], [1], causal=True, impl=impl, return_lse=True)
    assert out.shape == q.shape
    want = torch.log(torch.tensor([1, 2, 3, 4, 1, 2, 3, 4], dtype=torch.float32))
    torch.testing.assert_close(lse, want.expand(1, 2, 8))


# ----------------------------------------------------------------------------- 4. hilbert cache
def test_hilbert_permutation_returns_copies():
    perm, inv = hilbert_permutation(4, 4)
    x = torch.arange(16.0).view(1, 16, 1)
    before = permute_sequence(x, (4, 4))
    perm.zero_()
    inv.zero_()
    perm2, inv2 = hilbert_permutation(4, 4)
    assert sorted(perm2.tolist()) == list(range(16))
    assert torch.equal(inv2[perm2], torch.arange(16))
    assert torch.equal(permute_sequence(x, (4, 4)), before)


# ----------------------------------------------------------------------------- 5. dropout law
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


# ----------------------------------------------------------------------------- 6. strict checks
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
    q, k, v = _qkv(1, 16, 16, 2, 2, 4, dtype=torch.float32)
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
    q, _, _ = _qkv(2, nq, 16, 2, 2, 16, dtype=dtype, device=DEV)
    _, k, v = _qkv(2, 16, 16, 2, 2, 16, dtype=dtype, device=DEV)
    out = dilated_attention(q, k, v, [8], [2], impl=impl)
    assert out.is_contiguous()
    out.view(2, nq, -1)


# ----------------------------------------------------------------------------- extreme inputs
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
    q, k, v = _qkv(2, n, n, 2, 1, d, dtype=torch.float32, device=device)
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
