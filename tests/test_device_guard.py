"""The device guard (``kernels/direct_launch.py``, "The device guard"): every Triton entry point
launches on its inputs' device and that device's stream, whatever the current CUDA device.

Triton launches on the current device (``torch.cuda.current_device()``), not the tensors'. A model
on cuda:1 (or spread over GPUs by ``device_map="auto"``) while cuda:0 is current would otherwise
get its kernels launched on device 0 against device-1 pointers: an illegal address, or with peer
access a launch unordered with device 1's stream (a race, silently wrong results).

CPU tests: Triton's interpreter runs the kernels on CPU tensors that pose as device 1's
(``direct_launch.tensor_device``) while device 0 poses as current (``helpers.device_switch``: a
stand-in ``torch.cuda.device`` that records the index it is entered with and makes it current
until exit). Each test asserts that the call entered device 1 exactly once per launching entry
(forward, backward), left device 0 current, and gave the same bits as the call without stand-ins;
and that a call already on its device never enters the context manager (the guard costs one
device read there). The ``cuda`` tests need two GPUs: inputs on cuda:1 with cuda:0 current,
against the same computation on cuda:0 and against the float64 reference. ``LongNetLM.generate``
enters the model's device once per call, around its prefill, decode steps and decode graph.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import device_switch

pytest.importorskip("triton")

from dilated_attention import call_cache, decode, dilated_attention, flags  # noqa: E402
from dilated_attention.decode import dilated_attention_with_kvcache  # noqa: E402
from dilated_attention.kernels import direct_launch  # noqa: E402
from dilated_attention.kernels import triton_decode as td  # noqa: E402
from dilated_attention.kernels import triton_launch as L  # noqa: E402
from dilated_attention.kernels.triton_ce import ce_loss_grad_  # noqa: E402
from dilated_attention.kernels.triton_layernorm import layer_norm  # noqa: E402
from dilated_attention.kernels.triton_rotary import rotary_fused, rotary_into_cache  # noqa: E402
from dilated_attention.models import LongNetConfig, LongNetLM  # noqa: E402
from dilated_attention.models.longnet import Rotary  # noqa: E402
from dilated_attention.varlen import dilated_attention_varlen  # noqa: E402

INTERP = not torch.cuda.is_available()
interp_only = pytest.mark.skipif(not INTERP, reason="the stand-in devices run in Triton's interpreter on the CPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
SEG, DIL = (8, 16), (1, 2)


def _drop_state() -> None:
    """Drop every plan and stored route: those built while the CPU poses as device 1 hold that
    device (a plan reads it once, when built), and must meet no call without the stand-ins."""
    L._PLANS.clear()
    td._PLANS.clear()  # and decode's fast path
    decode._FAST.clear()
    call_cache.clear()


@contextlib.contextmanager
def _as_device_1(current: int = 0):
    """CPU tensors posing as device 1's, ``current`` the current device; yields the switch."""
    _drop_state()
    with pytest.MonkeyPatch.context() as mp:
        sw = device_switch(mp, current)
        mp.setattr(direct_launch, "tensor_device", lambda t: 1)
        mp.setattr(direct_launch, "current_stream", lambda i: 0)
        mp.setattr(direct_launch, "capturing", lambda: False)
        try:
            yield sw
        finally:
            _drop_state()


def _same(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"result {i} differs"


# -------------------------------------------------------------------------------- dense, varlen
def _dense(q, k, v, do):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*xs, SEG, DIL, causal=True, impl="triton", return_lse=True)
    return (out, lse, *torch.autograd.grad(out, xs, do))


@interp_only
@pytest.mark.parametrize("plans", [True, False], ids=["plan", "per_call"])
def test_dense_forward_backward_switch_to_the_inputs_device(seed, monkeypatch, plans):
    monkeypatch.setattr(L, "USE_PLANS", plans)  # TrainPlan.forward/backward, or the per-call path
    q, k, v = torch.randn(1, 32, 4, 16), torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16)
    do = torch.randn(1, 32, 4, 16)
    want = _dense(q, k, v, do)
    with _as_device_1() as sw:
        got = _dense(q, k, v, do)
        assert sw.entered == [1, 1] and sw.current == 0  # the forward, then the backward
        got2 = _dense(q, k, v, do)  # a repeated call (the front door's stored route)
        assert sw.entered == [1, 1, 1, 1] and sw.current == 0
    _same(got, want)
    _same(got2, want)


