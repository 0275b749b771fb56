"""The fused rotary kernel (kernels/triton_rotary.py) against the torch code of ``Rotary``, and the
models with it on against the models with it off (flags.set_fused_rotary).

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
at tiny sizes; ``set_fused_rotary(True)`` is what lets the models use it there ("auto" takes it
on CUDA only, and is the default: ``flags.ROTARY_DEFAULT``). The ``cuda`` tests run a realistic
size in bf16.

Tolerances: the kernel and the torch code compute the same float32 products and round once to
the input's dtype, so fp32 and fp16 agree to rounding (an FMA may move the last fp32 bit) and
bf16 to one bf16 ulp (relative 2^-7): Triton's interpreter converts float32 to bfloat16 by
truncation, not round-to-nearest-even as the GPU and torch do.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import flags
from dilated_attention.kernels import triton_rotary
from dilated_attention.models.longnet import LongNetConfig, LongNetLM, Rotary, RotaryTable
from helpers import needs_backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=1e-6, rtol=2**-10),
    torch.bfloat16: dict(atol=1e-6, rtol=2**-7),
}

pytestmark = needs_backend("triton_rotary", "rotary", 64)


@pytest.fixture
def fused_on():
    flags.set_fused_rotary(True)
    yield
    flags.set_fused_rotary(None)


def _torch_path(q, k, table: RotaryTable):
    return (Rotary._rotate_with(q, table.cos_q, table.sin_q),
            Rotary._rotate_with(k, table.cos_k, table.sin_k))  # fmt: skip


def _fused(q, k, table: RotaryTable):
    return triton_rotary.rotary_fused(q, k, table.cos_q, table.sin_q, table.cos_k, table.sin_k)


def _grads(fn, q, k, table, gq, gk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = fn(q, k, table)
    dq, dk = torch.autograd.grad((qo.float() * gq).sum() + (ko.float() * gk).sum(), (q, k))
    return qo, ko, dq, dk


# (B, N, H, Hkv, D, first position): MHA and GQA/MQA, odd N, head dims 16/64/128 and one that is
# not a power of two (48), positions past 10^6
CASES = [
    (2, 7, 4, 4, 16, 0),
    (1, 1, 6, 2, 64, 10**6),
    (2, 257, 4, 1, 16, 10**6 + 3),
    (1, 33, 3, 3, 128, 5),
    (1, 9, 4, 2, 48, 999_983),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}N{}H{}kv{}D{}p{}".format(*c))
def test_kernel_matches_torch_path(seed, dtype, case):
    """Forward and backward (torch.autograd through the torch code) on fresh random inputs."""
    b, n, h, hkv, d, p0 = case
    table = Rotary(d).to(DEV).table(torch.arange(p0, p0 + n, device=DEV), dtype)
    q = torch.randn(b, n, h, d, device=DEV).to(dtype)
    k = torch.randn(b, n, hkv, d, device=DEV).to(dtype)
    gq, gk = torch.randn(b, n, h, d, device=DEV), torch.randn(b, n, hkv, d, device=DEV)
    got = _grads(_fused, q, k, table, gq, gk)
    want = _grads(_torch_path, q, k, table, gq, gk)
    for name, a, w in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        assert a.dtype == w.dtype == dtype and a.shape == w.shape, name
        torch.testing.assert_close(a, w, **TOL[dtype], msg=name)


def test_backward_is_the_transpose(seed):
    """<w, J v> = <J^T w, v> for the kernel's forward J and backward J^T (float32, independent of
    the torch code), and a backward that forgot the transpose (the forward rotation applied to
    the gradient) would fail the comparison above by far more than its tolerance."""
    b, n, h, hkv, d = 2, 11, 4, 2, 32
    table = Rotary(d).to(DEV).table(torch.arange(10**6, 10**6 + n, device=DEV), torch.float32)
    v_q, v_k = torch.randn(b, n, h, d, device=DEV), torch.randn(b, n, hkv, d, device=DEV)
    w_q, w_k = torch.randn(b, n, h, d, device=DEV), torch.randn(b, n, hkv, d, device=DEV)
    jq, jk = _fused(v_q, v_k, table)
    *_, tq, tk = _grads(_fused, v_q, v_k, table, w_q, w_k)
    lhs = (w_q * jq).sum() + (w_k * jk).sum()
    rhs = (tq * v_q).sum() + (tk * v_k).sum()
    torch.testing.assert_close(lhs, rhs, atol=1e-3, rtol=1e-5)
    wrong_q, _ = _fused(w_q, w_k, table)  # J w instead of J^T w
    assert (wrong_q - tq).abs().max() > 1e3 * TOL[torch.float32]["atol"]


def test_second_order_through_the_kernel(seed):
    """The backward is the same Function (inverse rotation): a gradient taken with
    create_graph=True differentiates again, equal to the torch code's."""
    table = Rotary(16).to(DEV).table(torch.arange(3, 12, device=DEV), torch.float32)
    q, k = torch.randn(1, 9, 2, 16, device=DEV), torch.randn(1, 9, 1, 16, device=DEV)
    res = []
    for fn in (_fused, _torch_path):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = fn(qq, kk, table)
        dq, dk = torch.autograd.grad((qo**2).sum() + (ko**3).sum(), (qq, kk), create_graph=True)
        res.append(torch.autograd.grad((dq * dq).sum() + dk.sum(), (qq, kk)))
    for a, w in zip(*res, strict=True):
        torch.testing.assert_close(a, w, atol=1e-4, rtol=1e-5)


