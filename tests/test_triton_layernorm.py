"""The Triton LayerNorm (kernels/triton_layernorm.py) against ``F.layer_norm`` in float64, and the
LongNet models with it on against the models with it off (flags.set_triton_layernorm).

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
at tiny sizes; ``set_triton_layernorm(True)`` is what lets the models use them, and only under a
bf16/fp16 autocast (CPU autocast here). The ``cuda`` test runs the model's sizes in bf16.

Tolerances. The reference is ``F.layer_norm`` on the exactly upcast inputs in float64 (the
gradient from the same dy, upcast), so the kernel's error is its float32 arithmetic (~1e-7
relative, a few ulps after the row sums) plus, for a bf16 result, its one rounding: at most one
bf16 ulp, i.e. 2^-7 relative (on a GPU round-to-nearest gives half that; Triton's interpreter
converts float32 to bfloat16 by truncation). Parameter gradients are sums over the rows in
float32: 1e-5 relative plus an absolute 1e-5 per row.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dilated_attention import flags
from dilated_attention.kernels import triton_layernorm as tln
from dilated_attention.models.longnet import AutocastLayerNorm, LongNetConfig, LongNetEncoder, LongNetLM
from helpers import needs_backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_REL = 2**-7  # one bf16 ulp, relative
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=BF16_REL),
       torch.float16: dict(atol=1e-5, rtol=2**-10)}

pytestmark = needs_backend("triton_layernorm", "LayerNorm", 64)


@pytest.fixture
def ln_on():
    flags.set_triton_layernorm(True)
    yield
    flags.set_triton_layernorm(None)


@pytest.fixture
def launches(monkeypatch):
    """The forward and backward launches of the kernels, counted."""
    seen = {"fwd": 0, "bwd": 0}
    fwd, bwd = tln._forward, tln._backward

    def count_fwd(*a, **k):
        seen["fwd"] += 1
        return fwd(*a, **k)

    def count_bwd(*a, **k):
        seen["bwd"] += 1
        return bwd(*a, **k)

    monkeypatch.setattr(tln, "_forward", count_fwd)
    monkeypatch.setattr(tln, "_backward", count_bwd)
    return seen


def _inputs(m, n, xdtype, bias, shape=None):
    """x with a mean away from 0 (a backward that forgot the mean would show), a row of
    variance near eps (one that forgot eps would show) and a constant row (variance 0: y = bias,
    rstd = eps^-1/2)."""
    x = torch.randn(m, n, device=DEV) * 3 + 1.5
    if m > 2:
        x[1] = torch.randn(n, device=DEV) * 3e-3 + 0.01  # variance ~1e-5, eps's size
        x[2] = -0.75
    x = x.reshape(shape or (m, n)).to(xdtype)
    w = torch.randn(n, device=DEV) * 0.5 + 1
    b = torch.randn(n, device=DEV) if bias else None
    return x, w, b


def _reference(x, w, b, eps, dy):
    """F.layer_norm in float64 on the exactly upcast inputs, and its gradients from dy."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    y = F.layer_norm(xd, (x.shape[-1],), wd, bd, eps)
    grads = torch.autograd.grad(y, [t for t in (xd, wd, bd) if t is not None], dy.double())
    return (y.detach(), *grads)


