"""impl="triton" against the float64 reference, forward, lse and gradients.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set once by
tests/conftest.py before any test module imports a kernel module) at tiny sizes in float32. The ``cuda`` set runs real sizes in bf16 and judges as SPEC section 6:
error vs the fp32 reference <= 2x the error of impl="torch" in the same dtype + a small atol.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from helpers import poisoned_empty

from dilated_attention import call_cache, dilated_attention
from dilated_attention.branches import branch_head_ranges
from dilated_attention.kernels import triton_launch, triton_ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = DEV == "cpu"


def _inputs(b, nq, nk, h, hkv, d, dtype, device, pad_frac=0.0):
    q = torch.randn(b, nq, h, d, dtype=dtype, device=device)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, device=device)
    do = torch.randn(b, nq, h, d, dtype=dtype, device=device)
    kpm = (torch.rand(b, nk, device=device) < pad_frac) if pad_frac > 0 else None
    return q, k, v, do, kpm


def _run(impl, q, k, v, do, seg, dil, dtype=None, **kw):
    dtype = dtype or q.dtype
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*xs, seg, dil, return_lse=True, impl=impl, **kw)
    grads = torch.autograd.grad(out, xs, do.to(dtype))
    return out, lse, grads


def _close(name, got, ref, atol, rtol=0.0):
    got = got.double()
    ref = ref.double()
    assert not torch.isnan(got).any(), f"{name}: NaN"
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    err = torch.where(both_inf, torch.zeros_like(got), (got - ref).abs())
    bound = atol + rtol * ref.abs().nan_to_num(posinf=0, neginf=0)
    assert (err <= bound).all(), f"{name}: max err {err.max().item():.3g} > atol {atol}"


BRANCHES = [
    ([16], [1]),  # r = 1, several segments
    ([12], [5]),  # w % r != 0
    ([128], [2]),  # w > N
    ([8, 16, 32], [1, 2, 4]),  # several branches (LongNet-like)
    ([6, 24], [1, 3]),  # several branches, a partial last segment
]


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
@pytest.mark.parametrize("seg,dil", BRANCHES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "nq,nk,h,hkv",
    [(37, 37, 2, 2), (53, 53, 4, 1), (19, 45, 4, 2)],  # awkward N, MQA, GQA + seqlen_q < seqlen_k
    ids=["mha", "mqa", "gqa_short_q"],
)
def test_triton_vs_reference_interpreter(seed, monkeypatch, seg, dil, causal, nq, nk, h, hkv):
    q, k, v, do, _ = _inputs(1, nq, nk, h, hkv, 16, torch.float64, "cpu")
    ref = _run("reference", q, k, v, do, seg, dil, causal=causal)
    with monkeypatch.context() as m:
        # NaN-filled allocations: an element the kernels should write (or fill) but do not shows
        # up as NaN (with the buffers' usual contents it was caught only when they held garbage)
        poisoned_empty(m)
        got = _run("triton", q, k, v, do, seg, dil, dtype=torch.float32, causal=causal)
    _close("out", got[0], ref[0], 2e-5)
    _close("lse", got[1], ref[1], 2e-5)
    for n, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{n}", g, r, 5e-5)


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
@pytest.mark.parametrize("head_assignment", ["all", "split"])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_padding_split_interpreter(seed, head_assignment, causal):
    # 2 batches, key padding (some queries lose every key: out 0, lse -inf, no NaN gradients),
    # GQA with 3 query heads per kv head, headdim 32, seqlen_q < seqlen_k
    q, k, v, do, kpm = _inputs(2, 29, 41, 6, 2, 32, torch.float64, "cpu", pad_frac=0.4)
    kpm[0, :] = True  # batch 0: every key padded
    seg, dil = [8, 20, 41], [2, 3, 1]
    kw = dict(causal=causal, key_padding_mask=kpm, head_assignment=head_assignment)
    ref = _run("reference", q, k, v, do, seg, dil, **kw)
    got = _run("triton", q, k, v, do, seg, dil, dtype=torch.float32, **kw)
    assert torch.isneginf(got[1][0]).all() and (got[0][0] == 0).all()
    _close("out", got[0], ref[0], 2e-5)
    _close("lse", got[1], ref[1], 2e-5)
    for n, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{n}", g, r, 5e-5)


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
def test_triton_decode_single_query_interpreter(seed):
    # KV-cache decoding: one query row at the last position, GQA
    q, k, v, do, _ = _inputs(1, 1, 70, 4, 2, 16, torch.float64, "cpu")
    seg, dil = [16, 32, 64], [1, 2, 4]
    ref = _run("reference", q, k, v, do, seg, dil, causal=True)
    got = _run("triton", q, k, v, do, seg, dil, dtype=torch.float32, causal=True)
    _close("out", got[0], ref[0], 2e-5)
    for n, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{n}", g, r, 5e-5)


def _with_fp32_accumulators(monkeypatch) -> list:
    """The same kernels, but results that several branches add into accumulate in float32
    buffers (COMP off) and are cast to the input dtype once at the end. Returns the list of
    ``several`` flags of the buffers made (filled as the launcher runs)."""
    real_fwd, real_bwd = triton_launch.forward, triton_launch.backward
    made = []

    def fp32_buffers(shape, dtype, device, several, fill=True):
        made.append(several)
        new = torch.zeros if fill else torch.empty
        return new(shape, dtype=torch.float32 if several else dtype, device=device), False

    def fwd(q, *a, **kw):
        out, lse = real_fwd(q, *a, **kw)
        return out.to(q.dtype), lse

    def bwd(dout, q, k, v, *a, **kw):
        dq, dk, dv = real_bwd(dout, q, k, v, *a, **kw)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    monkeypatch.setattr(triton_launch, "USE_PLANS", False)  # the per-call path makes the buffers
    monkeypatch.setattr(triton_launch, "_acc_buffers", fp32_buffers)
    monkeypatch.setattr(triton_launch, "forward", fwd)
    monkeypatch.setattr(triton_launch, "backward", bwd)
    return made


@pytest.mark.slow  # 8 s a case in the interpreter
@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
@pytest.mark.parametrize("causal", [False, True])
def test_triton_compensated_accumulation_fp16_interpreter(seed, monkeypatch, causal):
    """out/dq/dk/dv are accumulated across branches as (hi, lo) pairs in the input dtype; the
    result must be the float32-accumulated one rounded once, up to one ulp in rare near-tie
    cases. Plain fp16 accumulation (lo lost) differs in many elements. fp16, not bf16: the
    interpreter's bf16 loads are broken, fp16 is exact there."""
    q, k, v, do, kpm = _inputs(1, 61, 64, 4, 2, 16, torch.float16, "cpu", pad_frac=0.1)
    # 5 branches, some rows in all of them; GQA: dk/dv of a kv head sum several query heads
    seg, dil = [4, 8, 16, 32, 64], [1, 2, 4, 2, 1]
    kw = dict(causal=causal, key_padding_mask=kpm)
    a = _run("triton", q, k, v, do, seg, dil, **kw)  # compensated (hi, lo) pairs
    with monkeypatch.context() as m:
        made = _with_fp32_accumulators(m)
        out_b, lse_b = dilated_attention(q, k, v, seg, dil, return_lse=True, impl="triton", **kw)
        # the backward of both runs gets the SAME out and lse (the compensated run's, as the
        # public path passes them): out_b may differ from a's out by an ulp, and through
        # delta = rowsum(dout * out) that ulp moves every gradient of its row by far more than
        # the accumulation does (seen: dq 2 ulps off in the row of a 1-ulp out difference), so
        # comparing each run's own gradients would not compare the accumulation alone
        hr = branch_head_ranges(q.shape[2], len(seg), "all")
        grads_b = triton_launch.backward(
            do, q, k, v, kpm, a[0].detach(), a[1], seg, dil, causal, q.shape[-1] ** -0.5, hr
        )
    b = (out_b, lse_b, grads_b)
    assert any(made), "the float32-accumulated run made no float32 accumulator"
    # exact result of the same fp16 inputs: where the two differ by more than one ulp (the
    # float32-accumulated one is itself not exact, e.g. after cancellation between branches),
    # the compensated result must be at least as close to it. A (hi, lo) pair of fp16 holds ~22
    # bits against float32's 24, so after cancellation (an element ~1e-4 summed from partials
    # ~1) the two may differ by a few ulps of the small result: allowed up to 2**-20 of the
    # tensor's largest magnitude (seen: 2 ulps = 1.2e-7 at amax 2; lost lo bits are ~2**-11).
    r = _run("reference", q.double(), k.double(), v.double(), do.double(), seg, dil, **kw)
    assert a[0].dtype == torch.float16 and all(g.dtype == torch.float16 for g in a[2])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)  # lse is float32 in both
    named = [("out", a[0], b[0], r[0])] + list(zip(("dq", "dk", "dv"), a[2], b[2], r[2], strict=True))
    for name, x, y, ex in named:
        x, y = x.double(), y.double()
        ulp = 2.0 ** (torch.floor(torch.log2(y.abs().clamp_min(2.0**-14))) - 10)
        diff = (x - y).abs()
        near = diff <= ulp * 1.001 + 2.0**-20 * y.abs().max()
        ok = near | ((x - ex).abs() <= (y - ex).abs())
        assert ok.all(), f"{name}: differs by more than one ulp and is farther from the exact result"
        err_x, err_y = (x - ex).norm().item(), (y - ex).norm().item()
        assert err_x <= 1.01 * err_y, f"{name}: L2 error {err_x:.3g} vs {err_y:.3g} with fp32 accumulation"
        frac = (diff > 0).double().mean().item()
        assert frac <= 0.05, f"{name}: {frac:.1%} of the elements differ from fp32 accumulation"


