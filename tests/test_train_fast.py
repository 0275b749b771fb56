"""The fast path of a repeated dense call (issue 23 item 3; ``call_cache.py``, ``api._route``)
and the lean eager autograd Function of the fused kernels (``triton_ops._EagerFused``,
``fused_apply``, the plan memo of ``FusedCall``).

A call with the configuration of an earlier successful call runs the route that call took,
with no checks and no decisions re-derived. These tests hold a hit to the full path bit for bit
(out, lse and every gradient, on fresh random inputs), check that every property a key holds
sends a call that differs in it through the full path (which raises where it raised before),
that what a key cannot hold is checked per call (autocast, the branch lists' element types)
or read by the route itself (the plan switches, the direct launch), and that the fast path is
taken, through the functional API, the modules and the Hugging Face function. On the CPU the
fused kernels run in Triton's interpreter (float32: its bf16 dot is wrong).
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import (
    DilatedAttention,
    MultiheadDilatedAttention,
    api,
    call_cache,
    dilated_attention,
    flags,
)
from dilated_attention.kernels import select

HAS_TRITON = select.triton_unavailable_reason(torch.empty(1, 1, 1, 16)) is None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton (interpreter) unavailable")
SEG, DIL = (8, 16), (1, 2)


@pytest.fixture(autouse=True)
def _fresh():
    call_cache.clear()
    yield
    call_cache.clear()


def _spy(monkeypatch):
    """Count the full path's checks (a hit runs none)."""
    seen = []
    real = api.describe_call
    monkeypatch.setattr(api, "describe_call", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    return seen


def _inputs(nq, nk, h, hkv, d, dtype, pad=False, grad=True, b=2):
    q = torch.randn(b, nq, h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, requires_grad=grad)
    do = torch.randn(b, nq, h, d, dtype=dtype)
    kpm = (torch.rand(b, nk) < 0.25) if pad else None
    return q, k, v, do, kpm


def _call(q, k, v, do, kpm, seg=SEG, dil=DIL, **kw):
    """out (, lse) and the gradients of the inputs that require one, as a flat tuple."""
    res = dilated_attention(q, k, v, seg, dil, key_padding_mask=kpm, **kw)
    outs = res if isinstance(res, tuple) else (res,)
    xs = [t for t in (q, k, v) if t.requires_grad]
    grads = torch.autograd.grad(outs[0], xs, do) if xs and torch.is_grad_enabled() else ()
    return (*(o.detach() for o in outs), *grads)


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b)


def _hit_vs_full(monkeypatch, make, **kw):
    """Store a route (first call), then on fresh inputs: the hit (no check ran) against the full
    path (cache cleared) on the same inputs, bit for bit."""
    seen = _spy(monkeypatch)
    _call(*make(), **kw)
    assert len(seen) == 1 and len(call_cache._ROUTES.entries) == 1
    x = make()
    got = _call(*x, **kw)
    assert len(seen) == 1, "the second call took the full path"
    call_cache.clear()
    want = _call(*x, **kw)
    assert len(seen) == 2
    _same(got, want)
    return got


