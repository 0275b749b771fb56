"""The fast path of a repeated decode call (issue 23 item 2; decode.fast_key / fast_lookup).

Both front doors (``dilated_attention_with_kvcache`` and ``dilated_attention(q_one_row, k, v)``)
keep the Triton plan of a call that passed every check under a key of everything the checks and
decisions read, and run it at once on the next call with an equal key. These tests check that a
hit gives the full path's bits, that a call differing in any keyed property (shape, stride,
dtype, branch lists, options, index tensors) never reuses a stale plan, that what may change
between equal keys (gradients, the direct-launch switch, autocast, the branch lists' element
types) is checked per call, and that every error of the full path is still raised after a hit.
On the CPU the plans launch through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import api, decode, dilated_attention, flags
from dilated_attention.decode import dilated_attention_with_kvcache, triton_unavailable_reason

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEG, DIL = [8, 16], [1, 2]


@pytest.fixture(autouse=True)
def _fresh():
    if triton_unavailable_reason(torch.empty(1, 1, 1, 16, device=DEV)) is not None:
        pytest.skip("triton decode unavailable")
    flags.set_direct_launch(True)
    decode._FAST.clear()
    yield
    decode._FAST.clear()
    flags.set_direct_launch(None)


def _inputs(b=1, nq=1, h=4, hkv=2, d=16, c=40, dtype=torch.float32):
    q = torch.randn(b, nq, h, d, dtype=dtype, device=DEV)
    k = torch.randn(b, c, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, c, hkv, d, dtype=dtype, device=DEV)
    return q, k, v, torch.full((b,), c - 3, dtype=torch.int32, device=DEV)


def _kv(q, k, v, sl, seg=SEG, dil=DIL, **kw):
    kw = {"causal": True, "return_lse": True, "impl": "triton", **kw}
    return dilated_attention_with_kvcache(q, k, v, sl, seg, dil, **kw)


def _da(q, k, v, seg=SEG, dil=DIL, **kw):
    kw = {"causal": True, "return_lse": True, "impl": "triton", **kw}
    return dilated_attention(q, k, v, seg, dil, **kw)


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert torch.equal(x, y)


def _spy_checks(monkeypatch):
    """Count the full path's checks of both routes (a fast hit runs neither)."""
    seen = []
    kv_check, describe = decode._check, api.describe_call
    monkeypatch.setattr(decode, "_check", lambda *a: seen.append("kv") or kv_check(*a))
    monkeypatch.setattr(api, "describe_call", lambda *a, **kw: seen.append("da") or describe(*a, **kw))
    return seen


def _full_path(fn):
    """``fn()`` through the full path (no stored plan), leaving no entry behind."""
    decode._FAST.clear()
    flags.set_direct_launch(True)
    out = fn()
    decode._FAST.clear()
    return out


# ------------------------------------------------------------------------------ hits


@pytest.mark.parametrize("route", ["kv", "da"])
@pytest.mark.parametrize("return_lse", [True, False])
def test_repeated_call_hits_and_gives_the_full_paths_bits(seed, monkeypatch, route, return_lse):
    q, k, v, sl = _inputs()
    fn = (lambda: _kv(q, k, v, sl, return_lse=return_lse)) if route == "kv" else (lambda: _da(q, k, v, return_lse=return_lse))
    seen = _spy_checks(monkeypatch)
    first = fn()
    assert seen == [route] and len(decode._FAST) == 1
    again = [fn() for _ in range(3)]
    assert seen == [route]  # no check re-run: the stored plan ran
    for g in again:
        _same(g, first)
    # and the per-call path (Triton's own launch, buffers built per call) gives the same bits
    flags.set_direct_launch(False)
    _same(fn(), first)
    flags.set_direct_launch(True)
    # new data, same configuration: still a hit, the result of the new data
    q.copy_(torch.randn_like(q))
    got = fn()
    assert seen == [route, route]  # the switch-off call took the full path; this one is a hit
    _same(got, _full_path(fn))
    # new tensors (other storage), same configuration: a hit that reads the new tensors
    fn()  # stores the entry again (_full_path left none)
    q2, k2, v2, sl2 = _inputs()
    sl2.fill_(30)
    fn2 = (lambda: _kv(q2, k2, v2, sl2, return_lse=return_lse)) if route == "kv" else (lambda: _da(q2, k2, v2, return_lse=return_lse))
    n = len(seen)
    got2 = fn2()
    assert len(seen) == n
    _same(got2, _full_path(fn2))
    assert not torch.equal(got2[0] if return_lse else got2, got[0] if return_lse else got)


