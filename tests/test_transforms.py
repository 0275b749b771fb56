"""torch.compile over changing sequence lengths (no recompile per length, no warnings from our
code) and torch.func transforms (grad, vmap, per-sample gradients) on impl="torch"."""

from __future__ import annotations

import warnings

import pytest
import torch

from dilated_attention import MultiheadDilatedAttention, dilated_attention

SEG, DIL = [8, 16], [1, 2]


class _CountingBackend:
    """A torch.compile backend that runs the captured graphs eagerly and counts them: one per
    compiled frame, so a recompile for a new length shows as new graphs."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_compile_dynamic_lengths_no_recompile(seed, impl):
    torch._dynamo.reset()
    m = MultiheadDilatedAttention(32, 4, SEG, DIL, num_kv_heads=2, impl=impl)
    backend = _CountingBackend()
    cm = torch.compile(m, backend=backend, dynamic=True)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (40, 57, 100):  # awkward lengths: partial last segments, different per branch
            x = torch.randn(2, n, 32, requires_grad=True)
            out, _ = cm(x, x, x, is_causal=True)
            (g,) = torch.autograd.grad(out.square().sum(), x)
            ref, _ = m(x, x, x, is_causal=True)
            (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
            counts.append(backend.graphs)
    assert counts[0] > 0 and counts[1] == counts[0] and counts[2] == counts[0], counts
    ours = [w for w in caught if "dilated_attention" in (w.filename or "") or "lru_cache" in str(w.message)]
    assert not ours, [str(w.message) for w in ours]


def test_compile_default_settles_after_one_dynamic_recompile(seed):
    """Without dynamic=True, Dynamo recompiles once with dynamic shapes at the second length
    and then reuses that graph: the third length compiles nothing."""
    torch._dynamo.reset()
    m = MultiheadDilatedAttention(32, 4, SEG, DIL, impl="torch")
    backend = _CountingBackend()
    cm = torch.compile(m, backend=backend)
    counts = []
    for n in (40, 57, 100, 33):
        x = torch.randn(1, n, 32)
        cm(x, x, x)
        counts.append(backend.graphs)
    assert counts[2] == counts[1] and counts[3] == counts[1], counts


@pytest.mark.parametrize("causal", [False, True])
def test_func_grad_matches_autograd(seed, causal):
    q = torch.randn(2, 37, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 37, 2, 8, dtype=torch.float64) for _ in range(2))
    kpm = torch.rand(2, 37) < 0.2

    def loss(q, k, v, impl="torch"):
        out = dilated_attention(q, k, v, SEG, DIL, causal=causal, key_padding_mask=kpm, impl=impl)
        return out.square().sum()

    g = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    g_ref = torch.autograd.grad(loss(*xs, impl="reference"), xs)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_func_vmap_and_per_sample_grad(seed):
    """vmap folds into the batch dimension; vmap(grad) gives per-sample gradients."""
    q = torch.randn(3, 2, 29, 4, 8, dtype=torch.float64)  # vmapped dim first
    k = torch.randn(2, 29, 2, 8, dtype=torch.float64)  # shared by every vmapped slice
    v = torch.randn(2, 29, 2, 8, dtype=torch.float64)
    kpm = torch.rand(3, 2, 29) < 0.2

    def f(q, m):
        return dilated_attention(q, k, v, SEG, DIL, causal=True, key_padding_mask=m, impl="torch")

    out = torch.func.vmap(f)(q, kpm)
    ref = torch.stack([dilated_attention(q[i], k, v, SEG, DIL, causal=True, key_padding_mask=kpm[i],
                                         impl="reference") for i in range(3)])
    torch.testing.assert_close(out, ref)
    out_d1 = torch.func.vmap(f, in_dims=(1, 1), out_dims=1)(q.transpose(0, 1), kpm.transpose(0, 1))
    torch.testing.assert_close(out_d1.transpose(0, 1), ref)

    per_sample = torch.func.vmap(torch.func.grad(lambda q, m: f(q, m).square().sum()))(q, kpm)
    for i in range(3):
        qi = q[i].clone().requires_grad_()
        ri = dilated_attention(qi, k, v, SEG, DIL, causal=True, key_padding_mask=kpm[i], impl="reference")
        (gi,) = torch.autograd.grad(ri.square().sum(), qi)
        torch.testing.assert_close(per_sample[i], gi)


def test_double_backward_says_what_to_use(seed):
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    out = dilated_attention(q, q, q, [8], [1], impl="torch")
    (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="impl='reference'"):
        g.sum().backward()