def test_config_overrides_checked():
    """The launcher's ``config=`` keyword (benchmarks/tune_triton.py): replaces the named
    kernels' defaults only, and rejects block shapes the kernels' stages cannot take."""
    base = triton_launch.default_configs(128)
    cfg = triton_launch.resolve_configs(128, {"dkdv": (32, 128, 8, 3)})
    assert cfg == {**base, "dkdv": (32, 128, 8, 3)}
    assert triton_launch.resolve_configs(128) == base
    with pytest.raises(ValueError, match="BN % BM"):  # dkdv needs BN % BM == 0
        triton_launch.resolve_configs(128, {"dkdv": (64, 32, 8, 3)})
    with pytest.raises(ValueError, match="BM % BN"):  # fwd needs BM % BN == 0
        triton_launch.resolve_configs(128, {"fwd": (32, 64, 8, 3)})
    with pytest.raises(ValueError, match="bad Triton config"):
        triton_launch.resolve_configs(128, {"bwd": (32, 64, 8, 3)})


def test_tune_triton_candidates_and_rows():
    """benchmarks/tune_triton.py: every built-in candidate passes the launcher's config check at
    its head dim (a bad one would only show as an ERR row on the GPU) and the default is among them, and ``--row`` takes a
    sweep row's shape."""
    import pathlib
    import sys

    bench = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import tune_triton

    for d, cands in ((128, tune_triton.CANDIDATES), (64, tune_triton.CANDIDATES_D64)):
        assert tune_triton.candidates_for(d) is cands
        for kernel, configs in cands.items():
            assert triton_launch.default_configs(d, interpret=False)[kernel] in configs, (d, kernel)
            for cfg in configs:
                triton_launch.resolve_configs(d, {kernel: cfg})
            assert len(set(configs)) == len(configs), (d, kernel)
    sh = tune_triton.row_shape("8br-paper-d64-fp16-causal")
    assert (sh.batch, sh.n, sh.heads, sh.d, sh.dtype, sh.causal) == (2, 65536, 16, 64, torch.float16, True)
    assert len(sh.head_ranges) == len(sh.seg) == 8
    assert tune_triton.headline_shape(4096).causal is None
    with pytest.raises(SystemExit, match="unknown row"):
        tune_triton.row_shape("no-such-row")


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
def test_triton_config_override_interpreter(seed):
    """A non-default config reaches the kernels (other block shapes, same results)."""
    q, k, v, do, _ = _inputs(1, 45, 45, 4, 2, 16, torch.float32, "cpu")
    seg, dil = [8, 16, 32], [1, 2, 4]
    common = (seg, dil, True, 0.25, branch_head_ranges(4, 3, "all"))
    _same_results_with_config(q, k, v, do, common, dict(fwd=(16, 16, 1, 1), dkdv=(16, 16, 1, 1), dq=(64, 16, 1, 1)))