def test_routes_and_index_tensors_are_separate_entries(seed):
    q, k, v, sl = _inputs(b=2)
    lp = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    _kv(q, k, v, sl)
    _kv(q, k, v, sl, cache_leftpad=lp)
    _da(q, k, v)
    assert len(decode._FAST) == 3
    _same(_kv(q, k, v, sl, cache_leftpad=lp), _full_path(lambda: _kv(q, k, v, sl, cache_leftpad=lp)))
    _same(_da(q, k, v), _full_path(lambda: _da(q, k, v)))


def _variants():
    """(name, kwargs for _inputs, call kwargs) that differ from the base call in one keyed property."""
    return [
        ("batch", dict(b=2), {}),
        ("rows", dict(nq=2), {}),
        ("heads", dict(h=8), {}),
        ("kv heads", dict(hkv=4), {}),
        ("headdim", dict(d=32), {}),
        ("cache length", dict(c=48), {}),
        ("dtype", dict(dtype=torch.float16), {}),
        ("segments", {}, dict(seg=[8, 24])),
        ("rates", {}, dict(dil=[1, 4])),
        ("branch count", {}, dict(seg=[8, 16, 32], dil=[1, 2, 4])),
        ("causal", {}, dict(causal=False)),
        ("scale", {}, dict(softmax_scale=0.125)),
        ("head assignment", {}, dict(head_assignment="split")),
    ]


@pytest.mark.parametrize("route", ["kv", "da"])
@pytest.mark.parametrize("name,shape_kw,call_kw", _variants(), ids=[v[0] for v in _variants()])
def test_a_changed_configuration_never_reuses_a_stale_plan(seed, route, name, shape_kw, call_kw):
    base = _inputs()
    var = _inputs(**shape_kw)
    call = _kv if route == "kv" else _da

    def run(inp):
        q, k, v, sl = inp
        return call(q, k, v, sl, **call_kw) if route == "kv" else call(q, k, v, **call_kw)

    want = _full_path(lambda: run(var))
    (call(*base) if route == "kv" else call(*base[:3]))  # the base entry
    assert len(decode._FAST) == 1
    _same(run(var), want)
    assert len(decode._FAST) == 2  # its own entry
    _same(run(var), want)  # and its own hit


@pytest.mark.parametrize("route", ["kv", "da"])
@pytest.mark.parametrize("which", ["q", "k", "v", "k odd", "v odd"])
def test_a_changed_stride_never_reuses_a_stale_plan(seed, route, which):
    # q's strides are in the key; the caches' strides only by their specialisation class (the
    # plan passes them per call): every head of a twice wider buffer keeps the classes (one
    # entry), a headdim padded to 17 changes them (its own entry); equal bits either way
    q, k, v, sl = _inputs(b=2, c=40)
    name = which.split()[0]
    t = {"q": q, "k": k, "v": v}[name]
    if which.endswith("odd"):
        big = t.new_zeros(t.shape[0], t.shape[1], t.shape[2], t.shape[3] + 1)
        view = big[..., : t.shape[3]]
    else:
        big = t.new_zeros(t.shape[0], t.shape[1], t.shape[2] * 2, t.shape[3])
        view = big[:, :, ::2]
    view.copy_(t)  # same values, other strides
    strided = {"q": q, "k": k, "v": v, name: view}
    args = (strided["q"], strided["k"], strided["v"])

    def run(a):
        return _kv(*a, sl) if route == "kv" else _da(*a)

    want = _full_path(lambda: run((q, k, v)))
    run((q, k, v))
    _same(run(args), want)  # equal values: equal bits
    assert len(decode._FAST) == (1 if which in ("k", "v") else 2)
    _same(run(args), want)  # and again through the entry


def test_changed_index_tensors_never_reuse_a_stale_plan(seed):
    q, k, v, sl = _inputs(b=2)
    _kv(q, k, v, sl)
    # a leftpad now given
    lp = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    _same(_kv(q, k, v, sl, cache_leftpad=lp), _full_path(lambda: _kv(q, k, v, sl, cache_leftpad=lp)))
    # a strided cache_seqlens (a column of a table): copied by the full path, never keyed
    table = torch.stack([sl, sl * 0], dim=1)
    n = len(decode._FAST)
    _same(_kv(q, k, v, table[:, 0]), _full_path(lambda: _kv(q, k, v, sl)))
    assert len(decode._FAST) == n
    # an int length: the full path (a fresh tensor per call), no entry
    _same(_kv(q, k, v, 37), _full_path(lambda: _kv(q, k, v, sl)))
    assert len(decode._FAST) == n