@interp_only
def test_dense_on_its_own_device_enters_no_guard(seed):
    q, k, v = torch.randn(1, 32, 4, 16), torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16)
    do = torch.randn(1, 32, 4, 16)
    want = _dense(q, k, v, do)
    with _as_device_1(current=1) as sw:
        got = _dense(q, k, v, do)
    assert sw.entered == []
    _same(got, want)


@interp_only
def test_varlen_forward_backward_switch_to_the_inputs_device(seed):
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    q, k, v = torch.randn(40, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    do = torch.randn(40, 4, 16)

    def run():
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention_varlen(*xs, cu, cu, 27, 27, SEG, DIL, causal=True, impl="triton",
                                            return_lse=True)  # fmt: skip
        return (out, lse, *torch.autograd.grad(out, xs, do))

    want = run()
    with _as_device_1() as sw:
        got = run()
    assert sw.entered == [1, 1] and sw.current == 0
    _same(got, want)


# ------------------------------------------------------------------------------------- decode
@interp_only
@pytest.mark.parametrize("direct", [True, False], ids=["plan", "jit"])
def test_decode_switches_to_the_inputs_device(seed, direct):
    # the plan (DecodePlan: the full path's first call, then the fast path's repeated call) or
    # the per-call path (decode_triton_jit, the direct launch off)
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    sl = torch.tensor([40, 23], dtype=torch.int32)

    def run():
        with torch.no_grad():
            return dilated_attention_with_kvcache(q, kc, vc, sl, SEG, DIL, causal=True, return_lse=True,
                                                  impl="triton")  # fmt: skip

    flags.set_direct_launch(direct)
    try:
        _drop_state()
        want = run()
        with _as_device_1() as sw:
            got, got2 = run(), run()
            assert sw.entered == [1, 1] and sw.current == 0
        with _as_device_1(current=1) as sw:
            run(), run()
            assert sw.entered == []
    finally:
        flags.set_direct_launch(None)
        _drop_state()
    _same(got, want)
    _same(got2, want)


# ------------------------------------------------------------------------ rotary, CE, LayerNorm
def _rotary_case():
    table = Rotary(16).table(torch.arange(100, 108), torch.float32)
    return torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16), table


@interp_only
def test_rotary_switches_to_the_inputs_device(seed):
    q, k, t = _rotary_case()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def run():
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = rotary_fused(qq, kk, t.cos_q, t.sin_q, t.cos_k, t.sin_k)
        return (qo, ko, *torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (qq, kk)))

    want = run()
    want_nograd = rotary_fused(q, k, t.cos_q, t.sin_q, t.cos_k, t.sin_k)
    with _as_device_1() as sw:
        got = run()
        assert sw.entered == [1, 1] and sw.current == 0  # forward, backward
        got_nograd = rotary_fused(q, k, t.cos_q, t.sin_q, t.cos_k, t.sin_k)  # no autograd Function
        assert sw.entered == [1, 1, 1] and sw.current == 0
    with _as_device_1(current=1) as sw:
        run()
    assert sw.entered == []
    _same(got, want)
    _same(got_nograd, want_nograd)


@interp_only
def test_cross_entropy_switches_to_the_inputs_device(seed):
    logits = torch.randn(6, 40)
    targets = torch.tensor([3, -100, 0, 39, 17, 5])
    want = logits.clone()
    want_loss = ce_loss_grad_(want, targets, -100, block_v=16)
    got = logits.clone()
    with _as_device_1() as sw:
        got_loss = ce_loss_grad_(got, targets, -100, block_v=16)
    assert sw.entered == [1] and sw.current == 0
    _same((got_loss, got), (want_loss, want))