def test_strided_inputs_and_gradients(seed):
    """q/k with non-contiguous batch/row/head strides (read in place), one with a strided last
    dim (copied), and a non-contiguous incoming gradient; only q's output used (k gets None)."""
    n, d = 13, 32
    table = Rotary(d).to(DEV).table(torch.arange(n, device=DEV), torch.bfloat16)
    q = torch.randn(2, 3, n, d, device=DEV, dtype=torch.bfloat16).transpose(1, 2)  # (B, N, H, D)
    k = torch.randn(2, n, 2, 2 * d, device=DEV, dtype=torch.bfloat16)[..., ::2]  # last dim strided
    assert not q.is_contiguous() and k.stride(-1) == 2
    gq = torch.randn(3, 2, n, d, device=DEV).permute(1, 2, 0, 3)  # (B, N, H, D), strided
    got = _grads(_fused, q, k, table, gq, torch.zeros(2, n, 2, d, device=DEV))
    want = _grads(_torch_path, q, k, table, gq, torch.zeros(2, n, 2, d, device=DEV))
    for name, a, w in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        torch.testing.assert_close(a, w, **TOL[torch.bfloat16], msg=name)
    qq = q.detach().requires_grad_()
    kk = k.detach().requires_grad_()
    qo, _ = _fused(qq, kk, table)
    (qo.float() * gq).sum().backward()  # k's output unused: its gradient never materialised
    torch.testing.assert_close(qq.grad, want[2], **TOL[torch.bfloat16])
    assert kk.grad is None


def test_rotary_module_routes_to_the_kernel(seed, fused_on, monkeypatch):
    """Rotary.forward: the kernel for fp32 (also with different q and k positions), the torch
    code for float64, xPos and with the switch off; equal results either way."""
    calls = []
    launch = triton_rotary._launch
    monkeypatch.setattr(triton_rotary, "_launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    rot = Rotary(16).to(DEV)
    q, k = torch.randn(2, 5, 4, 16, device=DEV), torch.randn(2, 8, 2, 16, device=DEV)
    pq, pk = torch.arange(3, 8, device=DEV), torch.arange(8, device=DEV)
    got = rot(q, k, pq, pk)
    assert len(calls) == 1
    flags.set_fused_rotary(False)
    want = rot(q, k, pq, pk)
    assert len(calls) == 1
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, **TOL[torch.float32])
    flags.set_fused_rotary(True)
    rot(q.double(), k[:, :5].double(), pq, pq)
    Rotary(16, xpos=True).to(DEV)(q, k[:, :5], pq, pq)
    assert len(calls) == 1


def _lm(**kw):
    kw = dict(dict(impl="torch"), **kw)
    cfg = LongNetConfig(vocab_size=40, dim=32, n_layer=2, n_head=4, ffn_dim=48, segment_lengths=(8, 16),
                        dilation_rates=(1, 2), **kw)  # fmt: skip
    return LongNetLM(cfg).to(DEV)


def _loss_and_grads(model, idx, targets, fused: bool, autocast=None, **fw):
    flags.set_fused_rotary(fused)
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=autocast, enabled=autocast is not None):
            _, loss = model(idx, targets, return_logits=False, **fw)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        flags.set_fused_rotary(None)