def _same_results_with_config(q, k, v, do, common, cfg):
    """The launcher's forward and backward with ``config=cfg`` equal its defaults' (the
    interpreter's own configs)."""
    out, lse = triton_launch.forward(q, k, v, None, *common)
    grads = triton_launch.backward(do, q, k, v, None, out, lse, *common)
    out2, lse2 = triton_launch.forward(q, k, v, None, *common, config=cfg)
    grads2 = triton_launch.backward(do, q, k, v, None, out2, lse2, *common, config=cfg)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse)
    for g2, g in zip(grads2, grads, strict=True):
        torch.testing.assert_close(g2, g)


def test_short_d64_rule(monkeypatch):
    """triton_launch.SHORT_D64: the short-block configs only for head dim <= 64 with every block
    shorter than gluon_fwd.D64_MIN_BLOCK rows, only with the switch on; they pass the kernels'
    block checks; the plans' key and the eager memo's knobs hold the switch (an A/B that flips it
    between calls gets other plans)."""
    from dilated_attention.kernels import gluon_fwd

    seg8, dil8 = [512 * 2**i for i in range(8)], [1, 1, 2, 4, 6, 12, 24, 48]  # blocks <= 1366
    monkeypatch.setattr(triton_launch, "SHORT_D64", False)
    assert not triton_launch.short_blocks(64, 65536, seg8, dil8)
    off_key = triton_launch.plan_key(*_key_args())
    off_knobs = triton_ops._plan_knobs()
    monkeypatch.setattr(triton_launch, "SHORT_D64", True)
    assert triton_launch.short_blocks(64, 65536, seg8, dil8)
    assert triton_launch.short_blocks(32, 65536, seg8, dil8)
    assert not triton_launch.short_blocks(128, 65536, seg8, dil8)
    big = gluon_fwd.D64_MIN_BLOCK
    assert not triton_launch.short_blocks(64, 65536, [big], [1])  # a block of D64_MIN_BLOCK rows
    assert triton_launch.short_blocks(64, big - 1, [big], [1])  # N bounds the block
    assert not triton_launch.short_blocks(64, 65536, [1024, 4 * big], [1, 2])
    assert triton_launch.plan_key(*_key_args()) != off_key
    assert triton_ops._plan_knobs() != off_knobs
    short = triton_launch.default_configs(64, interpret=False, short=True)
    assert short == triton_launch.SHORT_D64_CONFIGS
    assert triton_launch.default_configs(128, interpret=False, short=True) == triton_launch.default_configs(
        128, interpret=False)
    for name, cfg in short.items():
        triton_launch.resolve_configs(64, {name: cfg})  # the kernels' BM / BN rules