@interp_only
def test_layernorm_switches_to_the_inputs_device(seed):
    x, w, b = torch.randn(2, 5, 32), torch.randn(32), torch.randn(32)
    dy = torch.randn(2, 5, 32)

    def run():
        xs = [t.clone().requires_grad_() for t in (x, w, b)]
        y = layer_norm(*xs, 1e-5)
        return (y, *torch.autograd.grad(y, xs, dy))

    want = run()
    with _as_device_1() as sw:
        got = run()
    assert sw.entered == [1, 1] and sw.current == 0  # forward, backward
    _same(got, want)


# ------------------------------------------------------------------------------------ generate
def _lm(impl, device="cpu"):
    cfg = LongNetConfig(vocab_size=50, dim=64, n_layer=2, n_head=4, n_kv_head=2, ffn_dim=96,
                        segment_lengths=SEG, dilation_rates=DIL, impl=impl)  # fmt: skip
    return LongNetLM(cfg).to(device).eval()


@interp_only
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_generate_runs_on_the_models_device(seed, impl):
    # LongNetLM.generate enters the model's device once per call, around all of it (prefill,
    # every decode step; on CUDA the decode graph and its capture stream too), whatever the
    # current device; the kernels' own guards then find their device current
    m = _lm(impl)
    prompt = torch.randint(0, 50, (2, 11))
    want = m.generate(prompt, 4, temperature=0.0)
    want_roll = m.generate(prompt, 4, temperature=0.0, rolling=True, prefill_chunk=5)
    hidden_last, seen = m._hidden_last, []

    def probe(*a):  # the current device at each prefill chunk and decode step
        seen.append(sw.current)
        return hidden_last(*a)

    with _as_device_1() as sw, pytest.MonkeyPatch.context() as mp:
        mp.setattr(m, "_hidden_last", probe)
        got = m.generate(prompt, 4, temperature=0.0)
        assert sw.entered == [1] and sw.current == 0
        got_roll = m.generate(prompt, 4, temperature=0.0, rolling=True, prefill_chunk=5)
        assert sw.entered == [1, 1] and sw.current == 0  # one per call, none per token
    assert seen == [1] * (1 + 3 + 3 + 3)  # prefill, decode steps; rolling: 3 prefill chunks
    with _as_device_1(current=1) as sw:
        got_here = m.generate(prompt, 4, temperature=0.0)
    assert sw.entered == []
    assert torch.equal(got, want) and torch.equal(got_here, want) and torch.equal(got_roll, want_roll)


@interp_only
def test_rotary_into_cache_switches_to_the_inputs_device(seed):
    q, k, t = _rotary_case()
    v = torch.randn_like(k)
    slots = torch.tensor([9, 10, 11, 12, 13, 14, 15, 0])

    def run():
        ck, cv = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
        qo = rotary_into_cache(q, k, v, t.cos_q, t.sin_q, t.cos_k, t.sin_k, ck, cv, slots)
        return qo, ck, cv

    want = run()
    with _as_device_1() as sw:
        got = run()
        assert sw.entered == [1] and sw.current == 0
    with _as_device_1(current=1) as sw:
        run()
    assert sw.entered == []
    _same(got, want)


# --------------------------------------------------------------------------- inputs on two devices
def test_rotary_refuses_q_and_k_on_two_devices():
    q, k, t = _rotary_case()
    with pytest.raises(ValueError, match=r"q and k must be on one device, got cpu and meta"):
        rotary_fused(q, k.to("meta"), t.cos_q, t.sin_q, t.cos_k.to("meta"), t.sin_k.to("meta"))


def test_cross_entropy_refuses_targets_on_another_device():
    with pytest.raises(ValueError, match=r"logits and targets must be on one device, got cpu and meta"):
        ce_loss_grad_(torch.randn(4, 8), torch.zeros(4, dtype=torch.long, device="meta"), -100)


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_layernorm_refuses_parameters_on_another_device(which):
    args = dict(weight=torch.randn(8), bias=torch.randn(8))
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=r"x, weight and bias must be on one device"):
        layer_norm(torch.randn(3, 8), args["weight"], args["bias"], 1e-5)