@pytest.mark.parametrize(
    "kw, autocast, tol",
    [
        (dict(n_kv_head=2), None, dict(atol=1e-5, rtol=1e-5)),  # fp32: the same math up to FMA
        (dict(checkpoint_activations=True), None, dict(atol=1e-5, rtol=1e-5)),  # recompute
        # bf16 autocast: q/k differ by at most one bf16 ulp (see the module docstring), which the
        # attention and the layers after it carry into the loss and gradients
        (dict(n_kv_head=2), torch.bfloat16, dict(atol=3e-2, rtol=3e-2)),
    ],
    ids=["fp32-gqa", "fp32-checkpoint", "bf16-autocast"],
)
def test_model_fused_equals_unfused(seed, kw, autocast, tol, monkeypatch):
    """LongNetLM with the kernel on and off: the same loss and gradients; the kernel really ran
    (once per layer forward, once per backward, plus the recompute under checkpointing) and the
    rotary table was built once per forward for all layers."""
    model = _lm(**kw).train()
    idx = torch.randint(0, 40, (2, 21), device=DEV)
    targets = torch.randint(0, 40, (2, 21), device=DEV)
    targets[0, :5] = -100
    calls, tables = [], []
    launch, table = triton_rotary._launch, Rotary._table
    monkeypatch.setattr(triton_rotary, "_launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(Rotary, "_table", lambda *a, **k: tables.append(1) or table(*a, **k))
    want = _loss_and_grads(model, idx, targets, False, autocast)
    assert not calls and len(tables) == 1
    got = _loss_and_grads(model, idx, targets, True, autocast)
    per_layer = 3 if kw.get("checkpoint_activations") else 2
    assert len(calls) == per_layer * model.cfg.n_layer and len(tables) == 2
    torch.testing.assert_close(got[0], want[0], **tol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **tol, msg=name)


def test_packed_model_fused_equals_unfused(seed):
    """Packed documents: per-document positions, one shared table, the kernel on and off."""
    model = _lm().train()
    idx = torch.randint(0, 40, (1, 24), device=DEV)
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)
    want = _loss_and_grads(model, idx, idx, False, cu_seqlens=cu)
    got = _loss_and_grads(model, idx, idx, True, cu_seqlens=cu)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=1e-5, rtol=1e-5, msg=name)