def _key_args():
    q = torch.empty(1, 64, 2, 16)
    return (q, q, q, None, [32, 64], [1, 2], True, 0.25, [(0, 2), (0, 2)])


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
@pytest.mark.parametrize("causal", [False, True])
def test_short_d64_configs_interpreter(seed, causal):
    """The short-block configs (64 x 32 query / key tiles, dkdv 32 x 64) through the kernels:
    the results of the interpreter's own configs, at a length that is no multiple of either
    tile, GQA, three branches with blocks of 64-100 rows."""
    q, k, v, do, _ = _inputs(1, 200, 200, 4, 2, 16, torch.float32, "cpu")
    seg, dil = [64, 128, 200], [1, 2, 2]
    common = (seg, dil, causal, 0.25, branch_head_ranges(4, 3, "all"))
    _same_results_with_config(q, k, v, do, common, triton_launch.SHORT_D64_CONFIGS)


def test_unavailable_reason_says_why(monkeypatch):
    cpu = torch.empty(1, 4, 2, 64)
    reason = triton_ops.unavailable_reason(cpu.to(torch.float64))
    assert reason is not None
    assert triton_ops.unavailable_reason(torch.empty(1, 4, 2, 48, device=DEV)) is not None
    if INTERP:
        assert triton_ops.unavailable_reason(cpu) is None
        # the mode is fixed per process when the kernels are imported: as if compiled
        monkeypatch.setattr(triton_launch, "INTERPRET", False)
        assert "CUDA" in triton_ops.unavailable_reason(cpu)
    with pytest.raises(ValueError, match="triton"):
        x = torch.randn(1, 8, 2, 24, device=DEV)
        dilated_attention(x, x, x, [4], [1], impl="triton")