def test_attention_refuses_q_k_v_on_two_devices():
    q, k = torch.randn(1, 16, 2, 16), torch.randn(1, 16, 2, 16)
    with pytest.raises(ValueError, match=r"q, k, v must be on one device, got cpu, meta, cpu"):
        dilated_attention(q, k.to("meta"), k, SEG, DIL, impl="triton")
    with pytest.raises(ValueError, match=r"must be on one device, got cpu, meta, cpu"):
        dilated_attention_with_kvcache(q[:, :1], k.to("meta"), k, 16, SEG, DIL, impl="triton")


# ------------------------------------------------------------------------------------ two GPUs
# Inputs on cuda:1 while cuda:0 is current, against the same call on cuda:0 (the same kernels on
# the same kind of GPU: the same bits, the backward has no atomics) and against the float64
# reference at tests/test_triton.py's float32 tolerances; each call leaves cuda:0 current.


def _on(dev, *ts):
    return [t.to(dev, copy=True) for t in ts]  # copies: the cross-entropy writes over its logits


def _both(fn, *inputs):
    """fn(*inputs) with the inputs on cuda:0 and on cuda:1, cuda:0 current for both; every
    result of the second on cuda:1."""
    with torch.cuda.device(0):
        want = fn(*_on("cuda:0", *inputs))
        for _ in range(2):  # the first call through Triton's launch, the second direct
            got = fn(*_on("cuda:1", *inputs))
            assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.device == torch.device("cuda:1"), i
        assert torch.equal(g.cpu(), w.cpu()), f"result {i} differs between cuda:1 and cuda:0"
    return got


def _close(name, got, ref, atol):
    got, ref = got.double().cpu(), ref.double().cpu()
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    err = torch.where(both_inf, torch.zeros_like(got), (got - ref).abs())
    assert (err <= atol).all(), f"{name}: max err {err.max().item():.3g} > {atol}"


@pytest.mark.cuda
@two_gpus
def test_cuda_dense_and_varlen_on_the_second_gpu(seed):
    seg, dil = (256, 512, 1024), (1, 2, 4)
    q, k, v, do = torch.randn(2, 1500, 4, 64), torch.randn(2, 1500, 2, 64), torch.randn(2, 1500, 2, 64), \
        torch.randn(2, 1500, 4, 64)  # fmt: skip

    def dense(q, k, v, do, impl="triton"):
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention(*xs, seg, dil, causal=True, impl=impl, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, xs, do))

    got = _both(dense, q, k, v, do)
    ref = dense(*_on("cuda:1", q.double(), k.double(), v.double(), do.double()), impl="reference")
    for name, g, r, tol in zip(("out", "lse", "dq", "dk", "dv"), got, ref, (1e-4, 1e-4, 5e-4, 5e-4, 5e-4),
                               strict=True):  # fmt: skip
        _close(name, g, r, tol)
    cu = torch.tensor([0, 700, 1500, 3000], dtype=torch.int32)

    def packed(q, k, v, do, cu):
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention_varlen(*xs, cu, cu, 1500, 1500, seg, dil, causal=True, impl="triton",
                                            return_lse=True)  # fmt: skip
        return (out, lse, *torch.autograd.grad(out, xs, do))

    _both(packed, q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), do.flatten(0, 1), cu)


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("direct", [True, False], ids=["plan", "jit"])
def test_cuda_decode_on_the_second_gpu(seed, direct):
    seg, dil = (2048, 4096, 8192), (1, 2, 4)
    q, kc, vc = torch.randn(2, 1, 8, 128), torch.randn(2, 9000, 2, 128), torch.randn(2, 9000, 2, 128)
    sl = torch.tensor([9000, 4321], dtype=torch.int32)

    def step(q, kc, vc, sl, impl="triton"):
        with torch.no_grad():
            return dilated_attention_with_kvcache(q, kc, vc, sl, seg, dil, causal=True, return_lse=True, impl=impl)

    flags.set_direct_launch(direct)
    try:
        got = _both(step, q, kc, vc, sl)
    finally:
        flags.set_direct_launch(None)
    ref = step(*_on("cuda:1", q.double(), kc.double(), vc.double(), sl), impl="torch")
    _close("out", got[0], ref[0], 1e-4)
    _close("lse", got[1], ref[1], 1e-4)


