"""The Gluon backward (kernels/gluon_bwd.py, gluon_bwd_kernel.py): when it runs, and that it is exact.

CPU: the switch (``flags.set_gluon_backward``, on by default) and the gate. CUDA (sm_90 with
Triton's Gluon): impl="triton" with the Gluon backward on (and the Gluon forward, the default)
against the float64 reference, judged as tests/test_gluon_fwd.py judges the forward: error <=
2x the error of the Triton path (both Gluon switches off) + 1e-3; bitwise repeatable; a broadcast
dO; what it refuses (split heads, a mask, the float32-accumulator budget) runs the Triton
backward; a failing launch falls back with a warning.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from gluon_cases import CASES, err, needs_gluon, qkv, run

from dilated_attention import call_cache, dilated_attention, flags
from dilated_attention.kernels import gluon_bwd, gluon_fwd
from dilated_attention.kernels import triton_launch as L


@pytest.fixture
def switches_reset():
    yield
    flags.set_gluon_forward(None)
    flags.set_gluon_backward(None)


@pytest.fixture(autouse=True)
def small_calls_too(monkeypatch):
    # the cases are small (N <= 8192, <= 8 heads): below gluon_fwd.MIN_ROWS, which keeps small
    # calls on the Triton kernels for their host time; the kernels' exactness does not depend on it
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)

def test_switch_on_by_default_and_environment(monkeypatch, switches_reset):
    monkeypatch.delenv(flags.ENV_GLUON_BWD, raising=False)
    flags.set_gluon_backward(None)
    assert flags.gluon_backward_enabled() is True  # on since its CUDA tests passed (H200)
    monkeypatch.setenv(flags.ENV_GLUON_BWD, "0")
    flags.set_gluon_backward(None)
    assert flags.gluon_backward_enabled() is False
    monkeypatch.setenv(flags.ENV_GLUON_BWD, "1")
    flags.set_gluon_backward(None)
    assert flags.gluon_backward_enabled() is True
    flags.set_gluon_backward(False)
    assert flags.gluon_backward_enabled() is False
    with pytest.raises(TypeError, match="set_gluon_backward"):
        flags.set_gluon_backward(1)


def test_problem_on_the_cpu_and_for_split_heads():
    q, k, v = qkv()
    why = gluon_bwd.problem(q, k, v, False, [(64, 1, 0, 4)], 4)
    assert why is not None and ("interpreter" in why or "CUDA" in why), why


def test_cpu_backward_never_launches_gluon(seed, monkeypatch, switches_reset):
    called = []
    monkeypatch.setattr(gluon_bwd, "launch_branch", lambda *a, **kw: called.append(1))
    flags.set_gluon_backward(True)
    q, k, v = (t.float().requires_grad_() for t in qkv())
    out = dilated_attention(q, k, v, [64, 128], [1, 2], impl="triton")
    out.sum().backward()
    assert q.grad is not None and not called


def test_lpad_is_the_kernels_tile():
    mod = gluon_bwd.kernel_module()
    if mod is None:
        pytest.skip(f"Gluon does not import here: {gluon_bwd._import_error}")
    assert gluon_bwd.LPAD == mod.LPAD == mod.BLK


def test_stages_fit_shared_memory():
    # dK/dV: K + V halves (2 x 2 x 64 x D) + STAGES x (q + dO 64 x D, lse + delta 64 floats);
    # dQ: Q + dO halves (4 x 64 x D) + STAGES x (K + V of BN x D); 2-byte elements, <= 227 KB
    for d in (64, 128):
        kv = 2 * (4 * 64 * d + gluon_bwd.kv_stages(d) * 2 * 64 * d) + gluon_bwd.kv_stages(d) * 512
        dq = 2 * (4 * 64 * d + gluon_bwd.DQ_STAGES * 2 * gluon_bwd.dq_bn(d) * d)
        assert max(kv, dq) <= 227 * 1024, (d, kv, dq)


def _emulated_launch(q, k, v, dout, lse2, delta2, dq, dk, dv, w, r, causal, scale, add=True):
    """gluon_bwd.launch_branch with the kernels replaced by the float64 emulation of their index
    math and schedule (benchmarks/gluon_dilated_bwd.py --emulate)."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gluon_dilated_bwd as emu

    args = [t.double() for t in (q, k, v, dout, lse2, delta2)]
    ek, ev = emu.emulate_dkdv(*args, w, r, causal, scale)
    eq = emu.emulate_dq(*args, w, r, causal, scale)
    for acc, e in ((dq, eq), (dk, ek), (dv, ev)):
        if add:
            acc += e.float()
        else:
            acc.copy_(e.float())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seg,dil", [([32, 64], [1, 2]), ([64, 128], [2, 4])], ids=["r1-first", "r2-first"])