def _kernel(x, w, b, eps, out_dtype, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = tln.layer_norm(x, w, b, eps, out_dtype)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    return (y.detach(), *grads)


def _close_rows(got, want, dtype, name):
    """|got - want| <= rtol |want| + 1e-6 (the row's largest |want|): the float32 error of a row
    is relative to its scale (x - mean cancels, and so do dx's three terms), plus for a bf16
    result its rounding (rtol one ulp)."""
    g, w = got.double().reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    bound = TOL[dtype]["rtol"] * w.abs() + 1e-6 * w.abs().amax(-1, keepdim=True) + 1e-7
    bad = (g - w).abs() > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, worst {((g - w).abs() - bound).max().item():.3g}"


def _check(got, want, dtypes, m):
    names = ("y", "dx", "dweight", "dbias")
    for name, g, w, dt in zip(names, got, want, dtypes, strict=False):
        assert g.dtype == dt and g.shape == w.shape, (name, g.dtype, dt)
        if name in ("y", "dx"):
            _close_rows(g, w, dt, name)
        else:  # sums over m rows in float32
            torch.testing.assert_close(g.double(), w, atol=1e-5 * m, rtol=1e-5, msg=name)


# (M rows, N): N not a power of two, one row, one column, several backward programs with a
# ragged last block (37 rows over 8 programs of 5), a leading batch shape
CASES = [(37, 100), (1, 64), (5, 1), (64, 48), (12, 257)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["out32", "out16"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["x32", "x16"])
@pytest.mark.parametrize("m,n", CASES, ids=lambda v: str(v))
def test_kernel_matches_float64_layer_norm(seed, m, n, xdtype, out_dtype, bias):
    """Forward and backward on fresh random inputs against F.layer_norm in float64."""
    eps = 1e-5
    x, w, b = _inputs(m, n, xdtype, bias)
    dy = torch.randn(m, n, device=DEV).to(out_dtype)
    got = _kernel(x, w, b, eps, out_dtype, dy)
    want = _reference(x, w, b, eps, dy)
    _check(got, want, (out_dtype, xdtype, torch.float32, torch.float32), m)


def test_fp16(seed):
    """fp16 input and output (an fp16 autocast's sub-LN), one shape."""
    x, w, b = _inputs(13, 72, torch.float16, True)
    dy = torch.randn(13, 72, device=DEV).half()
    got = _kernel(x, w, b, 1e-5, torch.float16, dy)
    want = _reference(x, w, b, 1e-5, dy)
    _check(got, want, (torch.float16, torch.float16, torch.float32, torch.float32), 13)


def test_backward_programs_and_determinism(seed):
    """Every split of the rows over the backward's programs gives the same gradients (each
    program's partial sums, the last one's ragged block included), and one split gives the same
    bits on every run; a (B, T, N) input and a strided (non-contiguous) dy."""
    m, n, eps = 23, 40, 1e-5
    x, w, b = _inputs(m, n, torch.bfloat16, True, shape=(1, m, n))
    dy = torch.randn(1, n, m, device=DEV).transpose(1, 2)  # (1, M, N), strided
    y, mean, rstd = tln._forward(x, w, b, eps, torch.float32)
    want = _reference(x, w, b, eps, dy)
    torch.testing.assert_close(y.double(), want[0], **TOL[torch.float32])
    for programs in (1, 2, 5, 22, 23, 64):
        got = tln._backward(dy, x, w, b, mean, rstd, programs=programs)
        _check((y, *got), want, (torch.float32, torch.bfloat16, torch.float32, torch.float32), m)
    first = tln._backward(dy, x, w, b, mean, rstd, programs=5)
    again = tln._backward(dy, x, w, b, mean, rstd, programs=5)
    for a, c in zip(first, again, strict=True):
        assert torch.equal(a, c)


def test_parameter_dtypes_and_empty_input(seed):
    """bf16 parameters: the gradients in their dtype (summed in float32, rounded once); no rows:
    empty outputs and zero parameter gradients."""
    x, w, b = _inputs(9, 24, torch.float32, True)
    w16, b16 = w.bfloat16(), b.bfloat16()
    dy = torch.randn(9, 24, device=DEV).bfloat16()
    got = _kernel(x, w16, b16, 1e-5, torch.bfloat16, dy)
    want = _reference(x, w16, b16, 1e-5, dy)
    _check(got, want, (torch.bfloat16, torch.float32), 9)
    for g, r in zip(got[2:], want[2:], strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=BF16_REL)
    e = torch.empty(2, 0, 24, device=DEV, requires_grad=True)
    ww = w.detach().requires_grad_()
    y = tln.layer_norm(e, ww, None, 1e-5, torch.bfloat16)
    assert y.shape == e.shape and y.dtype == torch.bfloat16
    dx, dw = torch.autograd.grad(y, (e, ww), torch.empty(2, 0, 24, dtype=torch.bfloat16, device=DEV))
    assert dx.shape == e.shape and torch.equal(dw, torch.zeros_like(w))


def test_rejects_bad_shapes():
    x = torch.randn(3, 8, device=DEV)
    with pytest.raises(ValueError, match=r"weight \(N,\)"):
        tln.layer_norm(x, torch.ones(7, device=DEV), None, 1e-5)
    with pytest.raises(ValueError, match=r"weight \(N,\)"):
        tln.layer_norm(x, torch.ones(8, device=DEV), torch.ones(4, device=DEV), 1e-5)


def test_unavailable_reasons():
    assert "dtype torch.float64" in tln.unavailable_reason(torch.empty(0, 8, dtype=torch.float64, device=DEV), True)
    assert "normalized dim" in tln.unavailable_reason(torch.empty(0, tln.MAX_N + 1, device=DEV), True)
    if DEV == "cpu":
        assert "TRITON_INTERPRET" in tln.unavailable_reason(torch.empty(0, 8), False)


# ----------------------------------------------------------------------------- the module


def test_module_routes_only_under_low_precision_autocast(seed, ln_on, launches):
    """AutocastLayerNorm: the kernel (output in the autocast dtype) under a bf16 autocast; with
    the switch off, without autocast, for float64 and with autocast_output False it is
    nn.LayerNorm's result itself; state_dict as nn.LayerNorm's."""
    ln = AutocastLayerNorm(20).to(DEV)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    plain = torch.nn.LayerNorm(20).to(DEV)
    plain.load_state_dict(ln.state_dict())
    assert ln.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 5, 20, device=DEV)
    assert torch.equal(ln(x), plain(x)) and launches["fwd"] == 0  # no autocast
    with torch.autocast(DEV, dtype=torch.bfloat16):
        y = ln(x)
        assert y.dtype == torch.bfloat16 and launches["fwd"] == 1
        torch.testing.assert_close(y.float(), plain(x).float(), atol=1e-5, rtol=BF16_REL)
        ln64, plain64 = copy.deepcopy(ln).double(), copy.deepcopy(plain).double()
        assert torch.equal(ln64(x.double()), plain64(x.double()))  # float64: autocast leaves it alone
        flags.set_triton_layernorm(False)
        assert torch.equal(ln(x), plain(x))
        flags.set_triton_layernorm(True)
        ln.autocast_output = False
        assert torch.equal(ln(x), plain(x))
    assert launches["fwd"] == 1


def _lm(**kw):
    cfg = LongNetConfig.preset("tiny", **{"impl": "torch", "n_layer": 2, **kw})
    return LongNetLM(cfg).to(DEV)


def _loss_and_grads(model, idx, targets, on: bool, dtype=torch.bfloat16):
    flags.set_triton_layernorm(on)
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=dtype, enabled=dtype is not None):
            _, loss = model(idx, targets, return_logits=False)
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}
    finally:
        flags.set_triton_layernorm(None)