# (impl, dtype, nq, nk, heads, kv heads, causal, head_assignment, return_lse, padding mask)
CASES = [
    ("torch", torch.float32, 37, 37, 4, 2, True, "all", True, False),
    ("torch", torch.float64, 37, 37, 4, 4, False, "split", False, True),
    ("torch", torch.float32, 66, 80, 4, 1, True, "split", True, False),  # prefill, not decode-shaped
    ("torch", torch.float64, 40, 40, 3, 1, False, "all", False, False),
    ("reference", torch.float64, 37, 37, 4, 2, True, "split", True, True),
    ("reference", torch.float64, 66, 71, 2, 2, False, "all", False, False),
    ("triton", torch.float32, 37, 37, 4, 2, True, "all", True, False),
    ("triton", torch.float32, 37, 37, 4, 4, False, "split", False, True),
    ("triton", torch.float32, 40, 40, 3, 1, True, "split", False, False),
    ("triton", torch.float32, 33, 33, 4, 2, False, "all", True, True),
    ("triton", torch.float32, 66, 70, 2, 1, True, "all", True, False),  # prefill
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_hit_equals_full_path(seed, monkeypatch, case):
    impl, dtype, nq, nk, h, hkv, causal, ha, lse, pad = case
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton (interpreter) unavailable")
    got = _hit_vs_full(
        monkeypatch, lambda: _inputs(nq, nk, h, hkv, 16, dtype, pad), causal=causal, head_assignment=ha,
        return_lse=lse, impl=impl,
    )  # fmt: skip
    assert all(torch.isfinite(t).all() or t.dtype == torch.float32 for t in got[:1])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hit_without_grad_equals_full_path(seed, monkeypatch, impl):
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton (interpreter) unavailable")
    with torch.no_grad():
        _hit_vs_full(monkeypatch, lambda: _inputs(40, 40, 4, 2, 16, torch.float32, grad=True), causal=True,
                     impl=impl, return_lse=True)  # fmt: skip


def test_fast_path_is_taken_by_the_front_door_and_the_modules(seed, monkeypatch):
    seen = _spy(monkeypatch)
    picked = []
    real_pick = api.pick_impl
    monkeypatch.setattr(api, "pick_impl", lambda *a, **kw: picked.append(1) or real_pick(*a, **kw))
    q, k, v, do, kpm = _inputs(40, 40, 4, 2, 16, torch.float32, pad=True)
    for _ in range(3):
        _call(q, k, v, do, kpm, causal=True, impl="torch")
    assert len(seen) == 1 and len(picked) == 1
    # the modules call the front door: their repeated calls hit too
    att = DilatedAttention([8, 16], [1, 2], impl="torch")
    mha = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2], num_kv_heads=2, impl="torch").train()
    x = torch.randn(2, 40, 32, requires_grad=True)
    q2, k2, v2, _, kpm2 = _inputs(48, 48, 4, 2, 16, torch.float32, pad=True)
    for _ in range(3):
        att(q2, k2, v2, is_causal=True, key_padding_mask=kpm2).sum().backward()
        out, _ = mha(x, x, x, kpm, is_causal=True)
        out.sum().backward()
    assert len(seen) == 3 and len(picked) == 3


def test_fast_path_is_taken_by_the_hf_function(seed, monkeypatch):
    from dilated_attention.integrations.hf import make_attention_function

    seen = _spy(monkeypatch)
    fn = make_attention_function([8, 16], [1, 2], impl="torch")
    module = torch.nn.Module().train()
    module.is_causal = True
    q = torch.randn(2, 4, 40, 16, requires_grad=True)  # transformers' (B, H, N, D)
    k, v = (torch.randn(2, 2, 40, 16, requires_grad=True) for _ in range(2))
    outs = [fn(module, q, k, v, None, scaling=0.25, dropout=0.0)[0] for _ in range(3)]
    assert len(seen) == 1
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


# ------------------------------------------------------------------ what sends a call to the full path


def _stored(monkeypatch, impl="torch", dtype=torch.float32):
    seen = _spy(monkeypatch)
    x = _inputs(40, 40, 4, 2, 16, dtype)
    _call(*x, causal=True, impl=impl)
    assert len(seen) == 1
    return seen, x


def _full_again(seen, fn):
    """``fn()`` takes the full path (one check more) and gives the full path's result."""
    n = len(seen)
    got = fn()
    assert len(seen) == n + 1, "a stale route ran"
    saved = dict(call_cache._ROUTES.entries)
    call_cache.clear()
    want = fn()
    call_cache._ROUTES.entries.update(saved)
    _same(got, want)
    return got


