"""The decode front door at its edges (issue 23 item 7) and left padding (issue 22 item 5).

Garbage in unwritten cache slots, cache_seqlens that are negative / zero / shorter than the new
rows, empty caches, accepted argument types, refused dtypes, the rolling-cache bound at its edge,
and ``cache_leftpad``: each row of a left-padded batch equals that row alone. Every fast path is
compared with ``dilated_attention(..., impl="reference")`` (float64) on fresh random inputs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.decode import dilated_attention_with_kvcache, triton_unavailable_reason

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch", "triton"]


def _dtype(impl):
    if impl == "triton":
        reason = triton_unavailable_reason(torch.empty(1, 1, 1, 16, device=DEV))
        if reason is not None:
            pytest.skip(reason)
        return torch.float32
    return torch.float64


def _atol(dtype):
    return 1e-12 if dtype == torch.float64 else 2e-5


def _ref(q, k, v, seg, dil, **kw):
    """Reference of q (1, T, H, D) against the sequence k, v (1, n, Hkv, D), float64."""
    return dilated_attention(q.double(), k.double(), v.double(), seg, dil, return_lse=True, impl="reference", **kw)


def _close(got, want, atol):
    out, lse = got
    rout, rlse = want
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), rout.double(), atol=atol, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse.double()[fin], rlse.double()[fin], atol=atol, rtol=0)


# ------------------------------------------------------------------ unwritten slots are never read


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_garbage_beyond_cache_seqlens_is_never_read(seed, impl, causal, fill):
    dtype = _dtype(impl)
    seg, dil, nq, h, hkv, d, cap = [4, 8, 16], [1, 2, 4], 2, 4, 2, 16, 48
    lens = [3, 21, 32]
    q = torch.randn(3, nq, h, d, dtype=dtype, device=DEV)
    k = torch.full((3, cap, hkv, d), fill, dtype=dtype, device=DEV)  # a cache from torch.empty
    v = torch.full_like(k, fill)
    for b, n in enumerate(lens):
        k[b, :n] = torch.randn(n, hkv, d, dtype=dtype, device=DEV)
        v[b, :n] = torch.randn(n, hkv, d, dtype=dtype, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=causal, return_lse=True, impl=impl)
    for b, n in enumerate(lens):
        want = _ref(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], seg, dil, causal=causal)
        _close((got[0][b : b + 1], got[1][b : b + 1]), want, _atol(dtype))


# ---------------------------------------------------- cache_seqlens negative, zero, shorter than T


@pytest.mark.parametrize("causal", [True, False])
def test_short_cache_seqlens_rows_before_zero_attend_to_nothing(seed, causal):
    # device tensor (never read on the host): rows at positions < 0 give out 0, lse -inf; the
    # others are exactly the rows of the sequence cache[:S]; torch and triton agree
    seg, dil, nq, h, hkv, d, cap = [4, 8], [1, 2], 5, 4, 2, 16, 24
    lens = [-7, 0, 1, 3, 5, 9]
    bsz = len(lens)
    q = torch.randn(bsz, nq, h, d, device=DEV)
    k = torch.randn(bsz, cap, hkv, d, device=DEV)
    v = torch.randn(bsz, cap, hkv, d, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    outs = {}
    for impl in IMPLS:
        if impl == "triton" and triton_unavailable_reason(q) is not None:
            continue
        outs[impl] = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=causal, return_lse=True, impl=impl)
    for out, lse in outs.values():
        for b, n in enumerate(lens):
            first = max(nq - n, 0)  # rows 0..first-1 sit at negative positions
            assert (out[b, :first] == 0).all() and torch.isneginf(lse[b, :, :first]).all()
            if n > 0:
                want = _ref(q[b : b + 1, first:], k[b : b + 1, :n], v[b : b + 1, :n], seg, dil, causal=causal)
                _close((out[b : b + 1, first:], lse[b : b + 1, :, first:]), want, 2e-5)
    if len(outs) == 2:
        torch.testing.assert_close(outs["torch"][0], outs["triton"][0], atol=2e-5, rtol=0)
        torch.testing.assert_close(outs["torch"][1], outs["triton"][1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("n", [-1, 0, 2])
def test_host_int_cache_seqlens_shorter_than_rows_is_refused(n):
    q, k = torch.randn(1, 3, 2, 16), torch.randn(1, 40, 2, 16)
    with pytest.raises(ValueError, match=rf"cache_seqlens = {n} .*3 <= cache_seqlens"):
        dilated_attention_with_kvcache(q, k, k, n, [8], [1])


# ------------------------------------------------------------------------- argument types, shapes


def test_int_like_cache_seqlens_are_accepted(seed):
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    want = dilated_attention_with_kvcache(q, k, k, 30, [8, 16], [1, 2], impl="torch")
    for n in (np.int64(30), np.int32(30), torch.tensor([30, 30], dtype=torch.int32)):
        got = dilated_attention_with_kvcache(q, k, k, n, [8, 16], [1, 2], impl="torch")
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [[30, 30], np.array([30, 30]), 30.0, True, None])
def test_other_cache_seqlens_types_name_the_accepted_ones(bad):
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 40, 2, 16)
    with pytest.raises(TypeError, match="cache_seqlens must be an int .* or an int32 torch.Tensor"):
        dilated_attention_with_kvcache(q, k, k, bad, [8, 16], [1, 2])


@pytest.mark.parametrize("name, kw", [("return_lse", dict(return_lse="no")), ("causal", dict(causal=1)),
                                      ("impl", dict(impl="fast"))])
def test_flag_and_impl_values_are_checked(name, kw):
    # return_lse="no" returned (out, lse) before: a truthy string taken as True
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 40, 2, 16)
    err = ValueError if name == "impl" else TypeError
    with pytest.raises(err, match=name):
        dilated_attention_with_kvcache(q, k, k, 40, [8, 16], [1, 2], **kw)


def test_zero_kv_heads_and_empty_cache_are_value_errors():
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="0 kv heads"):
        dilated_attention_with_kvcache(q, torch.randn(1, 40, 0, 16), torch.randn(1, 40, 0, 16), 4, [8], [1])
    with pytest.raises(ValueError, match="cache is empty"):
        dilated_attention_with_kvcache(
            q, torch.randn(1, 0, 2, 16), torch.randn(1, 0, 2, 16), torch.tensor([1], dtype=torch.int32), [8], [1]
        )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int32])
def test_dtypes_dilated_attention_refuses_are_refused(dtype):
    q = torch.zeros(1, 1, 2, 16).to(dtype)
    k = torch.zeros(1, 40, 2, 16).to(dtype)
    with pytest.raises(TypeError, match=r"must be a floating tensor \(fp16, bf16, fp32, fp64\)") as e:
        dilated_attention_with_kvcache(q, k, k, 40, [8], [1])
    # the same rule and wording as dilated_attention
    with pytest.raises(TypeError) as e2:
        dilated_attention(q, k, k, [8], [1])
    assert str(e.value).split(": ", 1)[1] == str(e2.value).split(": ", 1)[1]


def test_cache_leftpad_checks():
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 40, 2, 16)
    with pytest.raises(ValueError, match="cache_leftpad must be an int32 tensor of shape"):
        dilated_attention_with_kvcache(q, k, k, 40, [8], [1], cache_leftpad=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache_leftpad must be an int32 tensor of shape"):
        dilated_attention_with_kvcache(q, k, k, 40, [8], [1], cache_leftpad=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_leftpad must be None or an int32"):
        dilated_attention_with_kvcache(q, k, k, 40, [8], [1], cache_leftpad=[0, 1])


# ------------------------------------------------------------------- rolling cache bound at its edge


def _rolling(k, n, cap):
    """The last ``cap`` positions of k[:, :n] in a ring buffer of ``cap`` slots (p -> p % cap)."""
    kr = torch.full((k.shape[0], cap, *k.shape[2:]), float("nan"), dtype=k.dtype, device=k.device)
    p = torch.arange(max(n - cap, 0), n, device=k.device)
    kr[:, p % cap] = k[:, p]
    return kr


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nq", [1, 5])
def test_rolling_cache_bound_is_exact_at_its_edge(seed, impl, nq):
    # max(w) + nq - 1 slots equal the full cache at every phase of the segments; one slot fewer
    # differs when the first new row is the last position of a max(w) segment with r = 1
    dtype = _dtype(impl)
    seg, dil, h, hkv, d = [4, 16], [2, 1], 4, 2, 16
    wmax = max(seg)
    cap = wmax + nq - 1
    total = 3 * wmax + nq + 3
    k = torch.randn(1, total, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(1, total, hkv, d, dtype=dtype, device=DEV)
    q = torch.randn(1, nq, h, d, dtype=dtype, device=DEV)
    for n in range(2 * wmax + nq - 2, total + 1, 3 if impl == "triton" else 1):
        sl = torch.tensor([n], dtype=torch.int32, device=DEV)
        want = _ref(q, k[:, :n], v[:, :n], seg, dil, causal=True)
        got = dilated_attention_with_kvcache(
            q, _rolling(k, n, cap), _rolling(v, n, cap), sl, seg, dil, causal=True, return_lse=True, impl=impl
        )
        _close(got, want, _atol(dtype))
    n = 2 * wmax + wmax - 1 + nq  # first new row at position 3*wmax - 1: reads its whole segment
    sl = torch.tensor([n], dtype=torch.int32, device=DEV)
    want = _ref(q, k[:, :n], v[:, :n], seg, dil, causal=True)
    short = dilated_attention_with_kvcache(
        q, _rolling(k, n, cap - 1), _rolling(v, n, cap - 1), sl, seg, dil, causal=True, impl=impl
    )
    assert (short.double() - want[0]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------- cache_leftpad

LEFTPAD_BRANCHES = [([8], [1]), ([4, 8, 16], [1, 2, 4]), ([6, 12], [2, 5])]


def _padded_batch(lens, pads, nq, h, hkv, d, cap, dtype):
    """Rows of lengths ``lens`` (new rows included) stored from slot ``pads[b]``, NaN elsewhere."""
    bsz = len(lens)
    seqs_k = [torch.randn(1, n, hkv, d, dtype=dtype, device=DEV) for n in lens]
    seqs_v = [torch.randn(1, n, hkv, d, dtype=dtype, device=DEV) for n in lens]
    k = torch.full((bsz, cap, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v = torch.full_like(k, float("nan"))
    for b, (n, p) in enumerate(zip(lens, pads, strict=True)):
        slots = (p + torch.arange(n, device=DEV)) % cap
        k[b, slots] = seqs_k[b][0]
        v[b, slots] = seqs_v[b][0]
    q = torch.randn(bsz, nq, h, d, dtype=dtype, device=DEV)
    sl = torch.tensor([p + n for n, p in zip(lens, pads, strict=True)], dtype=torch.int32, device=DEV)
    lp = torch.tensor(pads, dtype=torch.int32, device=DEV)
    return q, k, v, sl, lp, seqs_k, seqs_v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seg,dil", LEFTPAD_BRANCHES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h,hkv,nq", [(4, 4, 1), (6, 2, 3)])
def test_leftpad_rows_decode_like_each_row_alone(seed, impl, seg, dil, causal, h, hkv, nq):
    dtype = _dtype(impl)
    lens = [nq + 2, 13, 21, 30]
    pads = [27, 9, 0, 3]
    q, k, v, sl, lp, ks, vs = _padded_batch(lens, pads, nq, h, hkv, 16, 40, dtype)
    got = dilated_attention_with_kvcache(
        q, k, v, sl, seg, dil, causal=causal, return_lse=True, impl=impl, cache_leftpad=lp
    )
    for b in range(len(lens)):
        want = _ref(q[b : b + 1], ks[b], vs[b], seg, dil, causal=causal)
        _close((got[0][b : b + 1], got[1][b : b + 1]), want, _atol(dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_leftpad_with_rolling_cache(seed, impl):
    # slot index cache_leftpad[b] + p lives in slot (cache_leftpad[b] + p) % cache_len: a rolling
    # cache of max(w) + nq - 1 slots stays exact with left padding
    dtype = _dtype(impl)
    seg, dil, nq = [4, 8, 16], [1, 2, 4], 2
    lens, pads = [40, 23, 51], [5, 30, 17]
    cap = max(seg) + nq - 1
    q, k, v, sl, lp, ks, vs = _padded_batch(lens, pads, nq, 4, 2, 16, 64, dtype)
    kr = torch.full((3, cap, 2, 16), float("nan"), dtype=dtype, device=DEV)
    vr = torch.full_like(kr, float("nan"))
    for b, (n, p) in enumerate(zip(lens, pads, strict=True)):
        pos = torch.arange(n - cap, n, device=DEV)
        kr[b, (p + pos) % cap] = ks[b][0, pos]
        vr[b, (p + pos) % cap] = vs[b][0, pos]
    got = dilated_attention_with_kvcache(
        q, kr, vr, sl, seg, dil, causal=True, return_lse=True, impl=impl, cache_leftpad=lp
    )
    for b in range(3):
        want = _ref(q[b : b + 1], ks[b], vs[b], seg, dil, causal=True)
        _close((got[0][b : b + 1], got[1][b : b + 1]), want, _atol(dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_leftpad_negative_counts_as_zero_and_past_the_end_is_empty(seed, impl):
    dtype = _dtype(impl)
    q = torch.randn(3, 2, 4, 16, dtype=dtype, device=DEV)
    k = torch.randn(3, 30, 2, 16, dtype=dtype, device=DEV)
    v = torch.randn(3, 30, 2, 16, dtype=dtype, device=DEV)
    sl = torch.tensor([20, 25, 10], dtype=torch.int32, device=DEV)
    lp = torch.tensor([-5, 0, 11], dtype=torch.int32, device=DEV)  # row 2: start after its end
    kw = dict(causal=True, return_lse=True, impl=impl)
    got = dilated_attention_with_kvcache(q, k, v, sl, [4, 8], [1, 2], cache_leftpad=lp, **kw)
    plain = dilated_attention_with_kvcache(q, k, v, sl, [4, 8], [1, 2], **kw)
    torch.testing.assert_close(got[0][:2], plain[0][:2], atol=0, rtol=0)
    assert (got[0][2] == 0).all() and torch.isneginf(got[1][2]).all()


def test_leftpad_torch_equals_triton(seed):
    _dtype("triton")
    seg, dil = [4, 8, 16], [1, 2, 4]
    q, k, v, sl, lp, _, _ = _padded_batch([9, 17, 2], [3, 0, 20], 3, 6, 2, 16, 32, torch.float32)
    kw = dict(causal=True, return_lse=True, cache_leftpad=lp)
    a = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, impl="torch", **kw)
    b = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, impl="triton", **kw)
    torch.testing.assert_close(a[0], b[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=2e-5, rtol=0)


def test_leftpad_under_compile(seed):
    # cache_leftpad is a tensor input of the custom op: fullgraph, no graph break
    q, k, v, sl, lp, ks, vs = _padded_batch([9, 17], [5, 0], 1, 4, 2, 16, 24, torch.float32)
    seg, dil = [4, 8, 16], [1, 2, 4]
    impl = "torch" if DEV == "cpu" else "triton"

    def step(q, k, v, sl, lp):
        return dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, impl=impl, cache_leftpad=lp)

    want = step(q, k, v, sl, lp)
    got = torch.compile(step, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")(q, k, v, sl, lp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for b in range(2):
        ref = _ref(q[b : b + 1], ks[b], vs[b], seg, dil, causal=True)[0]
        torch.testing.assert_close(got[b : b + 1].double(), ref, atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------------ import cost


def test_import_pulls_in_nothing_from_dynamo():
    # torch._dynamo costs ~1.2 s at import; the decode module must not load it until it is used
    import subprocess
    import sys

    code = "import sys, dilated_attention; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


@pytest.mark.cuda
def test_cuda_decode_never_syncs_the_host(seed):
    # the eager call with device cache_seqlens and cache_leftpad: no host synchronisation
    reason = triton_unavailable_reason(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16))
    if reason is not None:
        pytest.skip(reason)
    seg, dil = [2048, 4096, 8192], [1, 2, 4]
    q, k, v, sl, lp, ks, vs = _padded_batch([5000, 300], [0, 4000], 1, 32, 8, 128, 9000, torch.bfloat16)
    with torch.no_grad():
        want = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, cache_leftpad=lp)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, cache_leftpad=lp)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    for b in range(2):
        ref = _ref(q[b : b + 1], ks[b], vs[b], seg, dil, causal=True)[0]
        torch.testing.assert_close(got[b : b + 1].double(), ref, atol=2e-2, rtol=0)


def test_eager_calls_the_implementation_directly(seed, monkeypatch):
    # eager: no custom-op dispatch (its Python cost dominated the host time); compile keeps the op
    import dilated_attention.decode as decode

    calls = []
    monkeypatch.setattr(decode, "_decode_op", lambda *a: calls.append(1))
    q, k = torch.randn(1, 1, 4, 16, dtype=torch.float64), torch.randn(1, 30, 2, 16, dtype=torch.float64)
    with torch.no_grad():
        out = dilated_attention_with_kvcache(q, k, k, 20, [4, 8], [1, 2], impl="torch")
    assert not calls
    _close((out, torch.zeros(1, 4, 1)), (_ref(q, k[:, :20], k[:, :20], [4, 8], [1, 2])[0], torch.zeros(1, 4, 1)), 1e-12)


# ------------------------------------------------------------------ positions near 2^31


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("leftpad", [False, True])
def test_positions_near_int32_max_are_exact(seed, impl, causal, leftpad):
    # a rolling cache of 20 slots at cache_seqlens within max(w) of 2^31: the Triton kernel once
    # computed positions (seg0 + w, j, j + leftpad) in int32, which wrapped, and those rows
    # silently got out 0 and lse -inf. Positions S and S % 40 + 80 have the same phase in every
    # segment (lcm(w) = 8) and in the ring (20 slots), so they read the same slots: same result.
    dtype = _dtype(impl)
    seg, dil, nq, cap = [4, 8], [1, 2], 2, 20
    q = torch.randn(2, nq, 4, 16, dtype=dtype, device=DEV)
    k = torch.randn(2, cap, 2, 16, dtype=dtype, device=DEV)
    v = torch.randn(2, cap, 2, 16, dtype=dtype, device=DEV)
    big = [2**31 - 1, 2**31 - 5]
    small = [s % 40 + 80 for s in big]
    kw = dict(causal=causal, return_lse=True, impl=impl)
    if leftpad:  # positions count from the pad (S - pad), slots from 0 (S): both keep their phase
        kw["cache_leftpad"] = torch.tensor([3, 40], dtype=torch.int32, device=DEV)
    got = dilated_attention_with_kvcache(q, k, v, torch.tensor(big, dtype=torch.int32, device=DEV), seg, dil, **kw)
    want = dilated_attention_with_kvcache(q, k, v, torch.tensor(small, dtype=torch.int32, device=DEV), seg, dil, **kw)
    assert torch.isfinite(got[1]).all()
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    if impl == "triton":  # and the torch path (int64 positions) agrees at the large lengths
        ref = dilated_attention_with_kvcache(q, k, v, torch.tensor(big, dtype=torch.int32, device=DEV), seg, dil,
                                             **{**kw, "impl": "torch"})  # fmt: skip
        _close(got, ref, 2e-5)