def test_generate_fused_equals_unfused(seed):
    """Prefill and decode steps (tensor positions, no host sync) with the kernel on and off."""
    model = _lm(n_kv_head=2).eval()
    idx = torch.randint(0, 40, (2, 9), device=DEV)
    out = []
    for fused in (False, True):
        flags.set_fused_rotary(fused)
        try:
            out.append(model.generate(idx, 5, temperature=0, return_logits=True, decode="eager"))
        finally:
            flags.set_fused_rotary(None)
    assert torch.equal(out[0][0], out[1][0])
    for a, w in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_compiled_model_calls_the_kernel_as_its_op(seed, fused_on, monkeypatch):
    """torch.compile(fullgraph=True) with the switch on: no graph break, the kernel launched
    through its custom op (``dilated_attention::rotary``, forward and backward), and the compiled
    step equals the eager step, which used the kernel through its Function. (Until 2026-11-29
    compiled graphs kept the torch code; tests/test_compile_kernels.py checks the graphs' ops.)"""
    torch._dynamo.reset()
    # impl="reference": the torch path's attention runs outside the graph (compiler.disable),
    # which fullgraph refuses; test_compile_model.py does the same on the CPU
    model = _lm(n_kv_head=2, impl="reference")
    idx = torch.randint(0, 40, (1, 12), device=DEV)
    want = _loss_and_grads(model, idx, idx, True)
    calls = []
    launch = triton_rotary._launch
    monkeypatch.setattr(triton_rotary, "_launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    flags.set_fused_rotary(True)
    model.zero_grad(set_to_none=True)
    _, loss = compiled(idx, idx, return_logits=False)
    loss.backward()
    assert len(calls) == 2 * model.cfg.n_layer, calls  # forward and backward, per layer
    torch.testing.assert_close(loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[1][name], atol=1e-5, rtol=1e-5, msg=name)


# (B, T new rows, H, Hkv, D, capacity, first slot): one decode token, a few (the rows wrap
# around a rolling cache), GQA / MQA, a head dim that is not a power of two
CACHE_CASES = [
    (1, 1, 4, 4, 16, 8, 5),
    (2, 3, 6, 2, 64, 8, 6),
    (2, 5, 4, 1, 48, 7, 4),
    (1, 2, 3, 3, 128, 40, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: "B{}T{}H{}kv{}D{}cap{}s{}".format(*c))
def test_rotary_into_cache_equals_rotate_then_copy(seed, dtype, case):
    """The decode step's one launch: q the same bits as rotary_fused's, and the caches the same
    bits as rotary_fused's k and the raw v written with index_copy_ (every other row untouched),
    on k / v that are strided views of one Linear output, as the model's are."""
    b, t, h, hkv, d, cap, s0 = case
    p0 = 10**6 + 11
    table = Rotary(d).to(DEV).table(torch.arange(p0, p0 + t, device=DEV), dtype)
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, device=DEV).to(dtype)
    q = qkv[..., : h * d].view(b, t, h, d)
    k = qkv[..., h * d : (h + hkv) * d].view(b, t, hkv, d)
    v = qkv[..., (h + hkv) * d :].view(b, t, hkv, d)
    slots = (s0 + torch.arange(t, device=DEV)) % cap
    ck, cv = torch.randn(b, cap, hkv, d, device=DEV).to(dtype), torch.randn(b, cap, hkv, d, device=DEV).to(dtype)
    want_ck, want_cv = ck.clone(), cv.clone()
    qo_want, ko_want = _fused(q, k, table)
    want_ck.index_copy_(1, slots, ko_want)
    want_cv.index_copy_(1, slots, v)
    qo = triton_rotary.rotary_into_cache(q, k, v, table.cos_q, table.sin_q, table.cos_k, table.sin_k, ck, cv, slots)
    assert torch.equal(qo, qo_want) and qo.is_contiguous()
    assert torch.equal(ck, want_ck) and torch.equal(cv, want_cv)


def test_rotary_into_cache_rejects_bad_inputs():
    table = Rotary(16).table(torch.arange(2, device=DEV), torch.float32)
    q, k = torch.randn(1, 2, 4, 16, device=DEV), torch.randn(1, 2, 2, 16, device=DEV)
    ck, cv = torch.zeros(1, 8, 2, 16, device=DEV), torch.zeros(1, 8, 2, 16, device=DEV)
    slots = torch.tensor([3, 4], device=DEV)
    args = (table.cos_q, table.sin_q, table.cos_k, table.sin_k)
    with pytest.raises(ValueError, match="slots must be"):
        triton_rotary.rotary_into_cache(q, k, k, *args, ck, cv, slots.int())
    with pytest.raises(ValueError, match="cache_v must be torch.float32"):
        triton_rotary.rotary_into_cache(q, k, k, *args, ck, cv.half(), slots)
    with pytest.raises(ValueError, match=r"cache_k must be \(B=1, capacity, Hkv=2, D=16\)"):
        triton_rotary.rotary_into_cache(q, k, k, *args, ck[:, :, :1], cv, slots)
    with pytest.raises(ValueError, match="k and v"):
        triton_rotary.rotary_into_cache(q, k, q, *args, ck, cv, slots)


@torch.no_grad()
def test_decode_step_takes_one_launch_for_rotary_and_cache(seed, fused_on, monkeypatch):
    """A decode step of the model calls rotary_into_cache once per layer (no index_copy_ of its
    own); Rotary.rotate_into_cache keeps rotate + index_copy_ when a gradient is wanted (the
    kernel has no autograd), with the same values."""
    from dilated_attention.models import longnet as ln

    calls = []
    real = ln._rotary_into_cache()
    monkeypatch.setattr(ln, "_ROTARY_FUSED", [ln._rotary_fused(), lambda *a: calls.append(1) or real(*a)])
    model = _lm(n_kv_head=2).eval()
    model.setup_cache(1, 16)
    prompt = torch.randint(0, 40, (1, 5), device=DEV)
    model._hidden_last(prompt, 0)
    assert calls == []  # the prefill writes its window with index_copy_
    model._hidden_last(prompt[:, :1], torch.tensor(5, device=DEV))
    assert len(calls) == model.cfg.n_layer
    rot = model.layers[0].attn.rotary
    table = rot.table(torch.tensor([6, 7], device=DEV), torch.float32)
    d = model.cfg.dim // model.cfg.n_head
    q, k, v = (torch.randn(1, 2, hh, d, device=DEV) for hh in (4, 2, 2))
    caches = [torch.zeros(1, 16, 2, d, device=DEV) for _ in range(4)]
    slots = torch.tensor([6, 7], device=DEV)
    want = rot.rotate_into_cache(q, k, v, table, caches[0], caches[1], slots)
    assert len(calls) == model.cfg.n_layer + 1
    with torch.enable_grad():
        got = rot.rotate_into_cache(q.requires_grad_(), k, v, table, caches[2], caches[3], slots)
    assert len(calls) == model.cfg.n_layer + 1 and got.grad_fn is not None
    assert torch.equal(got.detach(), want) and torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4])