# ------------------------------------------------------------------------------ per-call conditions


def test_direct_launch_switch_is_read_per_call(seed, monkeypatch):
    from dilated_attention.kernels import triton_decode as td

    q, k, v, sl = _inputs()
    calls = []
    orig = td.decode_triton_jit
    monkeypatch.setattr(td, "decode_triton_jit", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    first = (_kv(q, k, v, sl), _da(q, k, v))
    flags.set_direct_launch(False)
    second = (_kv(q, k, v, sl), _da(q, k, v))
    assert len(calls) == 2  # both took the per-call path despite their stored plans
    for a, b in zip(first, second, strict=True):
        _same(a, b)


def test_gradients_take_the_full_path(seed):
    q, k, v, sl = _inputs()
    _kv(q, k, v, sl)
    _da(q, k, v)
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="inference only"):
        _kv(qg, k, v, sl)
    # dilated_attention with a gradient needed: the training path (autograd), not the decode plan
    out = dilated_attention(qg, k, v, SEG, DIL, causal=True, impl="torch")
    assert out.grad_fn is not None
    with torch.no_grad():  # no gradient needed: the plan again
        _same(_kv(qg, k, v, sl), _kv(q, k, v, sl))


def test_autocast_takes_the_full_path(seed):
    q, k, v, _ = _inputs()
    _da(q, k, v)
    # bf16 on CUDA; fp16 under the interpreter, which refuses bf16 attention (test_frontdoor.py)
    dt = torch.float16 if DEV == "cpu" else torch.bfloat16
    with torch.autocast(DEV, dtype=dt):
        got = _da(q, k, v)
    assert got[0].dtype == dt
    _same(got, _full_path(lambda: _da(q.to(dt), k.to(dt), v.to(dt))))


def test_an_evicted_plan_still_serves_its_entry(seed, monkeypatch):
    from dilated_attention.kernels import triton_decode as td

    monkeypatch.setattr(td, "_MAX_PLANS", 1)
    td._PLANS.clear()
    q, k, v, sl = _inputs()
    first = _kv(q, k, v, sl)
    _kv(q, k, v, sl, softmax_scale=0.2)  # evicts the first plan from the (bounded) table
    assert len(td._PLANS) == 1 and len(decode._FAST) == 2
    _same(_kv(q, k, v, sl), first)


def test_clearing_the_plans_clears_the_entries(seed):
    from dilated_attention.kernels import triton_decode as td

    q, k, v, sl = _inputs()
    _kv(q, k, v, sl)
    _da(q, k, v)
    assert len(decode._FAST) == 2
    td._PLANS.clear()
    assert not decode._FAST
    _kv(q, k, v, sl)
    assert len(td._PLANS) == 1 and len(decode._FAST) == 1


def test_entries_are_bounded(seed, monkeypatch):
    monkeypatch.setattr(decode, "_MAX_FAST", 2)
    q, k, v, sl = _inputs()
    for scale in (0.1, 0.2, 0.3):
        _kv(q, k, v, sl, softmax_scale=scale)
    assert len(decode._FAST) <= 2


# ------------------------------------------------------------------------------ errors after a hit