@pytest.mark.parametrize("kw", [{}, dict(checkpoint_activations=True, n_kv_head=2), dict(fused_loss=True)],
                         ids=["plain", "ckpt-gqa", "fused-loss"])  # fmt: skip
def test_model_on_equals_off_under_bf16_autocast(seed, kw, launches):
    """LongNetLM under CPU bf16 autocast (TRITON_INTERPRET=1), the switch on against off: the
    same loss and parameter gradients up to bf16 noise, and the kernels really ran (four
    LayerNorms a layer and the final one; again in the recompute under checkpointing).

    Tolerance: the two runs differ only in bf16 roundings (the kernel's one rounding of a
    LayerNorm output, truncating in the interpreter, against torch's round-to-nearest of the same
    float32 value; q, k and v's gradients added in bf16 before the LN backward), which the bf16
    matmuls after them carry on. So the difference is of the size of autocast's own bf16 noise,
    measured here as each gradient's distance from the float32 run (no autocast): on 50 seeds,
    loss within 1e-3 relative; each gradient's on - off at most 2.5x its bf16 noise (k_proj's
    bias, whose true gradient is ~0) or at most 5.6% of its norm, never both; the whole gradient
    vector's distance from float32 within 1.0-1.25x of the off run's. The bounds: loss 5e-3
    relative; each gradient ||on - off|| <= 3% of ||off|| + 3 x its bf16 noise; the vector no
    farther from float32 than 1.5x the off run. A kernel wrong by more than rounding (a backward
    without the mean subtraction, a lost partial sum of dgamma) fails them by far (the mutations
    in the commit's report)."""
    model = _lm(**kw).train()
    idx = torch.randint(0, 128, (2, 40), device=DEV)
    targets = torch.randint(0, 128, (2, 40), device=DEV)
    targets[0, :5] = -100
    ref = _loss_and_grads(model, idx, targets, False, dtype=None)  # float32: the noise's judge
    want = _loss_and_grads(model, idx, targets, False)
    assert launches == {"fwd": 0, "bwd": 0}
    got = _loss_and_grads(model, idx, targets, True)
    per_forward = 4 * model.cfg.n_layer + 1
    recompute = 4 * model.cfg.n_layer if kw.get("checkpoint_activations") else 0
    assert launches == {"fwd": per_forward + recompute, "bwd": per_forward}
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=5e-3)
    assert got[1].keys() == want[1].keys() == ref[1].keys()
    for name, w in want[1].items():
        g, r = got[1][name], ref[1][name]
        assert (g - w).norm() <= 3e-2 * w.norm() + 3 * (w - r).norm() + 1e-7, (
            name, ((g - w).norm() / w.norm()).item(), ((g - w).norm() / (w - r).norm()).item())
    flat = [torch.cat([v.flatten() for v in x[1].values()]) for x in (got, want, ref)]
    assert (flat[0] - flat[2]).norm() <= 1.5 * (flat[1] - flat[2]).norm()