def test_cuda_rotary_into_cache_decode_size(seed, t):
    """A decode step's shape on the GPU (32 q / 8 kv heads x 128, bf16, a 32K cache, positions
    past 10^6, the slots wrapping for t = 4): the same bits as rotate + index_copy_."""
    b, h, hkv, d, cap = 2, 32, 8, 128, 32768
    table = Rotary(d).cuda().table(torch.arange(10**6, 10**6 + t, device="cuda"), torch.bfloat16)
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[..., : h * d].view(b, t, h, d)
    k = qkv[..., h * d : (h + hkv) * d].view(b, t, hkv, d)
    v = qkv[..., (h + hkv) * d :].view(b, t, hkv, d)
    slots = (cap - 2 + torch.arange(t, device="cuda")) % cap
    ck0 = torch.randn(b, cap, hkv, d, device="cuda", dtype=torch.bfloat16)
    cv0 = torch.randn_like(ck0)
    want_ck, want_cv = ck0.clone(), cv0.clone()
    qo_want, ko_want = _fused(q, k, table)
    want_ck.index_copy_(1, slots, ko_want)
    want_cv.index_copy_(1, slots, v)
    for _ in range(2):  # the first call through Triton's launch, the second through the direct one
        ck, cv = ck0.clone(), cv0.clone()
        qo = triton_rotary.rotary_into_cache(q, k, v, table.cos_q, table.sin_q, table.cos_k, table.sin_k, ck, cv, slots)
        assert torch.equal(qo, qo_want) and torch.equal(ck, want_ck) and torch.equal(cv, want_cv)


def test_rejects_bad_tables():
    table = Rotary(16).table(torch.arange(4), torch.float32)
    q = torch.randn(1, 5, 2, 16, device=DEV)
    with pytest.raises(ValueError, match=r"cos for q must be \(1, 5, 1, 16\)"):
        triton_rotary.rotary_fused(q, q, table.cos_q.to(DEV), table.sin_q.to(DEV), table.cos_k, table.sin_k)


@pytest.mark.cuda
@pytest.mark.parametrize("hkv", [12, 4])
def test_cuda_realistic_size(seed, hkv, monkeypatch):
    """The LongNet base shapes (B 4, N 8192, 12 heads of 64, bf16), positions from 10^6: kernel
    against the torch code, forward and backward; and the base-width model's training step
    (2 layers, bf16 autocast, the kernel by default on CUDA) against the same step with it off."""
    b, n, h, d = 4, 8192, 12, 64
    table = Rotary(d).cuda().table(torch.arange(10**6, 10**6 + n, device="cuda"), torch.bfloat16)
    qkv = torch.randn(b, n, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)  # a Linear's output
    q = qkv[..., : h * d].view(b, n, h, d)  # views, as the model's (strided rows)
    k = qkv[..., h * d : (h + hkv) * d].view(b, n, hkv, d)
    gq, gk = torch.randn(b, n, h, d, device="cuda"), torch.randn(b, n, hkv, d, device="cuda")
    got = _grads(_fused, q, k, table, gq, gk)
    want = _grads(_torch_path, q, k, table, gq, gk)
    for name, a, w in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        torch.testing.assert_close(a, w, **TOL[torch.bfloat16], msg=name)
    monkeypatch.setenv(flags.ENV_FUSED_ROTARY, "auto")  # what "auto" picks on CUDA: the kernel
    flags.set_fused_rotary(None)
    assert flags.fused_rotary_mode() == "auto"
    flags.set_fused_rotary(None)  # (read again when the env is restored)
    cfg = LongNetConfig.preset("base", n_layer=2, n_kv_head=hkv, vocab_size=512)
    model = LongNetLM(cfg).cuda().train()
    idx = torch.randint(0, 512, (1, 8192), device="cuda")
    want = _loss_and_grads(model, idx, idx, False, torch.bfloat16)
    got = _loss_and_grads(model, idx, idx, True, torch.bfloat16)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    for name in want[1]:
        g, w = got[1][name].float(), want[1][name].float()
        assert (g - w).norm() <= 2e-2 * w.norm() + 1e-6, name