def _kv_errors(q, k, v, sl):
    qg = q.clone().requires_grad_()
    return [
        (TypeError, "causal must be a bool", lambda: _kv(q, k, v, sl, causal=1)),
        (TypeError, "softmax_scale must be a real number", lambda: _kv(q, k, v, sl, softmax_scale=True)),
        (ValueError, "softmax_scale must be a finite", lambda: _kv(q, k, v, sl, softmax_scale=float("nan"))),
        (Exception, None, lambda: _kv(q, k, v, sl, seg=[8.0, 16])),
        (Exception, None, lambda: _kv(q, k, v, sl, dil=[True, 2])),
        (Exception, None, lambda: _kv(q, k, v, sl, seg=[[8], 16])),
        (ValueError, "impl must be one of", lambda: _kv(q, k, v, sl, impl="reference")),
        (ValueError, "head_assignment", lambda: _kv(q, k, v, sl, head_assignment="none")),
        (ValueError, "inference only", lambda: _kv(qg, k, v, sl)),
        (ValueError, "int32 tensor", lambda: _kv(q, k, v, sl.long())),
        (ValueError, "int32 tensor", lambda: _kv(q, k, v, sl[:0])),
        (ValueError, "int32 tensor", lambda: _kv(q, k, v, sl, cache_leftpad=sl.long())),
        (TypeError, "cache_leftpad must be None", lambda: _kv(q, k, v, sl, cache_leftpad=3)),
        (TypeError, "share a dtype", lambda: _kv(q, k.double(), v, sl)),
        (ValueError, "k_cache and v_cache must have the same shape", lambda: _kv(q, k, v[:, :-1], sl)),
        (ValueError, "head dims differ: q 16, k_cache 8", lambda: _kv(q, k[:, :, :, :8], v[:, :, :, :8], sl)),
        (ValueError, "multiple of", lambda: _kv(q[:, :, :3], k, v, sl)),
        (TypeError, "must be a torch.Tensor", lambda: _kv(q.numpy() if DEV == "cpu" else None, k, v, sl)),
    ]


def _da_errors(q, k, v):
    return [
        (TypeError, "causal must be a bool", lambda: _da(q, k, v, causal=1)),
        (TypeError, "return_lse must be a bool", lambda: _da(q, k, v, return_lse=1)),
        (TypeError, "softmax_scale must be a real number", lambda: _da(q, k, v, softmax_scale=True)),
        (Exception, None, lambda: _da(q, k, v, seg=[8.0, 16])),
        (Exception, None, lambda: _da(q, k, v, dil=[True, 2])),
        (ValueError, "impl must be one of", lambda: _da(q, k, v, impl="fast")),
        (ValueError, "head_assignment", lambda: _da(q, k, v, head_assignment="none")),
        (ValueError, "dropout_p must be in", lambda: _da(q, k, v, dropout_p=1.5)),
        (TypeError, "dropout_p must be a real number", lambda: _da(q, k, v, dropout_p=False)),
        (TypeError, "key_padding_mask must be a bool tensor", lambda: _da(q, k, v, key_padding_mask=torch.zeros(1, k.shape[1], device=DEV))),
        (TypeError, "share a dtype", lambda: _da(q, k.double(), v)),
        (ValueError, "same shape", lambda: _da(q, k, v[:, :-1])),
        (ValueError, "head dims differ", lambda: _da(q, k[..., :8], v[..., :8])),
        (ValueError, "multiple of nheads_kv", lambda: _da(q[:, :, :3], k, v)),
    ]


@pytest.mark.parametrize("route", ["kv", "da"])
def test_every_error_is_still_raised_after_a_hit(seed, route):
    q, k, v, sl = _inputs()
    cases = _kv_errors(q, k, v, sl) if route == "kv" else _da_errors(q, k, v)
    want = []
    for exc, match, fn in cases:  # the errors of the full path, with no entry stored
        decode._FAST.clear()
        with pytest.raises(exc, match=match) as e:
            fn()
        want.append((type(e.value), str(e.value)))
    decode._FAST.clear()
    for _ in range(2):  # an entry of the valid call, then a hit
        _kv(q, k, v, sl) if route == "kv" else _da(q, k, v)
    for (exc, match, fn), (t, msg) in zip(cases, want, strict=True):
        with pytest.raises(exc, match=match) as e:
            fn()
        assert (type(e.value), str(e.value)) == (t, msg)


@pytest.mark.parametrize("route", ["kv", "da"])
def test_a_branch_list_changed_in_place_is_checked_again(seed, route):
    q, k, v, sl = _inputs()
    seg = list(SEG)
    run = (lambda s: _kv(q, k, v, sl, seg=s)) if route == "kv" else (lambda s: _da(q, k, v, seg=s))
    run(seg)
    run(seg)
    seg[0] = 8.0  # equal and hashing alike, but refused by the full path
    with pytest.raises((TypeError, ValueError)):
        run(seg)
    seg[0] = 8
    run(seg)
    # a tuple is immutable: the same object is not checked again, an equal new one is
    tup = tuple(SEG)
    run(tup)
    run(tup)
    with pytest.raises((TypeError, ValueError)):
        run((8.0, 16))