def test_eval_generate_and_encoder(seed, ln_on, launches):
    """Under autocast without gradients (eval) the kernel runs without autograd; generate
    (no autocast) never calls it (its decode steps take the fused-norm kernels, not counted here); the encoder's final LayerNorm keeps autocast's float32
    output."""
    model = _lm().eval()
    idx = torch.randint(0, 128, (1, 20), device=DEV)
    with torch.no_grad(), torch.autocast(DEV, dtype=torch.bfloat16):
        on, _ = model(idx)
        flags.set_triton_layernorm(False)
        off, _ = model(idx)
        flags.set_triton_layernorm(True)
    assert launches == {"fwd": 4 * model.cfg.n_layer + 1, "bwd": 0}
    assert on.dtype == off.dtype == torch.bfloat16
    assert (on.float() - off.float()).norm() <= 2e-2 * off.float().norm()  # bf16 noise (see above)
    model.generate(idx, 3, temperature=0, decode="eager")
    assert launches["fwd"] == 4 * model.cfg.n_layer + 1
    enc = LongNetEncoder(LongNetConfig.preset("vit-tiny", n_layer=1, num_classes=0)).to(DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        feats = enc.forward_tokens(torch.randn(1, 16, enc.cfg.dim, device=DEV))
    assert feats.dtype == torch.float32 and launches["fwd"] == 4 * model.cfg.n_layer + 1 + 4


def test_state_dict_of_plain_layernorm_loads(seed):
    """A checkpoint written with nn.LayerNorm modules (the same keys) loads unchanged."""
    model = _lm()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for m in model.modules():
        assert not isinstance(m, torch.nn.LayerNorm) or isinstance(m, AutocastLayerNorm)
    other = _lm()
    other.load_state_dict(sd, strict=True)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in sd.items())


def test_compiled_model_launches_the_kernels_as_ops(seed, ln_on, launches):
    """torch.compile(fullgraph=True) with the switch on, under bf16 autocast: no graph break, and
    the kernels launched through the custom ops ``dilated_attention::layer_norm`` and
    ``::layer_norm_backward`` (until 2026-11-29 compiled graphs kept nn.LayerNorm)."""
    torch._dynamo.reset()
    model = _lm(impl="reference", n_layer=1)
    idx = torch.randint(0, 128, (1, 12), device=DEV)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.autocast(DEV, dtype=torch.bfloat16):
        _, loss = compiled(idx, idx, return_logits=False)
    loss.backward()
    assert launches["fwd"] > 0 and launches["bwd"] == launches["fwd"] and torch.isfinite(loss), launches


def test_auto_mode_runs_on_cuda_from_min_rows_only(monkeypatch, launches):
    """The default ("auto"): never on the CPU (Triton's interpreter only with "on"), and on CUDA
    only from LAYERNORM_AUTO_MIN_ROWS rows (decode steps keep nn.LayerNorm). The CUDA half is
    played on the CPU by reporting the input as a CUDA tensor to the rule."""
    from dilated_attention.models import longnet as L

    ln = AutocastLayerNorm(16).to(DEV)
    flags.set_triton_layernorm(None)
    monkeypatch.delenv(flags.ENV_TRITON_LAYERNORM, raising=False)
    assert L.LAYERNORM_AUTO_MIN_ROWS == 32768  # the measured default (docs/spec.md)
    # the rule at a threshold of 64 rows: the interpreter runs 32768 rows in ~170 s (CI time)
    monkeypatch.setattr(L, "LAYERNORM_AUTO_MIN_ROWS", 64)
    try:
        assert flags.triton_layernorm_mode() == "auto"
        with torch.autocast(DEV, dtype=torch.bfloat16):
            y = ln(torch.randn(4, L.LAYERNORM_AUTO_MIN_ROWS, 16, device=DEV))
        assert y.dtype == torch.float32 and launches["fwd"] == 0  # CPU: nn.LayerNorm
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        with torch.autocast(DEV, dtype=torch.bfloat16):
            small = ln(torch.randn(L.LAYERNORM_AUTO_MIN_ROWS - 1, 16, device=DEV))
            assert small.dtype == torch.float32 and launches["fwd"] == 0  # too few rows
            big = ln(torch.randn(L.LAYERNORM_AUTO_MIN_ROWS, 16, device=DEV))
            assert big.dtype == torch.bfloat16 and launches["fwd"] == 1  # the kernel
    finally:
        flags.set_triton_layernorm(None)


