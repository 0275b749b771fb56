"""GQA packing (``flags.set_gqa_pack``, issue 24 target 2): the per-branch forward and the dQ
kernel with the rows of several query heads of one kv group in one M tile
(``triton_kernels.dilated_fwd_pack_kernel`` / ``dilated_bwd_dq_pack_kernel``), against the
float64 reference and against the unpacked kernels, forward and backward.

Without CUDA the kernels run in Triton's interpreter at tiny sizes (tests/conftest.py). The
interpreter's bf16 loads are broken (tests/test_triton.py), so the half-precision cases there
use fp16; bf16 runs in the ``cuda`` case. Every interpreter case checks that the packed kernels
were launched (a plan's steps), so a switch that silently fell back would fail.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

pytest.importorskip("triton")

from dilated_attention import dilated_attention, flags
from dilated_attention.kernels import triton_launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = DEV == "cpu"
interp_only = pytest.mark.skipif(not INTERP, reason="interpreter tests run on the CPU")


@pytest.fixture
def pack(monkeypatch):
    """Set the switch for one test (restored after) and give each test a fresh plan table, so
    that plans built under another setting are not reused and this test's plans can be read."""
    monkeypatch.setattr(triton_launch, "_PLANS", OrderedDict())

    def set_(n):
        flags.set_gqa_pack(n)

    yield set_
    flags.set_gqa_pack(None)


def _inputs(b, nq, nk, h, hkv, d, dtype, device):
    q = torch.randn(b, nq, h, d, dtype=dtype, device=device)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, device=device)
    do = torch.randn(b, nq, h, d, dtype=dtype, device=device)
    return q, k, v, do


def _run(impl, q, k, v, do, seg, dil, dtype=None, **kw):
    dtype = dtype or q.dtype
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*xs, seg, dil, return_lse=True, impl=impl, **kw)
    grads = torch.autograd.grad(out, xs, do.to(dtype))
    return (out, lse, *grads)


NAMES = ("out", "lse", "dq", "dk", "dv")


def _maxerr(got, ref) -> float:
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any()
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    return torch.where(both_inf, torch.zeros_like(got), (got - ref).abs()).max().item()


def _packed_kernels_launched() -> tuple[int, int]:
    """(packed forward launches, packed dQ launches) in the plans built since the fixture."""
    nf = nq = 0
    for plan in triton_launch._PLANS.values():
        if plan is None:
            continue
        nf += sum(st.kernel is triton_launch._FWD_PACK for st in plan.fwd.steps)
        for b in plan._bwd.values():
            nq += sum(st.kernel is triton_launch._DQ_PACK for st in b.dq.steps)
    return nf, nq


# awkward lengths and branches: w = 5 (not a power of two), w % r != 0 (40 % 3), w > N
SEG, DIL = [5, 12, 40], [1, 2, 3]


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h,hkv", [(8, 4), (8, 2), (8, 1)], ids=["gqa2", "gqa4", "mqa"])
@pytest.mark.parametrize("nq,nk", [(37, 37), (19, 45)], ids=["n37", "q19k45"])
def test_gqa_pack_vs_reference_interpreter(seed, pack, dtype, causal, h, hkv, nq, nk):
    q, k, v, do = _inputs(1, nq, nk, h, hkv, 16, torch.float64, "cpu")
    ref = _run("reference", q, k, v, do, SEG, DIL, causal=causal)
    pack(0)
    off = _run("triton", q, k, v, do, SEG, DIL, dtype=dtype, causal=causal)
    assert _packed_kernels_launched() == (0, 0)
    pack(8)
    on = _run("triton", q, k, v, do, SEG, DIL, dtype=dtype, causal=causal)
    nf, ndq = _packed_kernels_launched()
    # branch (5, 1) packs at every ratio; (12, 2) from a ratio of 4 (the forward folds neither
    # here: w_min / r_max < BM)
    assert nf >= 1 and ndq >= 1, (nf, ndq)
    for name, a, b, r in zip(NAMES, on, off, ref, strict=True):
        e_on, e_off = _maxerr(a, r), _maxerr(b, r)
        if dtype == torch.float32:
            tol = 2e-5 if name in ("out", "lse") else 5e-5
            assert e_on <= tol, f"{name}: packed error {e_on:.3g} > {tol}"
            assert _maxerr(a, b) <= tol, f"{name}: packed vs unpacked {_maxerr(a, b):.3g}"
        else:  # fp16: as close to the exact result as the unpacked kernels, up to ~1 ulp
            assert e_on <= 1.5 * e_off + 2e-3, f"{name}: packed {e_on:.3g} vs unpacked {e_off:.3g}"