@pytest.mark.parametrize("route", ["kv", "da"])
def test_a_stored_entry_is_never_used_under_compile(seed, route):
    # eager calls store the plan; the same configuration compiled with fullgraph=True must trace
    # the custom op (a plan run in the graph would be a graph break: fullgraph raises)
    q, k, v, sl = _inputs()

    def step(q, k, v, sl):
        if route == "kv":
            return dilated_attention_with_kvcache(q, k, v, sl, SEG, DIL, causal=True, impl="triton")
        return dilated_attention(q, k, v, SEG, DIL, causal=True, impl="triton")

    with torch.no_grad():
        want = step(q, k, v, sl)
        step(q, k, v, sl)
        assert len(decode._FAST) == 1
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")(q, k, v, sl)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_training_shaped_calls_build_no_key():
    """Only a decode-shaped dilated_attention call (a few rows against more keys) builds a fast-path
    key: a training or prefill call pays no key and no miss."""
    from dilated_attention.decode import fast_key

    def key(nq, nk):
        q = torch.randn(1, nq, 2, 8)
        kv = torch.randn(1, nk, 2, 8)
        return fast_key("da", q, kv, kv, (4, 8), (1, 2), False, None, "all", "auto")

    assert key(1, 64) is not None and key(64, 65) is not None
    assert key(64, 64) is None and key(65, 200) is None and key(128, 128) is None


# ------------------------------------------------------------------------------ exact key first, class key on a miss


@pytest.mark.parametrize("route", ["kv", "da"])
def test_exact_key_first_then_the_class_key_of_a_growing_cache(seed, monkeypatch, route):
    # a steady call finds its entry by exact key and never computes the class key; a cache
    # that grows (a view of one buffer, then fresh tensors whose batch stride grows too) misses
    # the exact key on every step and finds the same entry by class key: no full path, no new
    # entry, the per-call path's bits; a length of another class (32) gets its own entry
    seen = _spy_checks(monkeypatch)
    classes = []
    orig = decode._class_key
    monkeypatch.setattr(decode, "_class_key", lambda key: classes.append(1) or orig(key))
    q = torch.randn(2, 1, 4, 16, device=DEV)
    kb, vb = torch.randn(2, 40, 2, 16, device=DEV), torch.randn(2, 40, 2, 16, device=DEV)
    lens = torch.tensor([17, 12], dtype=torch.int32, device=DEV)

    def run(k, v):
        return _kv(q, k, v, lens) if route == "kv" else _da(q, k, v)

    def per_call(k, v):
        flags.set_direct_launch(False)
        try:
            return run(k, v)
        finally:
            flags.set_direct_launch(True)

    first = run(kb[:, :20], vb[:, :20])  # the class key twice: the lookup's (a miss), then the store's
    assert seen == [route] and len(decode._FAST) == len(decode._FAST_CLASS) == 1 and len(classes) == 2
    entry = next(iter(decode._FAST.values()))
    assert next(iter(decode._FAST_CLASS.values())) is entry
    for _ in range(3):  # steady: the exact key
        _same(run(kb[:, :20], vb[:, :20]), first)
    assert seen == [route] and len(classes) == 2
    steps = [(kb[:, :n], vb[:, :n]) for n in (21, 22, 23)]
    steps += [(torch.randn(2, n, 2, 16, device=DEV), torch.randn(2, n, 2, 16, device=DEV)) for n in (24, 25)]
    for k, v in steps:
        n_seen, n_classes = len(seen), len(classes)
        got = run(k, v)
        assert len(seen) == n_seen and len(classes) == n_classes + 1, k.shape[1]  # the class key, after the exact miss
        assert len(decode._FAST) == len(decode._FAST_CLASS) == 1  # no entry per step
        _same(got, per_call(k, v))  # (the full path: the switch off)
    _same(run(kb[:, :32], vb[:, :32]), per_call(kb[:, :32], vb[:, :32]))  # another class: its own entry
    assert len(decode._FAST) == len(decode._FAST_CLASS) == 2
    assert next(iter(decode._FAST.values())) is entry


def test_a_class_key_needs_one_shape_for_k_and_v(seed):
    # the class key leaves the lengths out: k and v of different lengths get none (the full
    # path raises), even where an entry of their classes exists
    q, k, v, sl = _inputs(c=40)
    _kv(q, k, v, sl)
    key = decode.fast_key("kv", q, k, v[:, :39], SEG, DIL, True, None, "all", "triton", None)
    assert key is not None and decode._class_key(key) is None
    with pytest.raises(ValueError, match="must have the same shape"):
        _kv(q, k, v[:, :39], sl)