def test_host_path_with_emulated_kernels(seed, monkeypatch, causal, seg, dil):
    """gluon_bwd.backward on the CPU (delta from the library's delta kernel in the interpreter,
    the block-major prep, store-or-add per branch, the final cast) with the kernels emulated:
    the gradients of the float64 reference."""
    from dilated_attention import reference

    monkeypatch.setattr(gluon_bwd, "launch_branch", _emulated_launch)
    q, k, v = (t.double() for t in qkv(1, 256, 4, 2, 16, torch.float32))
    do = torch.randn_like(q)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    hr = [(0, 4)] * len(seg)
    out, lse = reference.dilated_attention_reference(*xs, seg, dil, causal=causal)
    want = torch.autograd.grad(out, xs, do)
    xs32 = [t.float() for t in (q, k, v)]
    delta = L._delta(out.detach().float(), do.float())
    got = gluon_bwd.backward(do.float(), *xs32, delta, lse.detach().float(), L.branch_list(seg, dil, hr),
                             causal, 16**-0.5)  # fmt: skip
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max().item() < 1e-4, f"d{name}"


def test_out_of_memory_runs_the_triton_backward(seed, monkeypatch, switches_reset):
    """An out-of-memory error in the Gluon backward (its float32 accumulators) gives None for
    that call (the Triton backward runs it), records no failure (a later, smaller call may fit)
    and warns once."""
    q, k, v = qkv(1, 256, 4, 2, 16, torch.float32)
    out, lse = L.forward(q, k, v, None, [64, 128], [1, 2], False, 0.25, [(0, 4)] * 2)
    do = torch.randn_like(q)
    flags.set_gluon_backward(True)
    monkeypatch.setattr(gluon_bwd, "problem", lambda *a: None)  # as if on a Hopper GPU
    monkeypatch.setattr(L.direct_launch, "current_device", lambda: L.direct_launch.tensor_device(q))
    monkeypatch.setattr(gluon_bwd, "_failed", {})
    monkeypatch.setattr(gluon_bwd, "_oom_warned", False)

    def oom(*a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(gluon_bwd, "backward", oom)
    args = (None, out, lse, [64, 128], [1, 2], False, 0.25, [(0, 4)] * 2)
    with pytest.warns(RuntimeWarning, match="did not fit"):
        assert L.gluon_backward(do, q, k, v, *args) is None
    assert gluon_bwd._failed == {}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.gluon_backward(do, q, k, v, *args) is None  # no second warning
    got = L.backward(do, q, k, v, *args)  # the Triton backward
    flags.set_gluon_backward(False)
    want = L.backward(do, q, k, v, *args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bsz,nh,n,w,r", [(1, 4, 256, 64, 1), (2, 3, 384, 128, 4), (1, 5, 600, 300, 3),
                                          (1, 2, 1024, 1024, 2)])  # fmt: skip
def test_block_rows_kernel_equals_prep_rows(seed, bsz, nh, n, w, r):
    """The one-launch block-major rows (Triton kernel; the interpreter on the CPU) equal the
    torch prep_rows bit for bit: the gather per head residue, x LOG2E, -inf -> +inf (rows no
    query of a causal block reached), padding to LPAD (L = 300 // 3 = 100 and 512: not
    multiples of 128), strided lse / delta views."""
    from helpers import DEV, HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("no Triton to run the kernel")
    lse = torch.randn(bsz, nh, 2 * n, device=DEV)[..., ::2] * 3  # a strided view
    lse[..., ::7] = float("-inf")
    delta = torch.randn(bsz, n, nh, device=DEV).transpose(1, 2)
    delta[..., ::5] = float("-inf")  # prep_rows maps it as it maps lse
    got = gluon_bwd.block_rows(lse, delta, w, r)
    want = (gluon_bwd.prep_rows(lse, w, r, float("inf"), gluon_bwd.LOG2E),
            gluon_bwd.prep_rows(delta, w, r, 0.0))  # fmt: skip
    for g, e in zip(got, want, strict=True):
        assert g.shape == e.shape and g.dtype == torch.float32
        assert torch.equal(g, e)


# --------------------------------------------------------------------------------- CUDA