@pytest.mark.cuda
@two_gpus
def test_cuda_rotary_ce_layernorm_on_the_second_gpu(seed):
    q, k = torch.randn(2, 512, 8, 64), torch.randn(2, 512, 2, 64)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    pos = torch.arange(1000, 1512)

    def rot(q, k, gq, gk, pos):
        t = Rotary(64).to(q.device).table(pos, torch.float32)
        qq, kk = q.requires_grad_(), k.requires_grad_()
        qo, ko = rotary_fused(qq, kk, t.cos_q, t.sin_q, t.cos_k, t.sin_k)
        return (qo, ko, *torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (qq, kk)))

    got = _both(rot, q, k, gq, gk, pos)
    t = Rotary(64).to("cuda:1").table(pos.to("cuda:1"), torch.float64)
    for name, g, x, cs in (("q", got[0], q, (t.cos_q, t.sin_q)), ("k", got[1], k, (t.cos_k, t.sin_k))):
        _close(name, g, Rotary._rotate_with(x.to("cuda:1", torch.float64), *cs), 1e-5)

    logits, targets = torch.randn(64, 50304), torch.randint(0, 50304, (64,))
    targets[5] = -100

    def ce(logits, targets):
        loss = ce_loss_grad_(logits, targets, -100)
        return loss, logits

    loss, grad = _both(ce, logits, targets)
    x = logits.to("cuda:1", torch.float64)
    valid = targets.to("cuda:1") != -100
    tt = targets.to("cuda:1").clamp(min=0)
    want = torch.logsumexp(x, 1) - x.gather(1, tt[:, None])[:, 0]
    _close("ce loss", loss, torch.where(valid, want, 0.0), 1e-4)
    p = torch.softmax(x, 1) - torch.nn.functional.one_hot(tt, x.shape[1])
    _close("ce grad", grad, p * valid[:, None], 1e-6)

    x, w, b, dy = torch.randn(4, 100, 768), torch.randn(768), torch.randn(768), torch.randn(4, 100, 768)

    def ln(x, w, b, dy):
        xs = [t.requires_grad_() for t in (x, w, b)]
        y = layer_norm(*xs, 1e-5)
        return (y, *torch.autograd.grad(y, xs, dy))

    got = _both(ln, x, w, b, dy)
    xs = [t.to("cuda:1", torch.float64).requires_grad_() for t in (x, w, b)]
    y = torch.nn.functional.layer_norm(xs[0], (768,), xs[1], xs[2], 1e-5)
    ref = (y, *torch.autograd.grad(y, xs, dy.to("cuda:1", torch.float64)))
    for name, g, r, tol in zip(("y", "dx", "dw", "db"), got, ref, (1e-5, 1e-4, 1e-3, 1e-3), strict=True):
        _close(name, g, r, tol)


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("decode", ["graph", "eager"])
def test_cuda_generate_on_the_second_gpu(seed, decode, monkeypatch):
    # the decode graph is captured on the model's device (and on a stream of that device, not on
    # torch.cuda.graph's default capture stream: one per process, here made on cuda:0 as an
    # earlier capture with cuda:0 current would have); a model moved to cuda:0 after a call on
    # cuda:1 captures afresh there
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", torch.cuda.Stream(0))
    m = _lm("auto", "cuda:0")
    prompt = torch.randint(0, 50, (2, 40))
    with torch.cuda.device(0):
        want = m.generate(prompt.to("cuda:0"), 30, temperature=0.0, decode=decode)
        m.to("cuda:1")
        for _ in range(2):
            got = m.generate(prompt.to("cuda:1"), 30, temperature=0.0, decode=decode)
            assert torch.cuda.current_device() == 0
            assert got.device == torch.device("cuda:1")
            assert torch.equal(got.cpu(), want.cpu()), "cuda:1 differs from cuda:0"
        m.to("cuda:0")
        back = m.generate(prompt.to("cuda:0"), 30, temperature=0.0, decode=decode)
        assert torch.equal(back, want), "cuda:0 after cuda:1 differs"