@interp_only
@pytest.mark.parametrize("setting", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_pack_padding_split_interpreter(seed, pack, setting, causal):
    # 2 batches, key padding (batch 0: every key padded, so out 0 / lse -inf), 3 query heads
    # per kv head (ceil(3 / r) heads share: a partial chunk), heads split between branches
    # (head ranges that start inside a kv group), seqlen_q < seqlen_k
    q, k, v, do = _inputs(2, 29, 41, 6, 2, 16, torch.float64, "cpu")
    kpm = torch.rand(2, 41) < 0.4
    kpm[0, :] = True
    seg, dil = [8, 20, 41], [1, 2, 1]
    for assign in ("all", "split"):
        kw = dict(causal=causal, key_padding_mask=kpm, head_assignment=assign)
        ref = _run("reference", q, k, v, do, seg, dil, **kw)
        pack(setting)
        got = _run("triton", q, k, v, do, seg, dil, dtype=torch.float32, **kw)
        assert torch.isneginf(got[1][0]).all() and (got[0][0] == 0).all()
        for name, a, r in zip(NAMES, got, ref, strict=True):
            tol = 2e-5 if name in ("out", "lse") else 5e-5
            assert _maxerr(a, r) <= tol, f"{assign} {name}: {_maxerr(a, r):.3g}"
    assert all(n >= 1 for n in _packed_kernels_launched())


@interp_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_pack_plan_matches_per_call_interpreter(seed, pack, monkeypatch, causal):
    # the plans and the per-call path (their oracle) launch the same packed kernels: same bits
    q, k, v, do = _inputs(1, 45, 45, 8, 1, 16, torch.float32, "cpu")
    pack(4)
    a = _run("triton", q, k, v, do, SEG, DIL, causal=causal)
    assert all(n >= 1 for n in _packed_kernels_launched())
    monkeypatch.setattr(triton_launch, "USE_PLANS", False)
    b = _run("triton", q, k, v, do, SEG, DIL, causal=causal)
    for name, x, y in zip(NAMES, a, b, strict=True):
        assert torch.equal(x, y), name


def test_gqa_pack_switch(monkeypatch):
    monkeypatch.delenv(flags.ENV_GQA_PACK, raising=False)
    flags.set_gqa_pack(None)
    try:
        assert flags.gqa_pack() == flags.GQA_PACK_DEFAULT == 0  # off by default
        monkeypatch.setenv(flags.ENV_GQA_PACK, "4")
        assert flags.gqa_pack() == 0  # the environment is read at the first call after a set
        flags.set_gqa_pack(None)
        assert flags.gqa_pack() == 4
        monkeypatch.setenv(flags.ENV_GQA_PACK, "yes")
        flags.set_gqa_pack(None)
        assert flags.gqa_pack() == 0
        flags.set_gqa_pack(2)
        assert flags.gqa_pack() == 2
        for bad in (True, -1, 2.0, "4"):
            with pytest.raises(TypeError):
                flags.set_gqa_pack(bad)
    finally:
        flags.set_gqa_pack(None)


def test_plan_key_includes_the_switch():
    # a plan built under one setting is never reused under another (its launches differ)
    q = torch.randn(1, 32, 4, 16)
    k = v = torch.randn(1, 32, 1, 16)
    args = (q, k, v, None, (8, 16), (1, 2), True, 0.25, [(0, 4), (0, 4)])
    try:
        flags.set_gqa_pack(0)
        off = triton_launch.plan_key(*args)
        flags.set_gqa_pack(4)
        assert triton_launch.plan_key(*args) != off
    finally:
        flags.set_gqa_pack(None)


@pytest.mark.parametrize(
    "nh,hkv,r,bm,varlen,setting,want",
    [
        (16, 16, 1, 128, False, 8, 1),  # MHA: nothing shares
        (16, 4, 1, 128, False, 8, 4),  # 4 heads share at r = 1
        (16, 4, 2, 128, False, 8, 2),
        (16, 4, 4, 128, False, 8, 1),  # r >= rep: each head its own offset
        (16, 1, 1, 128, False, 8, 8),  # MQA: the setting caps it
        (16, 1, 1, 128, False, 0, 1),  # off
        (16, 1, 1, 32, False, 8, 4),  # BM // 8
        (16, 1, 3, 128, False, 8, 4),  # ceil(16 / 3) = 6 -> 4 (a power of two)
        (16, 1, 1, 128, True, 8, 1),  # packed documents: not packed
    ],
)
def test_gqa_pack_factor(nh, hkv, r, bm, varlen, setting, want):
    assert triton_launch.gqa_pack_factor(nh, hkv, r, bm, varlen, setting) == want


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hkv", [4, 1], ids=["gqa4", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gqa_pack_cuda(seed, pack, dtype, causal, hkv):
    # real tiles (BM = 128, P up to 8), LongNet-like branches, 6000 rows (partial segments):
    # packed vs unpacked both against the float32 reference of the same inputs; the packed
    # error may exceed the unpacked one by at most 10% + one ulp of the result's dtype at its
    # largest magnitude (a result rounded the other way at its largest element; lse: float32)
    n, h, d = 6000, 16, 128
    seg, dil = [1024, 2048, 4096], [1, 2, 4]
    q, k, v, do = _inputs(1, n, n, h, hkv, d, dtype, "cuda")
    ref = _run("reference", q, k, v, do, seg, dil, dtype=torch.float32, causal=causal)
    pack(0)
    off = _run("triton", q, k, v, do, seg, dil, causal=causal)
    pack(8)
    on = _run("triton", q, k, v, do, seg, dil, causal=causal)
    assert all(x >= 1 for x in _packed_kernels_launched())
    for name, a, b, r in zip(NAMES, on, off, ref, strict=True):
        e_on, e_off = _maxerr(a, r), _maxerr(b, r)
        amax = r.double().nan_to_num(posinf=0, neginf=0).abs().max().item()
        slack = torch.finfo(a.dtype).eps * amax
        assert e_on <= 1.1 * e_off + slack, f"{name}: packed {e_on:.3g} vs unpacked {e_off:.3g}"
