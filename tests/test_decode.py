"""The decode path (decode.py) against impl="reference" on the cache truncated to its valid length.

Both implementations: the torch path in float64/float32, the Triton kernel in float32 (in the
interpreter on the CPU: tests/conftest.py sets TRITON_INTERPRET=1 before any test module is imported; on a
GPU the compiled kernel). Covers the tail of a partial segment, rows no branch selects, GQA/MHA,
causal, 'all'/'split', several query rows, per-batch cache lengths, a rolling (ring) cache, CUDA
graph replay and torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.decode import (
    dilated_attention_with_kvcache,
    triton_unavailable_reason,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

BRANCHES = [
    ([8], [1]),
    ([12], [5]),  # w % r != 0
    ([4, 8, 16], [1, 2, 4]),  # LongNet-like: nested, keys shared by several branches
    ([6, 16], [2, 3]),
]


def _triton_or_skip():
    x = torch.empty(1, 1, 1, 16, device=DEV)
    reason = triton_unavailable_reason(x)
    if reason is not None:
        pytest.skip(reason)


def _reference_per_batch(q, k, v, seqlens, seg, dil, **kw):
    """Reference on cache[:S_b] per batch entry (positions 0..S_b-1), float64."""
    outs, lses = [], []
    for b, s in enumerate(seqlens.tolist()):
        o, lse = dilated_attention(
            q[b : b + 1].double(), k[b : b + 1, :s].double(), v[b : b + 1, :s].double(), seg, dil,
            return_lse=True, impl="reference", **kw,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(got, ref, atol):
    out, lse = got
    rout, rlse = ref
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), rout, atol=atol, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse.double()[fin], rlse.double()[fin], atol=atol, rtol=0)


def _case(nq, h, hkv, d, cap, lens, dtype):
    b = len(lens)
    q = torch.randn(b, nq, h, d, dtype=dtype, device=DEV)
    k = torch.randn(b, cap, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, cap, hkv, d, dtype=dtype, device=DEV)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("seg,dil", BRANCHES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("head_assignment", ["all", "split"])
@pytest.mark.parametrize("nq", [1, 3, 7])
def test_torch_decode_matches_reference(seed, seg, dil, causal, h, hkv, head_assignment, nq):
    # per-batch lengths: inside a segment, at a boundary, a partial tail, shorter than w
    lens = [nq + 2, 16, 29, 37]
    q, k, v, sl = _case(nq, h, hkv, 8, 40, lens, torch.float64)
    kw = dict(causal=causal, head_assignment=head_assignment)
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, return_lse=True, impl="torch", **kw)
    _check(got, _reference_per_batch(q, k, v, sl, seg, dil, **kw), atol=1e-12)


def test_torch_decode_float32(seed):
    q, k, v, sl = _case(2, 4, 2, 16, 50, [17, 50], torch.float32)
    seg, dil = [4, 8, 16], [1, 2, 4]
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True, impl="torch")
    _check(got, _reference_per_batch(q, k, v, sl, seg, dil, causal=True), atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unselected_rows_are_empty(seed, impl):
    # 2 heads, r = 4: rows with residue 2 or 3 have no head in the only branch
    if impl == "triton":
        _triton_or_skip()
    dtype = torch.float64 if impl == "torch" else torch.float32
    q, k, v, sl = _case(4, 2, 1, 16, 24, [13, 24], dtype)
    out, lse = dilated_attention_with_kvcache(q, k, v, sl, [8], [4], causal=True, return_lse=True, impl=impl)
    ref = _reference_per_batch(q, k, v, sl, [8], [4], causal=True)
    assert torch.isneginf(ref[1]).any()  # the case exists
    _check((out, lse), ref, atol=1e-5)
    assert (out[torch.isneginf(lse).transpose(1, 2)] == 0).all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rolling_cache_equals_full(seed, impl):
    # ring buffer of max(w) + nq - 1 slots: position p in slot p % cap, exact for every row
    if impl == "triton":
        _triton_or_skip()
    dtype = torch.float64 if impl == "torch" else torch.float32
    seg, dil, nq = [4, 8, 16], [1, 2, 4], 3
    n = 61
    q, k, v, _ = _case(nq, 4, 2, 16, n, [n], dtype)
    cap = max(seg) + nq - 1
    slots = torch.arange(n - cap, n, device=DEV) % cap
    kr = torch.empty(1, cap, 2, 16, dtype=dtype, device=DEV)
    vr = torch.empty_like(kr)
    kr[:, slots] = k[:, n - cap :]
    vr[:, slots] = v[:, n - cap :]
    sl = torch.tensor([n], dtype=torch.int32, device=DEV)
    got = dilated_attention_with_kvcache(q, kr, vr, sl, seg, dil, causal=True, return_lse=True, impl=impl)
    _check(got, _reference_per_batch(q, k, v, sl, seg, dil, causal=True), atol=1e-5)


@pytest.mark.parametrize("seg,dil", BRANCHES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "h,hkv,head_assignment,nq", [(4, 4, "all", 1), (6, 2, "split", 5), (6, 2, "all", 5), (4, 4, "split", 1)]
)
def test_triton_decode_matches_reference(seed, seg, dil, causal, h, hkv, head_assignment, nq):
    _triton_or_skip()
    lens = [nq + 1, 29, 40]  # kv blocks of 16 in the interpreter: several blocks per row
    q, k, v, sl = _case(nq, h, hkv, 16, 40, lens, torch.float32)
    kw = dict(causal=causal, head_assignment=head_assignment)
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, return_lse=True, impl="triton", **kw)
    _check(got, _reference_per_batch(q, k, v, sl, seg, dil, **kw), atol=2e-5)


def test_triton_decode_long_branch_blocks(seed):
    # w / r = 48 keys per row: three kv blocks of one branch, a partial last block
    _triton_or_skip()
    q, k, v, sl = _case(2, 4, 2, 32, 100, [77, 100], torch.float32)
    seg, dil = [96, 32], [2, 1]
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True, impl="triton")
    ref = _reference_per_batch(q, k, v, sl, seg, dil, causal=True)
    _check(got, ref, atol=2e-5)
    # the knobs: other key blocks, a reduction over several steps of partials and columns
    from dilated_attention.kernels.triton_decode import decode_triton

    branches = [(96, 2, 0, 4), (32, 1, 0, 4)]
    for kw in (dict(block_n=32), dict(reduce_splits=2, reduce_cols=8)):
        got = decode_triton(q, k, v, sl, None, branches, True, 32**-0.5, **kw)
        _check(got, ref, atol=2e-5)


def test_api_routes_short_queries_to_decode(seed, monkeypatch):
    # dilated_attention(q, k, v) with a few rows and more keys takes the decode path
    import dilated_attention.decode as decode

    calls = []
    # the decode implementation (api._run_decode reaches it without the public entry point)
    orig = decode._run
    monkeypatch.setattr(decode, "_run", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 30, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 30, 2, 8, dtype=torch.float64)
    seg, dil = [4, 8, 16], [1, 2, 4]
    out = dilated_attention(q, k, v, seg, dil, causal=True, impl="torch")
    assert calls
    ref = dilated_attention(q, k, v, seg, dil, causal=True, impl="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # with gradients needed, the training path runs (the decode op has no autograd)
    calls.clear()
    qg = q.clone().requires_grad_()
    dilated_attention(qg, k, v, seg, dil, causal=True, impl="torch").sum().backward()
    assert not calls and qg.grad is not None


def test_api_decode_asks_the_decode_kernel_not_the_fused_one(seed):
    # a decode-shaped dilated_attention call with impl="triton" runs the decode kernel, so it
    # takes what that kernel takes (head dim 256, which the fused kernel does not): it raised
    # "headdim 256 is not supported by the triton kernel" before
    _triton_or_skip()
    q, k, v, _ = _case(2, 4, 2, 256, 24, [24], torch.float32)
    seg, dil = [4, 8, 16], [1, 2, 4]
    out, lse = dilated_attention(q, k, v, seg, dil, causal=True, impl="triton", return_lse=True)
    ref = dilated_attention(q.double(), k.double(), v.double(), seg, dil, causal=True,
                            impl="reference", return_lse=True)
    _check((out, lse), ref, atol=2e-5)


def test_validation_errors():
    q = torch.randn(1, 65, 4, 8)
    k = torch.randn(1, 80, 2, 8)
    with pytest.raises(ValueError, match="seqlen_q = 65"):
        dilated_attention_with_kvcache(q, k, k, 80, [8], [1])
    with pytest.raises(ValueError, match="int32"):
        dilated_attention_with_kvcache(q[:, :1], k, k, torch.tensor([80]), [8], [1])
    with pytest.raises(ValueError, match=r"nheads \(3\) must be a multiple of nheads_kv \(2\) of k_cache"):
        dilated_attention_with_kvcache(q[:, :1, :3], k, k, 80, [8], [1])
    with pytest.raises(ValueError, match="inference only"):
        dilated_attention_with_kvcache(q[:, :1].requires_grad_(), k, k, 80, [8], [1])


def test_compile_matches_eager(seed):
    # fullgraph: the op and its fake trace without graph breaks (CPU: the torch path)
    q, k, v, sl = _case(1, 4, 2, 16, 40, [23], torch.float32)
    seg, dil = [4, 8, 16], [1, 2, 4]
    impl = "torch" if DEV == "cpu" else "triton"

    def step(q, k, v, sl):
        return dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, impl=impl)

    want = step(q, k, v, sl)
    got = torch.compile(step, fullgraph=True, backend="eager" if DEV == "cpu" else "inductor")(q, k, v, sl)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------ GPU only

LONGNET = ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])


@pytest.mark.cuda
@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)])
def test_cuda_bf16_real_branches(seed, h, hkv):
    # bf16 at LongNet's branches: error vs the fp32 reference <= 2x the torch decode path's + atol
    if triton_unavailable_reason(torch.empty(1, 1, 1, 128, device="cuda")) is not None:
        pytest.skip("triton unavailable")
    seg, dil = LONGNET
    lens = [40000, 70001]
    q, k, v, sl = _case(2, h, hkv, 128, 70001, lens, torch.bfloat16)
    ref = _reference_per_batch(q, k, v, sl, seg, dil, causal=True)
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True, impl="triton")
    tor = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True, impl="torch")
    err = (got[0].double() - ref[0]).abs().max()
    err_t = (tor[0].double() - ref[0]).abs().max()
    assert err <= 2 * err_t + 1e-3, (err, err_t)
    torch.testing.assert_close(got[1].double(), ref[1].double(), atol=1e-3, rtol=0)


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager(seed):
    # one capture, replayed at two cache lengths by updating cache_seqlens in place
    seg, dil = LONGNET
    q, k, v, sl = _case(1, 32, 8, 128, 70000, [5000], torch.bfloat16)
    step = lambda: dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        step()  # warm-up (kernel compilation) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        out_g, lse_g = step()
    for n in (5000, 69001):
        sl.fill_(n)
        g.replay()
        out_e, lse_e = step()
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        ref = _reference_per_batch(q, k, v, sl, seg, dil, causal=True)
        torch.testing.assert_close(out_g.double(), ref[0], atol=2e-2, rtol=0)


@pytest.mark.cuda
def test_cuda_compile_reduce_overhead(seed):
    seg, dil = LONGNET
    q, k, v, sl = _case(1, 32, 8, 128, 40000, [33000], torch.bfloat16)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q, k, v, sl):
        return dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True)

    with torch.no_grad():
        for n in (33000, 12345, 39999):
            sl.fill_(n)
            for _ in range(3):  # warm-up, record, replay
                got = step(q, k, v, sl).clone()
            want = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True)
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_decode_checks_are_the_shared_strict_ones():
    # the decode entry point uses checks.py like dilated_attention: a nan scale or a non-bool
    # causal is an error, never a silently wrong (or NaN) output
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 40, 2, 16)
    with pytest.raises(ValueError, match="softmax_scale"):
        dilated_attention_with_kvcache(q, k, k, 40, [8, 16], [1, 2], softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        dilated_attention_with_kvcache(q, k, k, 40, [8, 16], [1, 2], causal="no")
    with pytest.raises(ValueError, match="head_assignment"):
        dilated_attention_with_kvcache(q, k, k, 40, [8, 16], [1, 2], head_assignment="some")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_decode_strided_cache_seqlens_and_leftpad(seed, impl):
    # cache_seqlens and cache_leftpad given as strided views (columns of one (batch, 2) table):
    # the Triton kernel loads them with unit stride, so they must be made contiguous first
    if impl == "triton":
        _triton_or_skip()
    b, c, h, hkv, d = 3, 20, 4, 2, 16
    q = torch.randn(b, 1, h, d, device=DEV)
    k = torch.randn(b, c, hkv, d, device=DEV)
    v = torch.randn(b, c, hkv, d, device=DEV)
    table = torch.tensor([[17, 3], [9, 0], [20, 5]], dtype=torch.int32, device=DEV)
    sl, lp = table[:, 0], table[:, 1]
    assert not sl.is_contiguous() and not lp.is_contiguous()
    seg, dil = [4, 8], [1, 2]
    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True, impl=impl, cache_leftpad=lp)
    outs, lses = [], []
    for row, (n, p) in enumerate(table.tolist()):
        o, lse = dilated_attention(q[row : row + 1].double(), k[row : row + 1, p:n].double(), v[row : row + 1, p:n].double(), seg, dil,
                                   causal=True, impl="reference", return_lse=True)  # fmt: skip
        outs.append(o)
        lses.append(lse)
    _check(got, (torch.cat(outs), torch.cat(lses)), atol=2e-5)
