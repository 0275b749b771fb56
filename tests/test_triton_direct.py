"""The direct launcher (kernels/triton_direct.py): which calls reuse a compiled kernel.

Triton compiles nothing on the CPU, so these tests drive the wrapper with a stand-in kernel that
records what Triton's path and the compiled kernel's launcher were given. The real kernels run
through it in every CUDA test (the Triton training and decode paths launch only through it).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import rel_err

from dilated_attention.kernels.triton_direct import direct


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _FakeJit:
    """Looks like a triton.jit kernel: (X, n, scale, B: constexpr)."""

    def __init__(self):
        self.arg_names = ["X", "n", "scale", "B"]
        self.params = [SimpleNamespace(name=n, is_constexpr=n == "B") for n in self.arg_names]
        self.log, self.compiles = [], 0

    def run(self, *a, **k):  # pragma: no cover - only its presence matters
        raise AssertionError

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.compiles += 1
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)

        return call


def test_second_call_with_same_specialisation_launches_directly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _FakeJit()
    d = direct(k)
    x = torch.zeros(64)
    d[(3,)](x, 32, 0.5, B=16, num_warps=4)
    d[(5, 2)](x, 48, 0.25, B=16, num_warps=4)  # other grid, other values, same specialisation
    assert k.compiles == 1
    assert k.log[-1] == ("direct", (5, 2, 1), (x, 48, 0.25, 16))  # signature order, constexpr too


def test_what_makes_a_new_specialisation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _FakeJit()
    d = direct(k)
    x = torch.zeros(64)
    d[(1,)](x, 32, 0.5, B=16, num_warps=4)
    n = k.compiles
    cases = [
        dict(args=(x, 32, 0.5), kw=dict(B=32, num_warps=4)),  # constexpr value
        dict(args=(x, 32, 0.5), kw=dict(B=16, num_warps=8)),  # launch option
        dict(args=(x, 1, 0.5), kw=dict(B=16, num_warps=4)),  # int == 1
        dict(args=(x, 33, 0.5), kw=dict(B=16, num_warps=4)),  # int not divisible by 16
        dict(args=(x, 2**31, 0.5), kw=dict(B=16, num_warps=4)),  # int64
        dict(args=(x[1:], 32, 0.5), kw=dict(B=16, num_warps=4)),  # misaligned pointer
        dict(args=(x.double(), 32, 0.5), kw=dict(B=16, num_warps=4)),  # dtype
        dict(args=(None, 32, 0.5), kw=dict(B=16, num_warps=4)),  # None
    ]
    for c in cases:
        d[(1,)](*c["args"], **c["kw"])
        assert k.compiles == n + 1, c
        n = k.compiles
        d[(1,)](*c["args"], **c["kw"])  # the same again: reused
        assert k.compiles == n, c
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # another device
    d[(1,)](x, 32, 0.5, B=16, num_warps=4)
    assert k.compiles == n + 1


def test_constexpr_given_positionally_and_defaults_left_to_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _FakeJit()
    d = direct(k)
    x = torch.zeros(64)
    d[(1,)](x, 32, 0.5, 16)
    d[(1,)](x, 32, 0.5, 32)  # positional constexpr keyed by value
    assert k.compiles == 2
    d[(1,)](x, 32, 0.5)  # B left to its default: always Triton's own path
    d[(1,)](x, 32, 0.5)
    assert k.compiles == 4


def test_interpreted_kernels_always_take_tritons_path():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(grid)

    d = direct(Interpreted())
    d[(2,)](1)
    d[(2,)](1)
    assert calls == [(2,), (2,)]


def _misaligned(shape, dtype):
    """A (B, N, H, D) view whose data pointer is 2 elements past a 16-byte boundary and whose
    row strides are no multiple of 16 (last dim contiguous, as the kernels need)."""
    b, n, h, d = shape
    base = torch.randn(b * n * h * (d + 2) + 2, device="cuda", dtype=dtype)
    return base[2:].view(b, n, h, d + 2)[..., :d]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_direct_launch_aligned_then_misaligned(seed, causal):
    """The same kernels called with aligned inputs, then with misaligned views (another
    specialisation), then aligned again: every result equals the reference, and a repeated call
    (launched directly) equals the first (through Triton's path) bit for bit."""
    from dilated_attention import dilated_attention, dilated_attention_with_kvcache

    seg, dil = (64, 128), (1, 2)
    dt = torch.bfloat16
    for make in ("aligned", "misaligned", "aligned"):
        if make == "aligned":
            q, k, v = (torch.randn(1, 300, 4, 64, device="cuda", dtype=dt) for _ in range(3))
        else:
            q, k, v = (_misaligned((1, 300, 4, 64), dt) for _ in range(3))
        assert make == "aligned" or q.data_ptr() % 16 != 0
        ref = dilated_attention(*(x.double() for x in (q, k, v)), seg, dil, causal=causal,
                                impl="reference")
        qg, kg, vg = (x.detach().clone().requires_grad_() if make == "aligned" else x.requires_grad_()
                      for x in (q, k, v))
        outs = []
        for _ in range(2):
            out = dilated_attention(qg, kg, vg, seg, dil, causal=causal, impl="triton")
            grads = torch.autograd.grad(out.float().square().sum(), (qg, kg, vg))
            outs.append((out, *grads))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), make
        assert rel_err(outs[0][0], ref) < 2e-2, make

        # decode: one new row against a cache view of the same kind
        kc, vc = k[:, :-1].detach(), v[:, :-1].detach()
        q1 = q[:, -1:].detach()
        lens = torch.full((1,), kc.shape[1], dtype=torch.int32, device="cuda")
        dref = dilated_attention(q1.double(), kc.double(), vc.double(), seg, dil, causal=True,
                                 impl="reference")
        d1 = dilated_attention_with_kvcache(q1, kc, vc, lens, seg, dil, causal=True, impl="triton")
        d2 = dilated_attention_with_kvcache(q1, kc, vc, lens, seg, dil, causal=True, impl="triton")
        assert torch.equal(d1, d2), make
        assert rel_err(d1, dref) < 2e-2, make