def test_a_changed_dtype_shape_or_stride_takes_the_full_path(seed, monkeypatch):
    seen, (q, k, v, do, _) = _stored(monkeypatch)
    # dtype
    xd = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _full_again(seen, lambda: _call(*xd, do.double(), None, causal=True, impl="torch"))
    # shape (an awkward length)
    x2 = _inputs(37, 37, 4, 2, 16, torch.float32, b=2)
    _full_again(seen, lambda: _call(*x2, causal=True, impl="torch"))
    # strides: the same shape as a transposed view ((B, H, N, D) storage, as Hugging Face's)
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert qt.shape == q.shape and qt.stride() != q.stride()
    _full_again(seen, lambda: _call(qt, k, v, do, None, causal=True, impl="torch"))
    # the padding mask: given, then another dtype (a float mask is refused: the full path's error)
    kpm = torch.rand(2, 40) < 0.3
    _full_again(seen, lambda: _call(q, k, v, do, kpm, causal=True, impl="torch"))
    n = len(seen)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        _call(q, k, v, do, kpm.float(), causal=True, impl="torch")
    assert len(seen) == n + 1


def test_grad_mode_and_requires_grad_are_part_of_the_key(seed, monkeypatch):
    seen, (q, k, v, do, _) = _stored(monkeypatch)
    with torch.no_grad():
        _full_again(seen, lambda: _call(q, k, v, do, None, causal=True, impl="torch"))
    q2 = q.detach()  # q needs no gradient now: dk, dv only
    got = _full_again(seen, lambda: _call(q2, k, v, do, None, causal=True, impl="torch"))
    assert len(got) == 3


