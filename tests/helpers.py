"""Helpers shared by several test files (import as ``from helpers import ...``; pytest puts the
tests directory on ``sys.path``). Process-group spawning lives in dist_utils.py."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """assert_close with the case name in the message; compares in float64."""
    torch.testing.assert_close(
        got.to(torch.float64), want.to(torch.float64), atol=atol, rtol=rtol,
        msg=lambda m: f"{name}: {m}",
    )


def poisoned_empty(monkeypatch) -> None:
    """torch.empty and torch.empty_like return NaN-filled (float) or 0x55-filled buffers while
    patched: an element a kernel should have written but did not shows up in the result."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.numel():
            t.fill_(0x55)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_like(*a, **kw)))


class DeviceSwitch:
    """The CUDA current device, stood in on the CPU (:func:`device_switch`): ``current`` is what
    ``direct_launch.current_device()`` returns, ``entered`` the device indices
    ``torch.cuda.device(...)`` was entered with, in order; entering one makes it current until
    the block exits (as the real context manager does)."""

    def __init__(self, current: int):
        self.current = current
        self.entered: list[int] = []

    @contextlib.contextmanager
    def device(self, idx):
        idx = idx if isinstance(idx, int) else torch.device(idx).index
        self.entered.append(idx)
        prev, self.current = self.current, idx
        try:
            yield
        finally:
            self.current = prev


def device_switch(monkeypatch, current: int) -> DeviceSwitch:
    """Stand in ``direct_launch.current_device`` and ``torch.cuda.device`` (the device guard's
    two reads, ``kernels/direct_launch.py``) with a :class:`DeviceSwitch` whose current device is
    ``current``."""
    from dilated_attention.kernels import direct_launch

    sw = DeviceSwitch(current)
    monkeypatch.setattr(direct_launch, "current_device", lambda: sw.current)
    monkeypatch.setattr(torch.cuda, "device", sw.device)
    return sw


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``x`` against ``ref``, in float64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def dense_reference(q, k, v, causal, scale=None):
    """(B, N, H, D) dense attention in float64 with GQA; returns out (B,N,H,D), lse (B,H,N)."""
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2).to(torch.float64) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = qt @ kt.transpose(-1, -2) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vt
    return out.transpose(1, 2), lse


def train_args(*argv: str) -> argparse.Namespace:
    """The ``dilated-attention train`` flags parsed from ``argv``."""
    from dilated_attention.train import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p.parse_args(list(argv))


# Which implementations the impl-parametrised tests run here (Triton: compiled on a GPU, its
# interpreter on the CPU; conftest.py sets TRITON_INTERPRET=1 before this module is imported).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _has_triton() -> bool:
    from dilated_attention.api import triton_unavailable_reason

    return triton_unavailable_reason(torch.empty(1, 1, 1, 16, device=DEV, dtype=torch.float32)) is None


HAS_TRITON = _has_triton()
FAST_IMPLS = ["torch"] + (["triton"] if HAS_TRITON else [])
ALL_IMPLS = ["reference", *FAST_IMPLS]


def _interpreting() -> bool:
    from dilated_attention.kernels.select import interpreting

    return interpreting()


# A test's mark: skip unless the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1,
# which conftest.py sets where there is no CUDA). For tests that push CPU tensors through the
# kernels: on a GPU host they are compiled, and a compiled kernel cannot take a CPU tensor.
interpreted = pytest.mark.skipif(
    not _interpreting(), reason="CPU tensors through the kernels: needs TRITON_INTERPRET=1"
)


def qkv(b, nq, nk, h, hkv, d, dtype=torch.float64, device="cpu", requires_grad=False):
    """Random q (b, nq, h, d) and k, v (b, nk, hkv, d)."""
    q = torch.randn(b, nq, h, d, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, device=device, requires_grad=requires_grad)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


def varlen_reference(q, k, v, cu_q, cu_k, seg, dil, do, **kw):
    """The packed-documents oracle (docs/spec.md, "Packed documents (varlen)"): each document
    alone through ``dilated_attention(impl="reference")`` in the inputs' dtype (use float64),
    concatenated. q (total_q, H, D), k/v (total_k, Hkv, D) requiring grad, ``do`` like q;
    returns out (total_q, H, D), lse (H, total_q), (dq, dk, dv) (zeros where unused)."""
    from dilated_attention import dilated_attention

    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    outs, lses = [q[:0] * 0], [q.new_zeros(q.shape[1], 0)]  # no document at all: empty results
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        o, lse = dilated_attention(
            q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], seg, dil, impl="reference",
            return_lse=True, **kw,
        )  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, -1)
    grads = torch.autograd.grad((out * do).sum(), (q, k, v), allow_unused=True)
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v), strict=True))
    return out, lse, grads


def needs_backend(backend: str, what: str, headdim: int):
    """A module's ``pytestmark``: skip unless ``select.backend_reason(backend, DEV, float32,
    headdim)`` says the kernel can run here (CUDA, or Triton's interpreter on the CPU)."""
    import pytest

    from dilated_attention.kernels.select import backend_reason

    reason = backend_reason(backend, DEV, torch.float32, headdim)
    return pytest.mark.skipif(reason is not None, reason=f"the {what} kernel cannot run here: {reason}")