@pytest.mark.cuda
@pytest.mark.parametrize("n,xdtype", [(768, torch.float32), (768, torch.bfloat16), (3072, torch.bfloat16)],
                         ids=["pre-LN-768", "sub-LN-768", "ffn-sub-LN-3072"])  # fmt: skip
def test_cuda_realistic_size(seed, n, xdtype):
    """The base model's LayerNorms at 8K x 4 tokens (M = 8192 rows here), under bf16 autocast:
    the kernel (bf16 output) against autocast's float32 F.layer_norm rounded to bf16, and both
    backwards from the same bf16 dy, each against float64 (the bounds of the CPU tests) and
    against each other; the kernel's backward twice: the same bits."""
    m = 8192
    x = (torch.randn(m, n, device="cuda") * 2 + 0.5).to(xdtype)
    ln = AutocastLayerNorm(n).cuda()
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.3)
        ln.bias.normal_()
    dy = torch.randn(m, n, device="cuda").bfloat16()
    res = []
    for on in (True, False):
        flags.set_triton_layernorm(on)
        try:
            xx = x.detach().requires_grad_()
            ln.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = ln(xx)
            assert y.dtype == (torch.bfloat16 if on else torch.float32)
            y.backward(dy.to(y.dtype))
            res.append((y.detach().bfloat16(), xx.grad, ln.weight.grad, ln.bias.grad))
        finally:
            flags.set_triton_layernorm(None)
    want = _reference(x, ln.weight, ln.bias, ln.eps, dy)
    dtypes = (torch.bfloat16, xdtype, torch.float32, torch.float32)
    _check(res[0], want, dtypes, m)  # the kernel against float64
    _check(res[1], want, dtypes, m)  # autocast's path against float64: the same bounds
    for name, g, p in zip(("y", "dx"), res[0], res[1], strict=False):  # and against each other
        torch.testing.assert_close(g, p, **TOL[g.dtype], msg=name)
    again = tln._backward(dy, x, ln.weight, ln.bias, *tln._forward(x, ln.weight, ln.bias, ln.eps, torch.bfloat16)[1:])
    first = tln._backward(dy, x, ln.weight, ln.bias, *tln._forward(x, ln.weight, ln.bias, ln.eps, torch.bfloat16)[1:])
    for a, c in zip(first, again, strict=True):
        assert torch.equal(a, c)  # deterministic: no atomics


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n", [(3, 100), (1, 64), (5, 1), (4, 257)], ids=lambda v: str(v))
def test_add_and_gelu_layer_norm(seed, m, n, dtype, bias):
    """The decode step's fused kernels (inference only): ``add_layer_norm`` returns x + r with
    torch's bits (on the CPU the interpreter truncates to 16 bits: one ulp) and LayerNorm of
    that sum; ``gelu_layer_norm`` LayerNorm of the exact (erf) GELU, both against float64."""
    eps = 1e-5
    x, w, b = _inputs(m, n, dtype, bias)
    r = (torch.randn(m, n, device=DEV) * 2).to(dtype)
    with torch.no_grad():
        s, y = tln.add_layer_norm(x, r, w, b, eps)
        yg = tln.gelu_layer_norm(x, w, b, eps)
    assert s.dtype == y.dtype == yg.dtype == dtype and s.shape == y.shape == yg.shape == x.shape
    if dtype == torch.float32 or DEV == "cuda":
        assert torch.equal(s, x + r)
    else:
        torch.testing.assert_close(s, x + r, rtol=2**-7, atol=0)
    dy = torch.zeros(m, n, device=DEV)
    _close_rows(y, _reference(s, w, b, eps, dy)[0], dtype, "add y")
    g = F.gelu(x.double())  # the exact form: the tanh approximation is ~1e-3 away
    want = _reference(g, w, b, eps, dy)[0]
    if dtype == torch.float32:
        torch.testing.assert_close(yg.double(), want, atol=1e-5, rtol=1e-5)
    else:  # gelu rounded to 16 bits before the LayerNorm, and the output rounded
        err = (yg.double() - want).norm() / want.norm().clamp_min(1e-6)
        assert err <= 2**-6, err


def test_add_and_gelu_layer_norm_refuse_bad_input():
    x = torch.randn(2, 8, device=DEV)
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="one shape"):
        tln.add_layer_norm(x, torch.randn(2, 7, device=DEV), w, None, 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        tln.add_layer_norm(x, x.double(), w, None, 1e-5)
    with pytest.raises(ValueError, match="inference only"):
        tln.gelu_layer_norm(x.requires_grad_(), w, None, 1e-5)