def test_triton_torch_compile(seed):
    """The public API with impl="triton", forward + backward, under torch.compile."""
    d = 16 if INTERP else 64
    dtype = torch.float32 if INTERP else torch.bfloat16
    q, k, v, do, _ = _inputs(1, 33, 33, 2, 1, d, dtype, DEV)
    seg, dil = [8, 16], [1, 2]

    def f(q, k, v):
        return dilated_attention(q, k, v, seg, dil, causal=True, impl="triton")

    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    # aot_eager on the CPU: inductor has nothing to fuse around an opaque custom op, and this
    # keeps the test free of a C++ toolchain; on CUDA the default inductor backend is used
    backend = "aot_eager" if INTERP else "inductor"
    out = torch.compile(f, backend=backend, fullgraph=True)(*xs)
    g = torch.autograd.grad(out, xs, do)
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    out_e = f(*ys)
    g_e = torch.autograd.grad(out_e, ys, do)
    torch.testing.assert_close(out, out_e)
    for a, b in zip(g, g_e, strict=True):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------- CUDA, real sizes
def _err(x, ref):
    return (x.float() - ref.float()).abs().max().item()


def _dense_same_dtype(q, k, v, do, seg, dil, causal=False, key_padding_mask=None,
                      head_assignment="all"):
    """Plain PyTorch in the low dtype (scores, P and P @ V rounded to it, softmax in fp32): the
    same-dtype baseline when impl="torch" cannot run its backward on this torch build."""
    from dilated_attention.reference import multiplicity

    b, n, h, d = q.shape
    rep = h // k.shape[2]
    m = multiplicity(n, k.shape[1], h, tuple(seg), tuple(dil), head_assignment, causal, q.device)
    m = m[None].expand(b, -1, -1, -1)  # (B, H, Nq, Nk)
    if key_padding_mask is not None:
        m = m.masked_fill(key_padding_mask[:, None, None, :], 0)
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    qh = xs[0].transpose(1, 2)
    kh = xs[1].transpose(1, 2).repeat_interleave(rep, 1)
    vh = xs[2].transpose(1, 2).repeat_interleave(rep, 1)
    s = (qh @ kh.transpose(-1, -2)).float() * d**-0.5 + torch.where(m > 0, m.float().log(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    out = (p.to(q.dtype) @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, xs, do)
    return out, lse, grads


@pytest.mark.cuda
@pytest.mark.parametrize(
    "n,h,hkv,seg,dil,causal,kw",
    [
        (4096, 4, 4, [1024, 2048, 4096], [1, 2, 4], False, {}),
        (4096, 4, 4, [1024, 2048, 4096], [1, 2, 4], True, {}),
        (6000, 8, 2, [2048, 4096], [1, 6], True, {}),  # GQA, partial segment, w % r != 0
        (16384, 2, 1, [2048, 4096, 8192, 16384], [1, 2, 4, 8], True, {}),  # MQA
        (5000, 4, 4, [1024, 4096], [2, 4], False, {"head_assignment": "split", "pad": True}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_cuda_vs_torch_path(seed, n, h, hkv, seg, dil, causal, kw, dtype):
    kw = dict(kw)
    pad = kw.pop("pad", False)
    q, k, v, do, kpm = _inputs(1, n, n, h, hkv, 128, dtype, "cuda", 0.1 if pad else 0.0)
    common = dict(causal=causal, key_padding_mask=kpm, **kw)
    # fp32 oracle on the same (low-precision) inputs: the torch path in fp32 (exact up to fp32
    # rounding and itself tested against the dense reference; the dense one is O(N^2) memory)
    ref = _run("torch", q, k, v, do, seg, dil, dtype=torch.float32, **common)
    try:
        base = _run("torch", q, k, v, do, seg, dil, **common)
    except RuntimeError as e:  # e.g. a flash backward signature this torch build lacks
        print(f"impl='torch' failed in {dtype} ({str(e)[:80]}); baseline = dense same-dtype")
        base = _dense_same_dtype(q, k, v, do, seg, dil, **common)
    tri = _run("triton", q, k, v, do, seg, dil, **common)
    assert tri[0].dtype == dtype and all(g.dtype == dtype for g in tri[2])
    assert tri[1].dtype == torch.float32 and tri[1].shape == (1, h, n)
    pairs = [("out", tri[0], base[0], ref[0])]
    pairs += [(f"d{c}", a, b, r) for c, a, b, r in zip("qkv", tri[2], base[2], ref[2], strict=True)]
    for name, a, b, r in pairs:
        ea, eb = _err(a, r), _err(b, r)
        print(f"{name}: triton err {ea:.3g}, baseline err {eb:.3g}")
        assert ea <= 2 * eb + 1e-3, f"{name}: triton err {ea:.3g} > 2 x baseline err {eb:.3g} + 1e-3"
    # rows with no key (split heads + padding) have lse = -inf in both: compare where finite
    fin = torch.isfinite(ref[1])
    assert torch.equal(fin, torch.isfinite(tri[1])), "lse: rows without keys differ"
    assert _err(tri[1][fin], ref[1][fin]) <= 2e-2, "lse"


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_d64_configs_cuda(seed, monkeypatch, causal, dtype):
    """triton_launch.SHORT_D64 on: head dim 64 with blocks of 512-1000 rows (the short-block
    configs' domain, GQA, a partial last segment) against the fp32 torch path, as the shipped
    configs are (test_triton_cuda_vs_torch_path), and the short configs did run."""
    monkeypatch.setattr(triton_launch, "SHORT_D64", True)
    seen = []
    real = triton_launch.short_blocks

    def spy(*a):
        seen.append(real(*a))
        return seen[-1]

    monkeypatch.setattr(triton_launch, "short_blocks", spy)
    n, h, hkv, seg, dil = 7000, 8, 2, [512, 1024, 2000], [1, 2, 2]
    q, k, v, do, _ = _inputs(1, n, n, h, hkv, 64, dtype, "cuda")
    ref = _run("torch", q, k, v, do, seg, dil, dtype=torch.float32, causal=causal)
    base = _run("torch", q, k, v, do, seg, dil, causal=causal)
    tri = _run("triton", q, k, v, do, seg, dil, causal=causal)
    assert seen and all(seen), "the short-block configs did not run"
    pairs = [("out", tri[0], base[0], ref[0])]
    pairs += [(f"d{c}", a, b, r) for c, a, b, r in zip("qkv", tri[2], base[2], ref[2], strict=True)]
    for name, a, b, r in pairs:
        ea, eb = _err(a, r), _err(b, r)
        assert ea <= 2 * eb + 1e-3, f"{name}: triton err {ea:.3g} > 2 x baseline err {eb:.3g} + 1e-3"
    assert _err(tri[1], ref[1]) <= 2e-2, "lse"


@pytest.mark.cuda
def test_triton_cuda_peak_memory(seed):
    """Peak of one forward+backward / bytes of (q, k, v, out, dout, dq, dk, dv), as in
    benchmarks/bench_dilated.py. Predicted ~1.13 (dK/dV phase: inputs, out, dout, dk, dv and
    their lo parts); float32 dK/dV accumulators would need ~1.25."""
    bound = 1.2
    q, k, v, do, _ = _inputs(1, 16384, 16384, 8, 8, 128, torch.bfloat16, "cuda")
    for t in (q, k, v):
        t.requires_grad_(True)
    seg, dil = [2048, 4096, 8192], [1, 2, 4]

    def fb():
        dilated_attention(q, k, v, seg, dil, impl="triton").backward(do)

    fb()  # compile
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # q, k, v, do (and whatever else is alive)
    torch.cuda.reset_peak_memory_stats()
    fb()
    torch.cuda.synchronize()
    unit = q.numel() * q.element_size()
    ratio = (torch.cuda.max_memory_allocated() - before + 4 * unit) / (8 * unit)
    print(f"peak ratio {ratio:.3f}")
    assert ratio <= bound, f"peak {ratio:.3f} x the 8 tensors > {bound}"


@pytest.mark.cuda
def test_triton_cuda_matches_dense_reference_fp32(seed):
    # moderate size: the dense fp32 reference itself, fp32 kernel (no TF32), GQA, padding
    q, k, v, do, kpm = _inputs(2, 1500, 1500, 4, 2, 64, torch.float32, "cuda", 0.2)
    seg, dil = [256, 512, 1024], [1, 3, 4]
    kw = dict(causal=True, key_padding_mask=kpm)
    ref = _run("reference", q, k, v, do, seg, dil, **kw)
    got = _run("triton", q, k, v, do, seg, dil, **kw)
    _close("out", got[0], ref[0], 1e-4)
    _close("lse", got[1], ref[1], 1e-4)
    for n, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{n}", g, r, 5e-4)


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
@pytest.mark.parametrize("head_assignment", ["all", "split"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n,h,hkv,seg,dil,pad",
    [
        # the two long cases (5-12 s each in the interpreter) are "slow"; mqa stays in the quick run
        pytest.param(50, 4, 2, [8, 16, 32], [1, 2, 4], False, id="longnet",  # LongNet-like, GQA, partial last window
                     marks=pytest.mark.slow),
        pytest.param(53, 6, 3, [12, 24, 96], [1, 3, 6], True, id="r36_pad",  # r = 3, 6 (r | r_max), w > N, key padding
                     marks=pytest.mark.slow),
        pytest.param(64, 4, 1, [16, 64], [4, 4], False, id="mqa"),  # equal r, MQA
    ],
)
def test_triton_folded_forward_interpreter(seed, monkeypatch, n, h, hkv, seg, dil, pad, causal,
                                           head_assignment):
    """The forward that folds all branches into one online softmax per residue-class tile (no
    merge pass) against the reference, and the per-branch path (fold=False) against it too."""
    calls = []
    # count launches of the folded kernel (the plans and the per-call path both go through it)
    folded = triton_launch._FWD_FOLDED
    real = folded.launch
    monkeypatch.setattr(folded, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    # at these sizes w_min / r_max is below the interpreter's BM: fold as if it filled the tile
    # (plans built under the real rule must not serve these calls: a fresh plan table)
    monkeypatch.setattr(triton_launch, "fold_fills_tile", lambda geo, bm: True)
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())
    real_fwd = triton_launch.forward
    q, k, v, do, kpm = _inputs(2, n, n, h, hkv, 16, torch.float64, "cpu", 0.3 if pad else 0.0)
    kw = dict(causal=causal, key_padding_mask=kpm, head_assignment=head_assignment)
    ref = _run("reference", q, k, v, do, seg, dil, **kw)
    for fold in (None, False):  # the default rule, then per-branch launches + merge
        monkeypatch.setattr(triton_launch, "forward", functools.partial(real_fwd, fold=fold))
        call_cache.clear()  # the last call's route keeps its plan: reach triton_launch.forward
        calls.clear()
        got = _run("triton", q, k, v, do, seg, dil, dtype=torch.float32, **kw)
        assert len(calls) == (1 if fold is None and not causal else 0)  # causal: per-branch
        _close("out", got[0], ref[0], 2e-5)
        _close("lse", got[1], ref[1], 2e-5)
        for nm, g, r in zip("qkv", got[2], ref[2], strict=True):
            _close(f"d{nm}", g, r, 5e-5)
    if causal:  # the folded kernel's causal mode (measured slower, not the default): still exact
        hr = branch_head_ranges(h, len(seg), head_assignment)
        calls.clear()
        xs = [t.float() for t in (q, k, v)]
        out, lse = real_fwd(*xs, kpm, seg, dil, True, 16**-0.5, hr, fold=True)
        assert len(calls) == 1
        _close("out (folded causal)", out, ref[0], 2e-5)
        _close("lse (folded causal)", lse, ref[1], 2e-5)


@pytest.mark.skipif(DEV != "cpu" or not INTERP, reason="interpreter tests run on the CPU")
@pytest.mark.parametrize(
    "seg,dil,folds",
    [
        ([32, 64], [1, 2], False),  # w_min / r_max = 16 < BM (32 in the interpreter)
        ([64, 128], [1, 2], True),  # = 32: fills the tile
        ([64, 128], [2, 2], True),
        ([64, 128], [1, 4], False),  # 16
    ],
)
def test_fold_only_when_the_residue_rows_fill_a_tile(seed, monkeypatch, seg, dil, folds):
    """The default forward folds the branches only when w_min / r_max >= the forward's BM (a
    folded tile with fewer rows is mostly masked: 6.5x slower on an H100 at 16 rows); either way
    the result matches the reference, and fold=True still forces the folded kernel."""
    assert triton_launch.fold_fills_tile((64, 2), 32) and not triton_launch.fold_fills_tile((32, 2), 32)
    calls = []
    folded = triton_launch._FWD_FOLDED  # its launches (the plans and the per-call path alike)
    real = folded.launch
    monkeypatch.setattr(folded, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())  # fresh plans
    bm = triton_launch.resolve_configs(16)["fwd"][0]
    assert bm == 32
    q, k, v, do, kpm = _inputs(1, 128, 128, 2, 1, 16, torch.float64, "cpu", 0.0)
    ref = _run("reference", q, k, v, do, seg, dil)
    got = _run("triton", q, k, v, do, seg, dil, dtype=torch.float32)
    assert len(calls) == (1 if folds else 0)
    _close("out", got[0], ref[0], 2e-5)
    _close("lse", got[1], ref[1], 2e-5)
    for nm, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{nm}", g, r, 5e-5)
    hr = [(0, 2)] * len(seg)
    calls.clear()
    out, lse = triton_launch.forward(*(t.float() for t in (q, k, v)), None, seg, dil, False, 16**-0.5, hr, fold=True)
    assert calls == [1]
    _close("out (fold=True)", out, ref[0], 2e-5)