# ------------------------------------------------------------------------------ the host work of a hit


class _Launches:
    """Stands in for Triton 3.6's C launch (grid, stream, function, ..., the kernel arguments):
    counts the launches, calling no other function (the profile below counts every call)."""

    def __init__(self):
        self.n = 0

    def __call__(self, *a):
        self.n += 1


@pytest.fixture
def _drop_plans():
    """Drop every decode plan after the test (:func:`_arm` changes the plans it finds)."""
    from dilated_attention.kernels import triton_decode as td

    yield
    td._PLANS.clear()  # and the fast path's entries


def _arm(monkeypatch, dev_index: int):
    """Stand-in launches for the plans of this process (CPU tensors posing as a GPU's, as
    benchmarks/host_cost_decode_cpu.py does): returns the list of launches. With the fixture
    ``_drop_plans``: the plans are dropped after the test."""
    from dilated_attention.kernels import direct_launch
    from dilated_attention.kernels import triton_decode as td

    launches = _Launches()
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 5)
    monkeypatch.setattr(direct_launch, "capturing", lambda: False)
    monkeypatch.setattr(direct_launch, "current_device", lambda: dev_index)  # the plans' device (-1: the CPU)
    monkeypatch.setattr(td, "_WORKSPACES", {})
    form = (launches, (1, 1, 1), (None,) * 9)
    for plan in td._PLANS.values():
        plan.cuda = True
        plan._keep_launchers(form, form)
    return launches


def _profile(fn):
    """The names of the Python and C functions ``fn()`` calls, in order."""
    import sys

    names = []

    def prof(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)
        elif event == "c_call":
            names.append(getattr(arg, "__name__", repr(arg)))

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names[:-1]  # not setprofile itself


@pytest.mark.parametrize("route", ["kv", "da"])
def test_a_repeated_call_runs_its_plan_and_nothing_else(seed, monkeypatch, route, _drop_plans):
    # the host work of a repeated decode call (issue 23 item 2: the GPU machine's host is slow,
    # every call counts): the stored plan's two launches and no function of the full path; the
    # number of Python and C function calls is the figure that carries over to that host
    q, k, v, sl = _inputs()
    fn = (lambda: _kv(q, k, v, sl, return_lse=False)) if route == "kv" else (lambda: _da(q, k, v, return_lse=False))
    with torch.no_grad():
        fn()
        launches = _arm(monkeypatch, q.get_device())
        fn()  # takes the workspace of the stand-in stream
        names = _profile(fn)
    assert launches.n == 4  # two calls, two launches each
    names = names[names.index("dilated_attention_with_kvcache" if route == "kv" else "dilated_attention") :]
    full_path = {"_check", "describe_call", "decode_core", "decode_triton", "plan_key", "get_plan", "run",
                 "_class_key", "cache_classes", "normalize_branches", "pick_decode_impl", "pick_impl",
                 "_eager_workspace", "_workspace", "_launch_jit", "_run_jit"}  # fmt: skip
    assert not full_path & set(names), names
    assert names.count("launch") == 1 and names.count("__call__") == 2, names  # DecodePlan.launch, both kernels
    assert names.count("empty_like") == 1 and names.count("data_ptr") == 5 - (route == "da"), names
    # 41 per call before (benchmarks/results/profile_host_h100_2026-11-26.md); here the three
    # CUDA state queries are Python stand-ins, on a GPU they are C calls: the same count. The
    # "da" route: api.py calls decode.fast_call (as the "kv" front door does), one frame more
    assert len(names) <= {"kv": 25, "da": 26}[route], (len(names), names)


def test_outputs_of_repeated_calls_are_never_aliased(seed):
    # the workspace is reused per stream; outputs never are: a kept output is not overwritten by
    # the next call with other data
    q, k, v, sl = _inputs()
    first = _kv(q, k, v, sl, return_lse=False)
    keep = first.clone()
    q2 = torch.randn_like(q)
    second = _kv(q2, k, v, sl, return_lse=False)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, keep) and not torch.equal(second, first)
    third = _da(q, k, v, return_lse=False)
    assert torch.equal(first, keep) and third.data_ptr() not in (first.data_ptr(), second.data_ptr())