def test_autocast_takes_the_full_path(seed, monkeypatch):
    seen, (q, k, v, do, _) = _stored(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
        assert len(seen) == 2 and got.dtype == torch.bfloat16
        call_cache.clear()
        want = dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
    assert torch.equal(got, want)
    # nothing stored under autocast; outside it the stored route serves again
    assert not call_cache._ROUTES.entries
    dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
    dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
    assert len(seen) == 4


def test_branch_lists_as_list_or_tuple_hit_but_other_element_types_do_not(seed, monkeypatch):
    seen, (q, k, v, do, _) = _stored(monkeypatch)
    _call(q, k, v, do, None, seg=[8, 16], dil=[1, 2], causal=True, impl="torch")
    _call(q, k, v, do, None, seg=list(SEG), dil=tuple(DIL), causal=True, impl="torch")
    assert len(seen) == 1
    # equal values that hash alike but the full path refuses: its errors, every time
    for seg, dil, err in (([8.0, 16], DIL, TypeError), (SEG, [True, 2], TypeError)):
        for _ in range(2):
            with pytest.raises(err, match="must hold ints"):
                _call(q, k, v, do, None, seg=seg, dil=dil, causal=True, impl="torch")
    assert len(seen) == 5


BAD = [
    (dict(head_assignment="some"), ValueError, "head_assignment must be"),
    (dict(impl="fast"), ValueError, "impl must be one of"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(seg=(8, 16), dil=(1, 32)), ValueError, "dilation"),
    (dict(seg=(8, 16, 32), dil=(1, 2)), ValueError, "same length"),
    (dict(dropout_p=1.5), ValueError, "dropout_p must be in"),
]


@pytest.mark.parametrize("kw,err,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_argument_after_a_good_call_raises_as_without_the_cache(seed, monkeypatch, kw, err, match):
    _, (q, k, v, do, _) = _stored(monkeypatch)
    args = {**dict(seg=SEG, dil=DIL, causal=True, impl="torch"), **kw}
    with pytest.raises(err, match=match) as cached:
        _call(q, k, v, do, None, **args)
    call_cache.clear()
    with pytest.raises(err) as fresh:
        _call(q, k, v, do, None, **args)
    assert str(cached.value) == str(fresh.value)
    assert not call_cache._ROUTES.entries  # a call that raised left nothing behind


def test_bad_tensors_after_a_good_call_raise_as_without_the_cache(seed, monkeypatch):
    _, (q, k, v, do, _) = _stored(monkeypatch)
    bad = [
        ((q, k[..., :8], v[..., :8]), ValueError, "head dims differ"),
        ((q, k.double(), v), TypeError, "must share a dtype"),
        ((q[:, :, :3], k, v), ValueError, "multiple of nheads_kv"),
        ((q, k, v[:, :30]), ValueError, "same shape"),
        ((q[0], k[0], v[0]), ValueError, "must have 4 dims"),
        ((q.detach().to_sparse(), k, v), Exception, None),
    ]
    for (a, b, c), err, match in bad:
        msgs = []
        for _ in range(2):
            with pytest.raises(err, match=match) as e:
                dilated_attention(a, b, c, SEG, DIL, causal=True, impl="torch")
            msgs.append(str(e.value))
            call_cache.clear()
        assert msgs[0] == msgs[1]


def test_a_call_that_raises_is_never_stored(seed, monkeypatch):
    seen = _spy(monkeypatch)
    q, k, v, do, _ = _inputs(40, 40, 4, 2, 16, torch.float64)
    for _ in range(2):  # the checks pass, the choice raises (the kernel has no float64)
        with pytest.raises(ValueError, match="impl='triton' cannot run here"):
            dilated_attention(q, k, v, SEG, DIL, causal=True, impl="triton")
    assert len(seen) == 2 and not call_cache._ROUTES.entries
    # the route itself raises on the first call: nothing stored, the next call is a full one
    from dilated_attention.kernels import torch_dilated

    real = torch_dilated.dilated_attention_torch_eager
    fail = [True]

    def flaky(*a, **kw):
        if fail.pop() if fail else False:
            raise RuntimeError("out of memory (simulated)")
        return real(*a, **kw)

    monkeypatch.setattr(torch_dilated, "dilated_attention_torch_eager", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
    assert not call_cache._ROUTES.entries
    dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
    assert len(seen) == 4 and len(call_cache._ROUTES.entries) == 1


def test_no_key_under_functorch_transforms_and_for_subclasses(seed, monkeypatch):
    seen = _spy(monkeypatch)
    q, k, v, _, _ = _inputs(40, 40, 4, 2, 16, torch.float64, grad=False)

    def loss(q):
        return dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch").square().sum()

    g = [torch.func.grad(loss)(q) for _ in range(2)]
    assert len(seen) == 2 and not call_cache._ROUTES.entries
    assert torch.equal(g[0], g[1])

    class Sub(torch.Tensor):
        pass

    qs = q.as_subclass(Sub)
    for _ in range(2):
        dilated_attention(qs, k, v, SEG, DIL, causal=True, impl="torch")
    assert len(seen) == 4 and not call_cache._ROUTES.entries
    # a torch without functorch's query: no key at all
    monkeypatch.setattr(call_cache, "_transforms_active", lambda: True)
    assert call_cache.train_key(q, k, v, SEG, DIL, True, None, None, "all", False, "torch") is None


def test_no_key_under_torch_compile(seed, monkeypatch):
    seen = _spy(monkeypatch)
    q, k, v, _, _ = _inputs(40, 40, 4, 2, 16, torch.float32, grad=False)
    f = torch.compile(lambda q, k, v: dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch"),
                      backend="eager", fullgraph=False)  # fmt: skip
    torch._dynamo.reset()
    got = f(q, k, v)
    assert not call_cache._ROUTES.entries and len(seen) >= 1
    assert torch.equal(got, dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch"))


def test_entries_are_bounded(seed, monkeypatch):
    monkeypatch.setattr(call_cache._ROUTES, "max_entries", 2)
    for n in (20, 24, 28):
        q, k, v, _, _ = _inputs(n, n, 2, 2, 16, torch.float32, grad=False)
        dilated_attention(q, k, v, SEG, DIL, impl="torch")
    assert len(call_cache._ROUTES.entries) <= 2


@pytest.mark.parametrize("impl", ["torch", "reference", "triton"])
def test_stored_routes_hold_no_tensor_of_a_call(seed, impl):
    # a route lives on after the call (256 kept): holding q would keep a long-N q alive
    import gc
    import weakref

    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton (interpreter) unavailable")
    dtype = torch.float64 if impl == "reference" else torch.float32
    x = _inputs(40, 40, 4, 2, 16, dtype, pad=True)
    refs = [weakref.ref(t) for t in x]
    for _ in range(2):  # stored, then a hit
        res = _call(*x, causal=True, impl=impl, return_lse=True)
        refs += [weakref.ref(t) for t in res]
    assert len(call_cache._ROUTES.entries) == 1
    del x, res
    gc.collect()
    assert all(r() is None for r in refs)


def test_decode_shaped_calls_take_the_decode_route(seed, monkeypatch):
    seen = _spy(monkeypatch)
    q, k, v, _, _ = _inputs(3, 40, 4, 2, 16, torch.float64, grad=False)
    with torch.no_grad():
        for _ in range(2):
            dilated_attention(q, k, v, SEG, DIL, causal=True, impl="torch")
    assert len(seen) == 2 and not call_cache._ROUTES.entries  # decode.fast_key's calls, not this cache's
    if HAS_TRITON:  # a decode plan ran: the decode fast path serves the next call
        from dilated_attention import decode

        decode._FAST.clear()
        qf, kf, vf = (t.float() for t in (q, k, v))
        with torch.no_grad():
            for _ in range(2):
                dilated_attention(qf, kf, vf, SEG, DIL, causal=True, impl="triton")
        assert len(seen) == 3 and not call_cache._ROUTES.entries
    # 64 rows is still decode-shaped, 65 rows is not; nor is a query as long as the keys
    for nq, nk, stored in ((64, 70, False), (65, 70, True), (40, 40, True)):
        call_cache.clear()
        q, k, v, _, _ = _inputs(nq, nk, 2, 2, 16, torch.float64, grad=False)
        with torch.no_grad():
            dilated_attention(q, k, v, SEG, DIL, impl="torch")
        assert bool(call_cache._ROUTES.entries) == stored, (nq, nk)
    # no tensors of the expected rank: the full path's errors, nothing stored
    call_cache.clear()
    for bad in (torch.randn(4), "q"):
        with pytest.raises((TypeError, ValueError)):
            dilated_attention(bad, k, v, SEG, DIL)
    assert not call_cache._ROUTES.entries


# ------------------------------------------------------------- the fused route: plans and switches

if HAS_TRITON:
    from dilated_attention.kernels import triton_launch as L
    from dilated_attention.kernels import triton_ops


@needs_triton
def test_fused_hit_reuses_the_plan_without_a_lookup(seed, monkeypatch):
    monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    looked = []
    real = L.get_plan
    monkeypatch.setattr(L, "get_plan", lambda *a, **kw: looked.append(1) or real(*a, **kw))
    x = _inputs(40, 40, 4, 2, 16, torch.float32)
    _call(*x, causal=True, impl="triton")
    assert len(looked) == 1  # the first forward's lookup; its backward used the plan in ctx
    _call(*x, causal=True, impl="triton")
    assert len(looked) == 1  # the hit: the route's plan memo


@needs_triton
def test_fused_routes_of_one_configuration_keep_their_own_plans(seed, monkeypatch):
    # the same branches, heads and options at two lengths and two strides: four keys, four
    # routes, each with the plan of its own layout (a plan sizes grids and strides)
    seen = _spy(monkeypatch)

    def make(n, transposed):
        q, k, v, do, _ = _inputs(n, n, 4, 2, 16, torch.float32)
        if transposed:
            q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        return q, k, v, do, None

    layouts = [(24, False), (21, False), (24, True), (21, True)]
    for n, t in layouts:  # four full calls, four routes stored
        _call(*make(n, t), causal=True, impl="triton", return_lse=True)
    assert len(seen) == len(layouts) == len(call_cache._ROUTES.entries)
    for n, t in layouts[::-1]:
        x = make(n, t)
        checks = len(seen)
        got = _call(*x, causal=True, impl="triton", return_lse=True)
        assert len(seen) == checks  # a hit
        saved = dict(call_cache._ROUTES.entries)
        call_cache.clear()
        _same(got, _call(*x, causal=True, impl="triton", return_lse=True))
        call_cache._ROUTES.entries.update(saved)
    assert len(call_cache._ROUTES.entries) == len(layouts)


@needs_triton
@pytest.mark.parametrize("switch", ["use_plans", "use_plans_in_backward", "lo_min_bytes", "table"])
def test_fused_hit_follows_the_plan_switches(seed, monkeypatch, switch):
    monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    seen = _spy(monkeypatch)
    x = _inputs(40, 40, 4, 2, 16, torch.float32)
    _call(*x, causal=True, impl="triton", return_lse=True)
    per_call, looked = [], []
    for name in ("forward_per_call", "backward_per_call"):
        real_pc = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, _r=real_pc, _n=name, **kw: per_call.append(_n) or _r(*a, **kw))
    real = L.get_plan
    monkeypatch.setattr(L, "get_plan", lambda *a, **kw: looked.append(1) or real(*a, **kw))
    if switch == "use_plans":
        monkeypatch.setattr(L, "USE_PLANS", False)
    elif switch == "lo_min_bytes":
        monkeypatch.setattr(L, "LO_MIN_BYTES", 0)
    elif switch == "table":
        monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    q, k, v, do, _ = _inputs(40, 40, 4, 2, 16, torch.float32)
    out, lse = dilated_attention(q, k, v, SEG, DIL, causal=True, impl="triton", return_lse=True)
    if switch == "use_plans_in_backward":  # switched off between the forward and the backward
        monkeypatch.setattr(L, "USE_PLANS", False)
    got = (out.detach(), lse, *torch.autograd.grad(out, (q, k, v), do))
    assert len(seen) == 1  # the front door's decisions still hold: a hit
    if switch == "use_plans":
        assert per_call == ["forward_per_call", "backward_per_call"] and not looked
    elif switch == "use_plans_in_backward":
        assert per_call == ["backward_per_call"] and not looked  # the forward's plan, not used
    else:
        assert len(looked) == 1 and not per_call  # a plan for the new knobs / in the new table
    call_cache.clear()
    _same(got, _call(q, k, v, do, None, causal=True, impl="triton", return_lse=True))


@needs_triton
def test_fused_hit_reads_the_direct_launch_switch_per_call(seed, monkeypatch):
    seen = _spy(monkeypatch)
    streams = []
    real = L.TrainPlan._stream
    monkeypatch.setattr(L.TrainPlan, "_stream", lambda self: streams.append(1) or real(self))
    x = _inputs(40, 40, 4, 2, 16, torch.float32)
    _call(*x, causal=True, impl="triton")
    try:
        for on in (False, True):
            flags.set_direct_launch(on)
            before, checks = len(streams), len(seen)
            x2 = _inputs(40, 40, 4, 2, 16, torch.float32)
            got = _call(*x2, causal=True, impl="triton")
            assert len(seen) == checks and len(streams) == before + 2  # a hit; forward and backward ask
            saved = dict(call_cache._ROUTES.entries)
            call_cache.clear()
            _same(got, _call(*x2, causal=True, impl="triton"))
            call_cache._ROUTES.entries.update(saved)
    finally:
        flags.set_direct_launch(None)


@needs_triton
def test_fused_call_unwraps_dead_functorch_wrappers(seed):
    leaked = []

    def f(x):
        leaked.append(x)
        return x.square().sum()

    q, k, v, _, _ = _inputs(40, 40, 4, 2, 16, torch.float32, grad=False)
    torch.func.grad(f)(q)
    dead = leaked[0]  # a GradTrackingTensor whose transform has finished
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    fc = triton_ops.FusedCall(SEG, DIL, [(0, 4), (0, 4)], True, 0.25)
    got, _ = triton_ops.fused_apply(dead, k, v, None, fc)
    want, _ = triton_ops.fused_apply(q, k, v, None, triton_ops.FusedCall(SEG, DIL, [(0, 4), (0, 4)], True, 0.25))
    assert torch.equal(got, want)


@needs_triton
def test_direct_apply_guards(monkeypatch):
    assert triton_ops.fused_apply is not triton_ops._EagerFused.apply  # this torch has the pieces
    monkeypatch.delattr(torch._C._functorch, "unwrap_if_dead")
    assert triton_ops._direct_apply() is None
    monkeypatch.undo()
    monkeypatch.setattr(triton_ops._EagerFused, "setup_context", staticmethod(lambda ctx, inputs, output: None))
    assert triton_ops._direct_apply() is None  # the wrapper would bind default arguments


@needs_triton
def test_fused_call_under_a_transform_goes_to_the_public_apply(seed, monkeypatch):
    public = []
    real = triton_ops._EagerFused.apply
    monkeypatch.setattr(triton_ops._EagerFused, "apply", lambda *a: public.append(1) or real(*a))
    q, k, v, _, _ = _inputs(40, 40, 4, 2, 16, torch.float32, grad=False)
    fc = triton_ops.FusedCall(SEG, DIL, [(0, 4), (0, 4)], True, 0.25)
    triton_ops.fused_apply(q, k, v, None, fc)
    assert not public
    with pytest.raises(RuntimeError, match="setup_context"):  # as before: no functorch rule
        torch.func.grad(lambda q: triton_ops.fused_apply(q, k, v, None, fc)[0].sum())(q)
    assert public == [1]


# --------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_hit_equals_full_path(seed, monkeypatch, dtype):
    """A hit (the stored route, its plan memo, the kept launchers) against the full path on the
    same fresh inputs, bit for bit: impl triton and torch, causal and not, GQA, padding."""
    for impl in ("triton", "torch", "auto"):
        for causal, pad, ha in ((True, False, "all"), (False, True, "split")):
            call_cache.clear()
            seen = _spy(monkeypatch)

            def make():
                q = torch.randn(2, 1000, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
                k, v = (torch.randn(2, 1000, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
                        for _ in range(2))  # fmt: skip
                do = torch.randn_like(q)
                kpm = (torch.rand(2, 1000, device="cuda") < 0.1) if pad else None
                return q, k, v, do, kpm

            kw = dict(seg=(128, 256, 512), dil=(1, 2, 4), causal=causal, impl=impl, head_assignment=ha,
                      return_lse=True)  # fmt: skip
            for _ in range(3):  # store; launchers collected; hit
                _call(*make(), **kw)
            x = make()
            got = _call(*x, **kw)
            assert len(seen) == 1, (impl, causal)
            call_cache.clear()
            _same(got, _call(*x, **kw))
            monkeypatch.undo()


@pytest.mark.cuda
def test_cuda_hit_reads_the_cudnn_switch(seed, monkeypatch):
    """The torch route reads flags.set_cudnn_attention at each block dispatch, hits included."""
    from dilated_attention.kernels import block_attention

    asked = []
    real = block_attention.cudnn_attention_enabled
    monkeypatch.setattr(block_attention, "cudnn_attention_enabled", lambda: asked.append(1) or real())
    q = torch.randn(1, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        dilated_attention(q, q, q, (256, 512), (1, 2), causal=True, impl="torch")
    n = len(asked)
    try:
        flags.set_cudnn_attention(False)
        got = dilated_attention(q, q, q, (256, 512), (1, 2), causal=True, impl="torch")
        assert len(asked) > n
        call_cache.clear()
        assert torch.equal(got, dilated_attention(q, q, q, (256, 512), (1, 2), causal=True, impl="torch"))
    finally:
        flags.set_cudnn_attention(None)