def _spy(monkeypatch):
    calls = []
    real = gluon_bwd.launch_branch

    def spy(*a, **kw):
        calls.append(a[9:11])  # (w, r)
        return real(*a, **kw)

    monkeypatch.setattr(gluon_bwd, "launch_branch", spy)
    return calls


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("case", [c for c in CASES if c[7] == "all"],
                         ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}/{c[3]}x{c[4]}-{c[6]}")  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_backward_vs_reference(seed, monkeypatch, switches_reset, case, causal, dtype):
    b, n, h, hkv, d, seg, dil, _ = case
    q, k, v = qkv(b, n, h, hkv, d, torch.float64, "cuda")
    do = torch.randn_like(q)
    ref = run(q, k, v, do, seg, dil, torch.float64, impl="reference", causal=causal)
    flags.set_gluon_forward(False)
    flags.set_gluon_backward(False)
    call_cache.clear()
    base = run(q, k, v, do, seg, dil, dtype, impl="triton", causal=causal)
    flags.set_gluon_forward(None)
    flags.set_gluon_backward(True)
    calls = _spy(monkeypatch)
    got = run(q, k, v, do, seg, dil, dtype, impl="triton", causal=causal)
    assert len(calls) == len(seg), "the Gluon backward did not run every branch"
    again = run(q, k, v, do, seg, dil, dtype, impl="triton", causal=causal)
    for name, a, bb, r, a2 in zip("qkv", got[2], base[2], ref[2], again[2], strict=True):
        assert a.dtype == dtype
        ea, eb = err(a, r), err(bb, r)
        assert ea <= 2 * eb + 1e-3, f"d{name}: Gluon err {ea:.3g} > 2 x Triton err {eb:.3g} + 1e-3"
        assert torch.equal(a, a2), f"d{name}: not bitwise repeatable"


@needs_gluon
@pytest.mark.cuda
def test_gluon_backward_broadcast_dout_and_refusals(seed, monkeypatch, switches_reset):
    flags.set_gluon_backward(True)
    seg, dil = [1024, 4096], [1, 4]
    q, k, v = (t.requires_grad_() for t in qkv(1, 4096, 4, 2, 128, torch.bfloat16, "cuda"))
    calls = _spy(monkeypatch)
    out = dilated_attention(q, k, v, seg, dil, impl="triton")
    g_gluon = torch.autograd.grad(out.sum(), (q, k, v))  # a broadcast (stride 0) dO
    assert len(calls) == 2
    flags.set_gluon_backward(False)
    out = dilated_attention(q, k, v, seg, dil, impl="triton")
    g_triton = torch.autograd.grad(out.sum(), (q, k, v))
    for a, bb in zip(g_gluon, g_triton, strict=True):
        assert (a.float() - bb.float()).abs().max().item() < 3e-2
    flags.set_gluon_backward(True)
    calls.clear()
    out = dilated_attention(q, k, v, seg, dil, impl="triton", head_assignment="split")
    torch.autograd.grad(out.sum(), (q, k, v))
    kpm = torch.zeros(1, 4096, dtype=torch.bool, device="cuda")
    out = dilated_attention(q, k, v, seg, dil, impl="triton", key_padding_mask=kpm)
    torch.autograd.grad(out.sum(), (q, k, v))
    monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", 0)
    out = dilated_attention(q, k, v, seg, dil, impl="triton")
    torch.autograd.grad(out.sum(), (q, k, v))
    assert not calls  # split heads, a mask, the float32 budget: the Triton backward


@needs_gluon
@pytest.mark.cuda
def test_gluon_backward_failure_falls_back_with_a_warning(seed, monkeypatch, switches_reset):
    q, k, v = qkv(1, 4096, 4, 4, 64, torch.float16, "cuda")
    do = torch.randn_like(q)
    out, lse = L.forward(q, k, v, None, [1024, 4096], [1, 4], True, 0.125, [(0, 4)] * 2)
    args = (None, out, lse, [1024, 4096], [1, 4], True, 0.125, [(0, 4)] * 2)
    flags.set_gluon_backward(False)
    want = L.backward(do, q, k, v, *args)
    flags.set_gluon_backward(True)
    monkeypatch.setattr(gluon_bwd, "_failed", {})

    def boom(*a, **kw):
        raise RuntimeError("out of resources (test)")

    monkeypatch.setattr(gluon_bwd, "launch_branch", boom)
    with pytest.warns(RuntimeWarning, match="Gluon backward failed"):
        got = L.backward(do, q, k, v, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@needs_gluon
@pytest.mark.cuda
def test_gluon_training_call_does_not_synchronise(seed, monkeypatch, switches_reset):
    """A training call through the Gluon forward and backward (descriptors, the rows kernel,
    the accumulators and their casts) makes no host synchronisation (issue 23 item 3), and both
    Gluon paths ran."""
    calls = _spy(monkeypatch)
    fwd_calls = []
    real_fwd = gluon_fwd.launch_branch
    monkeypatch.setattr(gluon_fwd, "launch_branch", lambda *a, **kw: fwd_calls.append(1) or real_fwd(*a, **kw))
    q, k, v = (t.requires_grad_() for t in qkv(1, 4096, 4, 2, 128, torch.bfloat16, "cuda"))
    seg, dil = [1024, 2048, 4096], [1, 2, 4]

    def step():
        out = dilated_attention(q, k, v, seg, dil, causal=True, impl="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    step()  # first call: compilation and one-time probes may synchronise
    torch.cuda.synchronize()
    calls.clear()
    fwd_calls.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert fwd_calls and calls, "the Gluon forward / backward did not run"
