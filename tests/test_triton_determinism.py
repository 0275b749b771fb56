"""impl="triton" backward is deterministic: two runs on the same inputs give bitwise-equal
dq, dk, dv (and out, lse).

The kernels use no atomics: every dK/dV row is owned by one program per branch, which sums the
query heads that share its kv head itself, dQ likewise, and the branches run one after another
(the Triton kernel module's docstring, "Backward"). This test keeps that true. Without CUDA it runs in
Triton's interpreter at a tiny size (which cannot show scheduling races, only the ordering
logic); the ``cuda`` case runs a real size where concurrent programs would race if any two
wrote one row.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dilated_attention import dilated_attention  # noqa: E402


def _twice(q, k, v, do, seg, dil, causal):
    res = []
    for _ in range(2):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention(*xs, seg, dil, causal=causal, impl="triton", return_lse=True)
        res.append((out, lse, *torch.autograd.grad(out, xs, do)))
    return res


def _assert_bitwise(a, b):
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b, strict=True):
        assert torch.equal(x, y), f"{name} differs between two runs: max |diff| {(x - y).abs().max().item()}"


@pytest.mark.parametrize("causal", [False, True])
def test_backward_bitwise_repeatable_interpreter(seed, causal):
    if torch.cuda.is_available():
        pytest.skip("the cuda test covers this")
    # GQA 4:2 (dK/dV summed over query heads inside a program), 2 branches (accumulation
    # across branches), N not a multiple of w
    q = torch.randn(1, 28, 4, 16)
    k, v = torch.randn(1, 28, 2, 16), torch.randn(1, 28, 2, 16)
    do = torch.randn_like(q)
    a, b = _twice(q, k, v, do, (8, 16), (1, 2), causal)
    _assert_bitwise(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(16, 16), (32, 8), (16, 1)], ids=lambda x: f"{x[0]}x{x[1]}")
def test_backward_bitwise_repeatable_cuda(seed, causal, dtype, heads):
    h, hkv = heads
    n = 16384 + 1000  # not a multiple of any w
    q = torch.randn(1, n, h, 128, device="cuda", dtype=dtype)
    k = torch.randn(1, n, hkv, 128, device="cuda", dtype=dtype)
    v = torch.randn(1, n, hkv, 128, device="cuda", dtype=dtype)
    do = torch.randn_like(q)
    a, b = _twice(q, k, v, do, (2048, 4096, 8192, 16384), (1, 2, 6, 12), causal)
    _assert_bitwise(a, b)
