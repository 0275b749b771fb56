"""A cache that grows by one token per decode step keeps its plan (issue 23 item 2).

Callers that pass a growing cache (a view ``k[:, :filled]`` of one buffer, as
``integrations/hf.py``'s plain decode step does; a fresh ``torch.cat`` per step, as Hugging
Face's dynamic cache does, also in its ``(batch, heads, seq, dim)`` layout) change the cache
length, and maybe the caches' strides, on every step. The decode plans
(``kernels/triton_decode.py``) and the fast path of both front doors (``decode.py``) key on the
Triton specialisation classes of those integers (``direct_launch.cache_classes``), never on their
values, which the plan passes per call: one plan, one fast-path entry and, on a GPU, one compiled
binary per class. These tests check, step by step, the per-call path's bits (the direct-launch
switch off: every argument built on the call, Triton's own launch) and the reference, and count
the plans and the calls that missed the fast path. On the CPU the plans launch through Triton's
interpreter; the CUDA test runs the compiled binaries through their launchers.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import api, decode, dilated_attention, flags
from dilated_attention.decode import dilated_attention_with_kvcache, triton_unavailable_reason
from dilated_attention.kernels import direct_launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEG, DIL = [8, 12, 16], [1, 3, 2]  # segment boundaries at multiples of 8, 12 and 16


def _td():
    if triton_unavailable_reason(torch.empty(1, 1, 1, 16, device=DEV)) is not None:
        pytest.skip("triton decode unavailable")
    from dilated_attention.kernels import triton_decode

    return triton_decode


@pytest.fixture(autouse=True)
def _fresh():
    td = _td()
    flags.set_direct_launch(True)
    td._PLANS.clear()  # clears decode._FAST too
    yield
    td._PLANS.clear()
    flags.set_direct_launch(None)


def _growing(growth: str, b: int, hkv: int, d: int, lengths, dtype=torch.float32):
    """(n, k, v) for each n of ``lengths`` (consecutive): the cache as the caller passes it."""
    n0, n1 = lengths[0], lengths[-1]
    if growth == "view":  # one buffer, sliced
        kb = torch.randn(b, n1 + 5, hkv, d, dtype=dtype, device=DEV)
        vb = torch.randn(b, n1 + 5, hkv, d, dtype=dtype, device=DEV)
        for n in lengths:
            yield n, kb[:, :n], vb[:, :n]
        return
    # a fresh tensor per step: (b, n, hkv, d) ("cat"), or transformers' (b, hkv, n, d) seen
    # through the library's layout ("hf": k = key.transpose(1, 2), the head stride grows)
    dim = 1 if growth == "cat" else 2
    shape = [b, n0, hkv, d] if growth == "cat" else [b, hkv, n0, d]
    k = torch.randn(*shape, dtype=dtype, device=DEV)
    v = torch.randn(*shape, dtype=dtype, device=DEV)
    for n in lengths:
        if n > n0:
            shape[dim] = 1
            k = torch.cat([k, torch.randn(*shape, dtype=dtype, device=DEV)], dim=dim)
            v = torch.cat([v, torch.randn(*shape, dtype=dtype, device=DEV)], dim=dim)
        yield (n, k, v) if growth == "cat" else (n, k.transpose(1, 2), v.transpose(1, 2))


def _call(route, q, k, v, lens, causal):
    if route == "kv":
        return dilated_attention_with_kvcache(q, k, v, lens, SEG, DIL, causal=causal, impl="triton", return_lse=True)
    return dilated_attention(q, k, v, SEG, DIL, causal=causal, impl="triton", return_lse=True)


def _per_call_path(route, q, k, v, lens, causal):
    """The same call with the direct-launch switch off: no plan, no fast-path entry, every
    argument built on this call (``triton_decode.decode_triton_jit``)."""
    flags.set_direct_launch(False)
    try:
        return _call(route, q, k, v, lens, causal)
    finally:
        flags.set_direct_launch(True)


def _reference(q, k, v, lens, causal):
    """Row b's new rows are the last of its first ``lens[b]`` positions (float64 reference)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(lens[b])
        o, lse = dilated_attention(
            q[b : b + 1].double(), k[b : b + 1, :n].double(), v[b : b + 1, :n].double(), SEG, DIL,
            causal=causal, impl="reference", return_lse=True,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _count_full_path(monkeypatch):
    """A list that gets one entry per call that misses the fast path (runs ``decode_core``)."""
    seen = []
    orig = decode.decode_core

    def spy(*a, **kw):
        seen.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(decode, "decode_core", spy)
    monkeypatch.setattr(api, "decode_core", spy)
    return seen


@pytest.mark.parametrize(
    "route,growth",
    [("da", "view"), ("da", "cat"), ("da", "hf"), ("kv", "view"), ("kv", "cat")],
)
def test_growing_cache_keeps_its_plan_and_its_bits(seed, monkeypatch, route, growth):
    # 4 query heads on 2 kv heads; one new row per step; causal on even lengths, off on odd ones
    # (two configurations interleaved, as two layers would); the "da" route runs lengths 24..35
    # (across 32 and the segment boundaries 24 and 32), the kv route 1..17 (from a cache of one
    # slot, the class of the value 1, across 16) with rows of lengths n and max(n - 3, 1)
    td = _td()
    b, h, hkv, d = 2, 4, 2, 16
    lengths = range(24, 36) if route == "da" else range(1, 18)
    misses = _count_full_path(monkeypatch)
    configs, n_miss = set(), 0
    for n, k, v in _growing(growth, b, hkv, d, lengths):
        assert k.shape == (b, n, hkv, d)
        causal = n % 2 == 0
        q = torch.randn(b, 1, h, d, device=DEV)
        lens = torch.tensor([n, max(n - 3, 1)], dtype=torch.int32, device=DEV) if route == "kv" else None
        configs.add((causal, direct_launch.cache_classes(k.shape[1], k.stride(), v.stride())))
        before = len(misses)
        got = _call(route, q, k, v, lens, causal)
        n_miss += len(misses) - before
        want = _per_call_path(route, q, k, v, lens, causal)
        assert torch.equal(got[0], want[0]), n
        assert torch.equal(got[1], want[1]), n
        ref = _reference(q, k, v, lens if lens is not None else torch.full((b,), n), causal)
        torch.testing.assert_close(got[0].double(), ref[0], atol=2e-5, rtol=0)
        torch.testing.assert_close(got[1].double(), ref[1].double(), atol=2e-5, rtol=0)
    # one plan and one fast-path entry per (causal, classes), each built by the first call of its
    # class; every other step ran the stored plan at once. The classes differ only by the
    # length (headdim 16: every stride of these layouts is a multiple of 16): "da" has odd
    # lengths (not causal) and even ones, 32 among them (causal); "kv" 1 and 16 among them
    assert len(configs) == (3 if route == "da" else 4)
    assert len(td._PLANS) == len(configs)
    assert len(decode._FAST) == len(configs)
    assert n_miss == len(configs)


def test_forty_steps_build_one_plan_per_class(seed, monkeypatch):
    # the count the issue is about: 40 steps of a view growing from 20 to 59 tokens, one
    # configuration (lengths 32 and 48 are multiples of 16: the second class)
    td = _td()
    kb = torch.randn(1, 64, 2, 16, device=DEV)
    vb = torch.randn(1, 64, 2, 16, device=DEV)
    q = torch.randn(1, 1, 4, 16, device=DEV)
    built = []
    orig = td.DecodePlan.__init__

    def counting(self, *a, **kw):
        built.append(1)
        orig(self, *a, **kw)

    monkeypatch.setattr(td.DecodePlan, "__init__", counting)
    with torch.no_grad():
        outs = [dilated_attention(q, kb[:, :n], vb[:, :n], SEG, DIL, causal=True, impl="triton") for n in range(20, 60)]
    assert len(built) == 2 and len(td._PLANS) == 2 and len(decode._FAST) == 2
    for n in (20, 31, 32, 33, 48, 59):  # spot checks against the per-call path
        want = _per_call_path("da", q, kb[:, :n], vb[:, :n], None, True)[0]
        assert torch.equal(outs[n - 20], want), n


@pytest.mark.parametrize("route", ["da", "kv"])
def test_a_change_that_needs_another_binary_gets_another_plan(seed, route):
    # after a configuration has its plan and fast-path entry, each change below needs another
    # binary: it must build its own plan (never run the stored one) and give the per-call
    # path's bits; the first configuration then still gives its own bits
    td = _td()
    b, h, hkv = 2, 4, 2

    def case(d=16, n=22, dtype=torch.float32, pad=0, causal=True, seg=SEG, dil=DIL):
        q = torch.randn(b, 1, h, d, dtype=dtype, device=DEV)
        k = torch.randn(b, n, hkv, d + pad, dtype=dtype, device=DEV)[..., :d]
        v = torch.randn(b, n, hkv, d + pad, dtype=dtype, device=DEV)[..., :d]
        lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
        return q, k, v, lens, causal, seg, dil

    def run(q, k, v, lens, causal, seg, dil):
        if route == "kv":
            return dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=causal, impl="triton", return_lse=True)
        return dilated_attention(q, k, v, seg, dil, causal=causal, impl="triton", return_lse=True)

    def per_call(*a):
        flags.set_direct_launch(False)
        try:
            return run(*a)
        finally:
            flags.set_direct_launch(True)

    base = case()
    run(*base)
    run(*base)
    assert len(td._PLANS) == 1
    variants = {
        "fp16": case(dtype=torch.float16),
        "headdim 32": case(d=32),
        "branch lists": case(seg=[8, 16], dil=[1, 2]),
        "not causal": case(causal=False),
        "length % 16 == 0": case(n=32),
        "stride class (headdim padded to 17)": case(pad=1),
    }
    if route == "kv":
        variants["length 1 (a constant)"] = case(n=1)
    for i, (name, args) in enumerate(variants.items()):
        got = run(*args)
        assert len(td._PLANS) == 2 + i, name  # its own plan
        want = per_call(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        got = run(*args)  # and its own entry
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    assert len(decode._FAST) == 1 + len(variants)
    got, want = run(*base), per_call(*base)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _triton_specialisation(x: int):
    """Triton's own specialisation of a plain int kernel argument, or None where this Triton
    does not expose it the way 3.9 does."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except Exception:  # noqa: BLE001 - another Triton: the test skips
        return None
    return native_specialize_impl(BaseBackend, x, False, True, True)


def test_int_class_is_tritons_specialisation():
    # two values share a class exactly when Triton compiles them into the same binary
    values = [0, 1, 2, 3, 15, 16, 17, 31, 32, 48, 1000, 1024, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1,
              2**31 + 16, 2**40, 2**40 + 3, 2**62]  # fmt: skip
    spec = [_triton_specialisation(x) for x in values]
    if any(s is None for s in spec):
        pytest.skip("this Triton does not expose native_specialize_impl")
    cls = [direct_launch.int_class(x) for x in values]
    for i in range(len(values)):
        for j in range(len(values)):
            assert (cls[i] == cls[j]) == (spec[i] == spec[j]), (values[i], values[j], spec[i], spec[j])


# ------------------------------------------------------------------------------ GPU


@pytest.mark.cuda
def test_cuda_growing_cache_direct_launch_equals_triton_launch():
    # on the GPU: a cache growing one token per step through both front doors (views of a
    # buffer, fresh cats, transformers' layout), causal and not, bf16 and fp32, LongNet-like
    # branches: the direct launch of the class's binaries equals Triton's own launch bit for bit
    # on every step, one plan per class, and each plan found its launchers
    td = _td()
    seg, dil = [512, 1024, 2048], [1, 2, 4]
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, hkv, d = 2, 32, 8, 128
    for dt in (torch.bfloat16, torch.float32):
        for growth in ("view", "cat", "hf"):
            for route in ("da", "kv"):
                for causal in (True, False):
                    td._PLANS.clear()
                    classes = set()
                    for n, k, v in _growing(growth, b, hkv, d, range(3000, 3040), dtype=dt):
                        q = torch.randn(b, 1, h, d, dtype=dt, device="cuda", generator=g)
                        lens = torch.tensor([n, n - 5], dtype=torch.int32, device="cuda")
                        classes.add(direct_launch.cache_classes(k.shape[1], k.stride(), v.stride()))

                        def call(q=q, k=k, v=v, lens=lens, route=route, causal=causal):
                            if route == "kv":
                                return dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=causal,
                                                                      return_lse=True)  # fmt: skip
                            return dilated_attention(q, k, v, seg, dil, causal=causal, impl="triton", return_lse=True)

                        flags.set_direct_launch(True)
                        got = call()
                        again = call()
                        flags.set_direct_launch(False)
                        want = call()
                        flags.set_direct_launch(True)
                        for x in (got, again):
                            assert torch.equal(x[0], want[0]) and torch.equal(x[1], want[1]), (dt, growth, route, causal, n)
                    assert len(td._PLANS) == len(classes) <= 2, (dt, growth, route, causal)
                    if direct_launch.unavailable_reason() is None:
                        assert all(p.split_go is not None for p in td._PLANS.values()), (dt, growth, route, causal)
    if direct_launch.unavailable_reason() is not None:
        pytest.skip(f"direct launch unavailable here: {direct_launch.unavailable_reason()}")
