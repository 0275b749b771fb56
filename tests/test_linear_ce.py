"""The fused LM loss (models/linear_ce.py, ``chunked_cross_entropy(..., fused=True)``,
``LongNetConfig.fused_loss``) against the plain cross-entropy of full logits (float64: to
rounding) and against the checkpointed chunks under bf16 autocast (the same casts: to bf16
rounding of the matmul outputs), forward and backward, with ignored rows and awkward chunk
counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dilated_attention.models import LongNetConfig, LongNetLM
from dilated_attention.models.linear_ce import linear_cross_entropy_sum
from dilated_attention.models.longnet import chunked_cross_entropy


def _data(gen, b=3, n=23, e=16, v=37, dtype=torch.float64, ignore=0.3):
    h = torch.randn(b, n, e, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(v, e, generator=gen, dtype=dtype).requires_grad_()
    t = torch.randint(0, v, (b, n), generator=gen)
    t[torch.rand(b, n, generator=gen) < ignore] = -100
    return h, w, t


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64, None])
def test_fused_equals_plain_float64(seed, reduction, chunk_rows):
    gen = torch.Generator().manual_seed(seed)
    h, w, t = _data(gen)
    t[0, :5] = -100
    got = chunked_cross_entropy(h, w, t, reduction=reduction, chunk_rows=chunk_rows, fused=True)
    g_h, g_w = torch.autograd.grad(got, (h, w))
    want = F.cross_entropy((h @ w.T).flatten(0, 1), t.flatten(), ignore_index=-100, reduction=reduction)
    e_h, e_w = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_h, e_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_w, e_w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("which", ["h", "w"])
def test_only_one_input_needs_grad(seed, which):
    """Only h's or only the weight's gradient asked for: that one is right, the other is not
    computed (None), and an upstream gradient other than 1 scales it."""
    gen = torch.Generator().manual_seed(seed)
    h, w, t = _data(gen)
    if which == "h":
        w = w.detach()
    else:
        h = h.detach()
    x = h if which == "h" else w
    got = 2.5 * linear_cross_entropy_sum(h.flatten(0, 1), w, t.flatten(), chunk_rows=7)
    (g,) = torch.autograd.grad(got, (x,))
    want = 2.5 * F.cross_entropy((h @ w.T).flatten(0, 1), t.flatten(), reduction="sum")
    (e,) = torch.autograd.grad(want, (x,))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_rows", [4, 1000])
def test_fused_equals_checkpointed_chunks_under_bf16_autocast(seed, chunk_rows):
    """bf16 autocast (CPU): the fused loss and the checkpointed chunks cast the same things to
    bf16 (h, the weight, dlogits) and keep the softmax in float32, so they agree to bf16 rounding of
    the matmul outputs; both near the float64 value."""
    gen = torch.Generator().manual_seed(seed)
    h, w, t = _data(gen, b=2, n=40, e=32, v=300, dtype=torch.float32)
    out = {}
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_cross_entropy(h, w, t, chunk_rows=chunk_rows, fused=fused)
        out[fused] = (loss, *torch.autograd.grad(loss, (h, w)))
    for a, b in zip(out[True], out[False]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    exact = F.cross_entropy((h.double() @ w.double().T).flatten(0, 1), t.flatten(), ignore_index=-100)
    torch.testing.assert_close(out[True][0].double(), exact, rtol=2e-2, atol=1e-2)
    assert out[True][1].dtype == torch.float32 and out[True][2].dtype == torch.float32


def test_no_grad_and_no_double_backward(seed):
    gen = torch.Generator().manual_seed(seed)
    h, w, t = _data(gen)
    with torch.no_grad():
        a = chunked_cross_entropy(h, w, t, chunk_rows=5, fused=True)
    b = chunked_cross_entropy(h, w, t, chunk_rows=5, fused=True)
    torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
    (g_h,) = torch.autograd.grad(b, (h,), create_graph=True)
    # the gradient is a constant (no graph): a second derivative raises, never silently zero
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g_h.sum().backward()


@pytest.mark.parametrize("autocast", [False, True])
def test_model_fused_loss_equals_plain(seed, autocast):
    """LongNetLM with ``fused_loss`` True and False: the same loss and the same gradient for
    every parameter (tied embeddings: the head's gradient joins the embedding's)."""
    cfg = LongNetConfig(vocab_size=61, dim=32, n_layer=2, n_head=4, segment_lengths=(8, 16),
                        dilation_rates=(1, 2), impl="reference")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 61, (2, 37), generator=gen)
    tgt = torch.randint(0, 61, (2, 37), generator=gen)
    tgt[:, :4] = -100
    res = {}
    for fused in (False, True):
        torch.manual_seed(seed)
        m = LongNetLM(dataclasses.replace(cfg, fused_loss=fused))
        if not autocast:
            m = m.double()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = m(idx, tgt, return_logits=False)
        loss.backward()
        res[fused] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(res[True][0], res[False][0], **tol)
    for n, g in res[False][1].items():
        torch.testing.assert_close(res[True][1][n], g, **tol, msg=n)
