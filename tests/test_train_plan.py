"""Training launch plans (kernels/triton_launch.py ``TrainPlan``, issue 23 item 3).

A plan is built once per configuration (``plan_key``) and holds the launches of the forward
and the backward: a call is one dict lookup, its allocations and its launches. These tests hold
it to the per-call path (``forward_per_call`` / ``backward_per_call``, the code every call ran
before): the same launches in the same order with the same arguments, the same bits on a plan
miss and on a plan hit, a key that separates what the launches depend on, and, with stand-in
launchers (the CPU cannot launch compiled kernels), direct launches that repeat what Triton's
path was given. The CUDA test compares plans with the per-call path bit for bit on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers import device_switch, poisoned_empty  # noqa: E402

from dilated_attention import dilated_attention, flags  # noqa: E402
from dilated_attention.branches import branch_head_ranges  # noqa: E402
from dilated_attention.kernels import direct_launch, select  # noqa: E402
from dilated_attention.kernels import triton_launch as L  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
interp_only = pytest.mark.skipif(
    DEV != "cpu" or not select.interpreting(), reason="interpreter tests run on the CPU"
)


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    monkeypatch.setattr(L, "USE_PLANS", True)
    yield


def _inputs(b, nq, nk, h, hkv, d, dtype, pad=False, device=DEV):
    q = torch.randn(b, nq, h, d, dtype=dtype, device=device)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, device=device)
    do = torch.randn(b, nq, h, d, dtype=dtype, device=device)
    kpm = (torch.rand(b, nk, device=device) < 0.2) if pad else None
    return q, k, v, do, kpm


def _both_paths(q, k, v, do, kpm, seg, dil, causal, hr, monkeypatch, **kw):
    """(per-call results, plan miss results, plan hit results): out, lse, dq, dk, dv each."""
    scale = q.shape[-1] ** -0.5
    bkw = {k_: v_ for k_, v_ in kw.items() if k_ != "fold"}
    out, lse = L.forward_per_call(q, k, v, kpm, seg, dil, causal, scale, hr, **kw)
    want = (out, lse, *L.backward_per_call(do, q, k, v, kpm, out, lse, seg, dil, causal, scale, hr, **bkw))
    res = []
    for _ in range(2):
        with monkeypatch.context() as m:
            poisoned_empty(m)
            sink = []
            o, s = L.forward(q, k, v, kpm, seg, dil, causal, scale, hr, plan_sink=sink, **kw)
            grads = L.backward(do, q, k, v, kpm, out, lse, seg, dil, causal, scale, hr, plan=sink[0], **bkw)
        assert sink[0] is not None
        res.append((o, s, *grads))
    return want, res


def _assert_same(want, got, what=""):
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), want, got, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), (what, name)
        assert torch.equal(x, y), f"{what} {name}: max |diff| {(x.double() - y.double()).abs().max().item()}"


CASES = {
    # b, nq, nk, h, hkv, seg, dil, head_assignment, dtype, pad, kw
    "longnet-fp16": (1, 64, 64, 4, 4, (8, 16, 32), (1, 2, 4), "all", torch.float16, False, {}),
    "gqa-pad-b2": (2, 40, 40, 4, 2, (8, 16), (1, 2), "all", torch.float16, True, {}),
    "split-heads": (1, 48, 48, 6, 3, (8, 16, 32), (1, 2, 4), "split", torch.float16, False, {}),
    "first-r2": (1, 48, 48, 4, 2, (16, 8), (2, 1), "all", torch.float16, False, {}),
    "nq<nk-mqa": (1, 30, 56, 4, 1, (8, 16), (1, 2), "all", torch.float16, False, {}),
    "fp32": (1, 40, 40, 4, 2, (8, 16), (1, 2), "all", torch.float32, True, {}),
    "lo-ranges": (1, 64, 64, 2, 2, (8, 16), (1, 2), "all", torch.float16, False, dict(lo_rows=1)),
    "lo-ranges-split": (1, 64, 64, 4, 2, (8, 16), (1, 2), "split", torch.float16, False, dict(lo_rows=16)),
    "fold": (1, 48, 48, 4, 2, (8, 16), (1, 2), "all", torch.float16, True, dict(fold=True)),
    "no-fold": (1, 48, 48, 4, 2, (8, 16), (1, 2), "all", torch.float16, False, dict(fold=False)),
    "config": (1, 48, 48, 4, 2, (8, 16), (1, 2), "all", torch.float16, False,
               dict(config={"fwd": (16, 16, 1, 1), "dq": (16, 16, 1, 1)})),
}  # fmt: skip


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_plan_miss_and_hit_equal_per_call_path(seed, monkeypatch, case, causal):
    b, nq, nk, h, hkv, seg, dil, ha, dtype, pad, kw = CASES[case]
    q, k, v, do, kpm = _inputs(b, nq, nk, h, hkv, 16, dtype, pad)
    hr = branch_head_ranges(h, len(seg), ha)
    want, (miss, hit) = _both_paths(q, k, v, do, kpm, seg, dil, causal, hr, monkeypatch, **kw)
    assert len(L._PLANS) == 1, "one configuration, one plan"
    _assert_same(want, miss, "miss")
    _assert_same(want, hit, "hit")


@interp_only
def test_fill_skipped_only_where_the_first_branch_writes_everything(seed):
    q, k, v, _, _ = _inputs(1, 48, 48, 4, 2, 16, torch.float16)
    args = (None, (8, 16, 32), (1, 2, 4), True, 0.25)
    allh = L.get_plan(q, k, v, *args, branch_head_ranges(4, 3, "all"))
    split = L.get_plan(q, k, v, *args, branch_head_ranges(4, 3, "split"))
    r2 = L.get_plan(q, k, v, None, (16, 8), (2, 1), True, 0.25, [(0, 4)] * 2)
    assert not allh.fwd_fill and split.fwd_fill and r2.fwd_fill
    longq = L.get_plan(q, k[:, :40], v[:, :40], *args, branch_head_ranges(4, 3, "all"))
    assert longq.fwd_fill  # more queries than keys (the front door refuses it): fill as before
    assert allh.fwd_comp  # the lo buffer is unfilled too
    # the backward: dq needs the forward's rule, dk / dv also no key before the first query;
    # the third argument: every row is a sequence's (batch, or packed with checked offsets)
    hr = branch_head_ranges(4, 3, "all")
    assert L._bwd_writes_all(L.branch_list((8, 16, 32), (1, 2, 4), hr), 4, True, 0) == (True, True)
    assert L._bwd_writes_all(L.branch_list((8, 16, 32), (1, 2, 4), hr), 4, True, 8) == (True, False)
    assert L._bwd_writes_all(L.branch_list((8, 16, 32), (1, 2, 4), hr), 4, False, 0) == (False, False)
    split_hr = branch_head_ranges(4, 3, "split")
    assert L._bwd_writes_all(L.branch_list((8, 16, 32), (1, 2, 4), split_hr), 4, True, 0) == (False, False)
    assert L._bwd_writes_all(L.branch_list((16, 8), (2, 1), [(0, 4)] * 2), 4, True, 0) == (False, False)


BWD_FILL_CASES = ["longnet-fp16", "gqa-pad-b2", "nq<nk-mqa", "lo-ranges", "split-heads", "fp32"]


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", BWD_FILL_CASES)
def test_backward_without_fills_equals_backward_with_them(seed, monkeypatch, case, causal):
    """dq, dk, dv (and their lo buffers) are allocated empty where the first branch's launches
    store every element (FIRST, ``_bwd_writes_all``): with those buffers full of NaN / garbage,
    the per-call path and the plan give the bits of the old code (zero-filled buffers, every
    branch adding), which the rule forced off reproduces."""
    b, nq, nk, h, hkv, seg, dil, ha, dtype, pad, kw = CASES[case]
    q, k, v, do, kpm = _inputs(b, nq, nk, h, hkv, 16, dtype, pad)
    hr = branch_head_ranges(h, len(seg), ha)
    scale = 16**-0.5
    bkw = {k_: v_ for k_, v_ in kw.items() if k_ != "fold"}
    out, lse = L.forward_per_call(q, k, v, kpm, seg, dil, causal, scale, hr, **kw)
    with monkeypatch.context() as m:
        m.setattr(L, "_bwd_writes_all", lambda *a: (False, False))
        want = L.backward_per_call(do, q, k, v, kpm, out, lse, seg, dil, causal, scale, hr, **bkw)
    expect = L._bwd_writes_all(L.branch_list(seg, dil, hr), h, True, nk - nq)
    assert expect == {"longnet-fp16": (True, True), "gqa-pad-b2": (True, True),
                      "nq<nk-mqa": (True, False), "lo-ranges": (True, True),
                      "split-heads": (False, False), "fp32": (True, True)}[case]  # fmt: skip
    for path in ("per_call", "plan"):
        with monkeypatch.context() as m:
            poisoned_empty(m)
            if path == "per_call":
                got = L.backward_per_call(do, q, k, v, kpm, out, lse, seg, dil, causal, scale, hr, **bkw)
            else:
                sink = []
                L.forward(q, k, v, kpm, seg, dil, causal, scale, hr, plan_sink=sink, **kw)
                got = L.backward(do, q, k, v, kpm, out, lse, seg, dil, causal, scale, hr, plan=sink[0], **bkw)
                b_ = next(iter(sink[0]._bwd.values()))
                assert (b_.q_fill, b_.kv_fill) == (not expect[0], not expect[1])
        for name, x, y in zip(("dq", "dk", "dv"), want, got, strict=True):
            assert torch.equal(x, y), f"{path} {name}: max |diff| {(x.double() - y.double()).abs().max().item()}"


# ------------------------------------------------------------------ the launches themselves


def _record_launches(monkeypatch):
    """Every DirectKernel launch as (kernel, grid, tensor descriptors, aliasing, tail, options)."""
    log = []
    real = direct_launch.DirectKernel.launch

    def launch(self, grid, args, options):
        n = self.n_ptr
        ts = args[:n]
        desc = tuple((tuple(t.shape), t.stride(), t.dtype) for t in ts)
        ptrs = [t.data_ptr() for t in ts]
        alias = tuple(ptrs.index(p) for p in ptrs)  # which slots share a pointer (dummies)
        log.append((self.kernel.__name__ if hasattr(self.kernel, "__name__") else str(self.kernel),
                    tuple(grid), desc, alias, tuple(args[n:]), tuple(options.items())))  # fmt: skip
        return real(self, grid, args, options)

    monkeypatch.setattr(direct_launch.DirectKernel, "launch", launch)
    return log


@interp_only
@pytest.mark.parametrize("case", ["longnet-fp16", "gqa-pad-b2", "lo-ranges", "fold", "nq<nk-mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_launches_are_the_per_call_launches(seed, monkeypatch, case, causal):
    b, nq, nk, h, hkv, seg, dil, ha, dtype, pad, kw = CASES[case]
    q, k, v, do, kpm = _inputs(b, nq, nk, h, hkv, 16, dtype, pad)
    hr = branch_head_ranges(h, len(seg), ha)
    log = _record_launches(monkeypatch)
    _both_paths(q, k, v, do, kpm, seg, dil, causal, hr, monkeypatch, **kw)
    n = len(log) // 3
    assert n * 3 == len(log) and n > 0
    per_call, miss, hit = log[:n], log[n : 2 * n], log[2 * n :]
    assert miss == per_call
    assert hit == per_call


# ------------------------------------------------------------------------------- the key


def test_plan_key_separates_what_the_launches_depend_on():
    q, k, v, _, kpm = _inputs(1, 32, 32, 4, 2, 16, torch.float16, pad=True, device="cpu")
    seg, dil, hr = (8, 16), (1, 2), [(0, 4), (0, 4)]
    base = L.plan_key(q, k, v, None, seg, dil, True, 0.25, hr)
    assert L.plan_key(q.clone(), k.clone(), v.clone(), None, list(seg), list(dil), True, 0.25, list(hr)) == base
    kwide = torch.randn(1, 32, 4, 16).half()[:, :, :2]  # same shape, other strides
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    others = [
        L.plan_key(q, kwide, v, None, seg, dil, True, 0.25, hr),  # k strides
        L.plan_key(q, k, kwide, None, seg, dil, True, 0.25, hr),  # v strides
        L.plan_key(qt, k, v, None, seg, dil, True, 0.25, hr),  # q strides
        L.plan_key(q.float(), k.float(), v.float(), None, seg, dil, True, 0.25, hr),  # dtype
        L.plan_key(q[:, :16], k, v, None, seg, dil, True, 0.25, hr),  # seqlen_q
        L.plan_key(q, k[:, :24], v[:, :24], None, seg, dil, True, 0.25, hr),  # seqlen_k
        L.plan_key(q, k, v, None, seg, dil, False, 0.25, hr),  # causal
        L.plan_key(q, k, v, None, seg, dil, True, 0.3, hr),  # scale
        L.plan_key(q, k, v, None, (8, 32), dil, True, 0.25, hr),  # segment lengths
        L.plan_key(q, k, v, None, seg, (1, 4), True, 0.25, hr),  # dilation rates
        L.plan_key(q, k, v, None, seg, dil, True, 0.25, [(0, 2), (2, 4)]),  # head ranges
        L.plan_key(q, k, v, kpm, seg, dil, True, 0.25, hr),  # a padding mask
        L.plan_key(q, k, v, torch.zeros(1, 64, dtype=torch.bool)[:, ::2], seg, dil, True, 0.25, hr),  # its stride
        L.plan_key(q, k, v, None, seg, dil, True, 0.25, hr, config={"fwd": (16, 16, 1, 1)}),  # configs
        L.plan_key(q, k, v, None, seg, dil, True, 0.25, hr, fold=False),  # fold
        L.plan_key(q, k, v, None, seg, dil, True, 0.25, hr, lo_rows=8),  # lo ranges
    ]
    assert all(o != base for o in others)
    assert len(set(others)) == len(others)


def test_plan_key_includes_the_module_knobs(monkeypatch):
    q, k, v, _, _ = _inputs(1, 32, 32, 2, 2, 16, torch.float16, device="cpu")
    base = L.plan_key(q, k, v, None, (8,), (1,), True, 0.25, [(0, 2)])
    monkeypatch.setattr(L, "LO_MIN_BYTES", 0)  # mem_account.py and the memory tests set it
    assert L.plan_key(q, k, v, None, (8,), (1,), True, 0.25, [(0, 2)]) != base


@interp_only
def test_plans_per_shape_and_bounded(seed, monkeypatch):
    seg, dil = (8, 16), (1, 2)
    hr = [(0, 2), (0, 2)]
    for n in (24, 40):  # two shapes: two plans, each right
        q, k, v, do, _ = _inputs(1, n, n, 2, 2, 16, torch.float16)
        want, (miss, hit) = _both_paths(q, k, v, do, None, seg, dil, True, hr, monkeypatch)
        _assert_same(want, hit, f"n={n}")
    assert len(L._PLANS) == 2
    monkeypatch.setattr(L, "_MAX_PLANS", 2)
    q, k, v, _, _ = _inputs(1, 16, 16, 2, 2, 16, torch.float16)
    L.get_plan(q, k, v, None, seg, dil, True, 0.25, hr)
    assert len(L._PLANS) == 2  # the oldest went


@interp_only
def test_public_call_keeps_the_plan_for_the_backward(seed, monkeypatch):
    q, k, v, do, _ = _inputs(1, 32, 32, 4, 2, 16, torch.float16)
    xs = [t.requires_grad_() for t in (q, k, v)]
    looked = []
    real = L.get_plan
    monkeypatch.setattr(L, "get_plan", lambda *a, **kw: looked.append(1) or real(*a, **kw))
    out = dilated_attention(*xs, (8, 16), (1, 2), causal=True, impl="triton")
    grads = torch.autograd.grad(out, xs, do)
    assert len(looked) == 1  # the forward's lookup; the backward got the plan from ctx
    monkeypatch.setattr(L, "USE_PLANS", False)
    out2 = dilated_attention(*xs, (8, 16), (1, 2), causal=True, impl="triton")
    grads2 = torch.autograd.grad(out2, xs, do)
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2, strict=True):
        assert torch.equal(a, b)


@interp_only
def test_plans_hold_no_tensor_of_a_call(seed):
    # a plan lives on after the call (64 kept): holding q would keep a long-N q alive
    import gc
    import weakref

    q, k, v, do, kpm = _inputs(1, 32, 32, 4, 2, 16, torch.float16, pad=True)
    seg, dil, hr = (8, 16), (1, 2), [(0, 4), (0, 4)]
    refs = [weakref.ref(t) for t in (q, k, v, do, kpm)]
    for fold in (None, False):
        sink = []
        out, lse = L.forward(q, k, v, kpm, seg, dil, False, 0.25, hr, fold=fold, plan_sink=sink)
        grads = L.backward(do, q, k, v, kpm, out, lse, seg, dil, False, 0.25, hr, plan=sink[0])
        refs += [weakref.ref(t) for t in (out, lse, *grads)]
    assert len(L._PLANS) == 2
    del q, k, v, do, kpm, out, lse, grads, sink
    gc.collect()
    assert all(r() is None for r in refs)


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("same", [True, False], ids=["shared-offsets", "own-offsets"])
def test_varlen_plan_equals_per_call_path(seed, monkeypatch, causal, same):
    # packed documents: (1, total, H, D) with int32 offsets; folded when queries and keys share
    # the offsets and the call is not causal (at these sizes w_min / r_max is below the
    # interpreter's BM: fold as if it filled the tile, in a fresh plan table)
    monkeypatch.setattr(L, "fold_fills_tile", lambda geo, bm: True)
    monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    h, hkv, d = 4, 2, 16
    qlens, klens = [17, 9, 14], ([17, 9, 14] if same else [20, 9, 30])
    cu_q = torch.tensor([0, 17, 26, 40], dtype=torch.int32)
    cu_k = cu_q if same else torch.tensor([0, 20, 29, 59], dtype=torch.int32)
    q = torch.randn(1, sum(qlens), h, d, dtype=torch.float16)
    k = torch.randn(1, sum(klens), hkv, d, dtype=torch.float16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    docs = L.Docs(cu_q, cu_k, max(qlens), max(klens))
    seg, dil, hr = (8, 16), (1, 2), [(0, 4), (0, 4)]
    want, (miss, hit) = _both_paths(q, k, v, do, None, seg, dil, causal, hr, monkeypatch, docs=docs)
    _assert_same(want, miss, "miss")
    _assert_same(want, hit, "hit")
    plan = next(iter(L._PLANS.values()))
    assert plan.varlen and plan.folded == (same and not causal)
    # other offsets of the same layout: the same plan, their own result
    cu2 = torch.tensor([0, 14, 23, 40], dtype=torch.int32)  # query lengths 14, 9, 17
    docs3 = L.Docs(cu2, cu2 if same else cu_k, max(qlens), max(klens))
    key = L.plan_key(q, k, v, None, seg, dil, causal, 0.25, hr, docs=docs)
    assert L.plan_key(q, k, v, None, seg, dil, causal, 0.25, hr, docs=docs3) == key
    want2 = L.forward_per_call(q, k, v, None, seg, dil, causal, 0.25, hr, docs=docs3)
    got2 = L.forward(q, k, v, None, seg, dil, causal, 0.25, hr, docs=docs3)
    assert torch.equal(want2[0], got2[0]) and torch.equal(want2[1], got2[1])
    # max lengths size the grid through their bucket (17 and 21 -> 32, 33 -> 48); the number
    # of documents is no part of the key (a call's grids count them)
    same_bucket = L.Docs(cu2, cu2 if same else cu_k, max(qlens) + 4, max(klens) + (4 if same else 2))
    assert L.plan_key(q, k, v, None, seg, dil, causal, 0.25, hr, docs=same_bucket) == key
    c2 = cu2[[0, 2, 3]]  # two documents
    two = L.Docs(c2, c2 if same else cu_k[[0, 2, 3]], 23, 23 if same else 30)
    assert L.plan_key(q, k, v, None, seg, dil, causal, 0.25, hr, docs=two) == key
    other = L.Docs(cu2, cu2 if same else cu_k, 33, 33 if same else 49)
    assert L.plan_key(q, k, v, None, seg, dil, causal, 0.25, hr, docs=other) != key


# ------------------------------------------------------ packed training steps (varying docs)

# one packed stream of 48 rows per step, as LongNetLM flattens a batch: the documents' count (2
# to 24: the flat grids' slots per call) and the longest one change from step to step (empty and
# one-token documents included); the longest lengths fall in three buckets (grid_bucket: 48,
# 32, 16; per step 48, 32, 32, 48, 16: two steps reuse a plan)
STEP_DOCS = [[20, 0, 28], [1, 30, 1, 16], [17, 31], [0, 48, 0],
             [0, 2, 1, 0, 0, 3, 1, 4, 2, 0, 5, 1, 1, 0, 8, 2, 3, 0, 1, 6, 2, 0, 6, 0]]  # fmt: skip


def test_grid_bucket():
    assert [L.grid_bucket(n) for n in (0, 1, 16, 17, 32, 33, 48, 49)] == [0, 16, 16, 32, 32, 48, 48, 64]
    for n in range(1, 5000):
        b = L.grid_bucket(n)
        assert n <= b <= max(n * 5 // 4, n + 15) and b % 16 == 0
    assert len({L.grid_bucket(n) for n in range(16385, 32769)}) == 4  # 4 per octave


def _count_plan_builds(monkeypatch) -> list:
    built = []
    real = L.TrainPlan.__init__

    def init(self, *a, **kw):
        built.append(kw.get("docs") if "docs" in kw else a[-1])
        real(self, *a, **kw)

    monkeypatch.setattr(L.TrainPlan, "__init__", init)
    return built


@interp_only
@pytest.mark.parametrize("causal,fold", [(True, None), (False, None), (False, True)],
                         ids=["causal", "non-causal", "non-causal-folded"])  # fmt: skip
def test_packed_training_steps_reuse_plans(seed, monkeypatch, causal, fold):
    """Steps of a packed training loop (documents and max_seqlen varying): forward and backward
    through the public varlen call equal the per-call path (USE_PLANS False) bit for bit and
    the reference closely, with one plan per bucket of the longest length, not one per step."""
    from dilated_attention import dilated_attention_varlen

    if fold:  # fold at these sizes (w_min / r_max is below the interpreter's BM)
        monkeypatch.setattr(L, "fold_fills_tile", lambda geo, bm: True)
    built = _count_plan_builds(monkeypatch)
    h, hkv, d = 2, 1, 16  # GQA 2/1: every residue of r = 2 has a head
    seg, dil = (10, 20), (1, 2)  # 48 rows: no multiple of w, so a last slot need not be spare
    for step, lens in enumerate(STEP_DOCS):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        mx = max(lens)
        q = torch.randn(48, h, d, requires_grad=True)
        k = torch.randn(48, hkv, d, requires_grad=True)
        v = torch.randn(48, hkv, d, requires_grad=True)
        do = torch.randn(48, h, d)
        res = {}
        for impl, plans in (("triton", True), ("triton", False), ("reference", True)):
            monkeypatch.setattr(L, "USE_PLANS", plans)
            out = dilated_attention_varlen(q, k, v, cu, cu, mx, mx, seg, dil, causal=causal,
                                           impl=impl)  # fmt: skip
            res[impl, plans] = (out, *torch.autograd.grad(out, (q, k, v), do))
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), res["triton", True],
                                 res["triton", False], res["reference", True], strict=True):  # fmt: skip
            assert torch.equal(a, b), f"step {step} {lens} {name}: plan != per-call path"
            torch.testing.assert_close(a, r, atol=2e-5, rtol=2e-5, msg=f"step {step} {name}")
    buckets = {L.grid_bucket(max(lens)) for lens in STEP_DOCS}
    assert len(built) == len(buckets) < len(STEP_DOCS), "one plan per bucket, not per step"
    assert all(p is not None and p.varlen and p.folded == bool(fold) for p in L._PLANS.values())


@interp_only
def test_packed_plan_direct_launches_scale_the_grid_per_call(seed, monkeypatch):
    """A packed plan's kept launchers take the call's grid, the flat grid of (document,
    segment) slots: blocks per segment x (total // w + documents) on the first axis, heads on
    the second (stand-in launchers), with the arguments Triton's path was given but the call's
    document count (NDOCS)."""
    spies = _stand_ins(monkeypatch)
    try:
        h, hkv, d = 4, 2, 16
        seg, dil, hr = (8, 16), (1, 2), [(0, 4), (0, 4)]
        q = torch.randn(1, 48, h, d)
        k, v = torch.randn(1, 48, hkv, d), torch.randn(1, 48, hkv, d)
        do = torch.randn_like(q)
        calls = []
        for lens in ([20, 0, 28], [1, 30, 1, 16], [17, 31]):  # one bucket (32)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            docs = L.Docs(cu, cu, max(lens), max(lens))
            sink = []
            out, lse = L.forward(q, k, v, None, seg, dil, True, 0.25, hr, docs=docs, plan_sink=sink)
            L.backward(do, q, k, v, None, out, lse, seg, dil, True, 0.25, hr, docs=docs, plan=sink[0])
            calls.append(len(lens))
        assert len(L._PLANS) == 1
        plan = sink[0]
        bw = next(iter(plan._bwd.values()))
        assert plan.fwd.direct and bw.dkdv.direct and bw.dq.direct
        # the first call ran Triton's path (3 documents); the next two the launchers
        n_jit = {name: len(s.calls) for name, s in spies.items()}
        for name in ("_FWD", "_DKDV", "_DQ"):
            s = spies[name]
            direct = s.compiled.run.calls
            assert len(direct) == 2 * len(s.calls), name
            per_call = len(s.calls)
            n_ptr = getattr(L, name).n_ptr
            for i, ndocs in enumerate(calls[1:]):
                for (grid, args, kwargs), dcall in zip(s.calls, direct[i * per_call:(i + 1) * per_call],
                                                       strict=True):  # fmt: skip
                    tail = tuple(args[n_ptr:]) + tuple(kwargs[nm] for nm in s.arg_names[len(args):])
                    a = dict(zip(s.arg_names[n_ptr:], tail, strict=True))
                    per_seg = a["NNB"] if name == "_DKDV" else a["NM"]
                    heads = a["HKV"] * a["NI"] if name == "_DKDV" else a["NHB"]
                    assert a["NDOCS"] == calls[0] and a["VARLEN"]
                    assert grid == (per_seg * (48 // a["W"] + calls[0]), heads), name
                    assert dcall[:3] == (per_seg * (48 // a["W"] + ndocs), heads, 1), name
                    assert dcall[13 + n_ptr:] == (ndocs, *tail[1:]), name
        assert n_jit == {name: len(s.calls) for name, s in spies.items()}
        # no document: nothing launched, the buffers as the per-call path leaves them
        empty = torch.zeros(1, dtype=torch.int32)
        n_direct = len(_direct_calls(spies))
        out, lse = L.forward(q[:, :0], k[:, :0], v[:, :0], None, seg, dil, True, 0.25, hr,
                             docs=L.Docs(empty, empty, 0, 0))  # fmt: skip
        assert len(_direct_calls(spies)) == n_direct and out.shape == (1, 0, h, d)
    finally:
        flags.set_direct_launch(None)


# ------------------------------------------------------------ stand-in launchers (CPU, no GPU)


class _FakeLauncher:
    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


_FakeLauncher.__name__ = "CudaLauncher"


class _FakeCompiled:
    def __init__(self, name):
        self.function = name
        self.packed_metadata = (4, 1, 0)
        self.run = _FakeLauncher()
        self.run.launch_cooperative_grid = False
        self.run.launch_pdl = False
        self.run.global_scratch_size = 0
        self.run.profile_scratch_size = 0


class _JitSpy:
    """A ``triton.jit`` kernel on a GPU, as far as the plans can tell: runs the interpreted
    kernel, records the arguments, returns a stand-in ``CompiledKernel``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.__name__ = kernel.__name__
        self.calls = []
        self.compiled = _FakeCompiled(kernel.__name__)

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            self.kernel[grid](*args, **kwargs)
            return self.compiled

        return call


def _stand_ins(monkeypatch):
    monkeypatch.setattr(direct_launch, "tensor_device", lambda t: 0)
    monkeypatch.setattr(direct_launch, "current_device", lambda: 0)
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 7)
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
    monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
    flags.set_direct_launch(True)
    spies = {}
    for name in ("_FWD_FOLDED", "_FWD", "_DELTA", "_DKDV", "_DQ"):
        dk = getattr(L, name)
        monkeypatch.setattr(dk, "plans", {})
        spy = _JitSpy(dk.kernel)
        monkeypatch.setattr(dk, "kernel", spy)
        spies[name] = spy
    return spies


def _direct_calls(spies):
    return [c for s in spies.values() for c in s.compiled.run.calls]


@interp_only
@pytest.mark.parametrize("fold", [None, False])
def test_direct_launches_repeat_tritons_arguments(seed, monkeypatch, fold):
    q, k, v, do, kpm = _inputs(1, 32, 32, 4, 2, 16, torch.float16, pad=True)
    seg, dil, hr = (8, 16), (1, 2), [(0, 4), (0, 4)]
    ref = L.forward_per_call(q, k, v, kpm, seg, dil, False, 0.25, hr, fold=fold)[0]
    spies = _stand_ins(monkeypatch)
    try:
        sink = []
        out, lse = L.forward(q, k, v, kpm, seg, dil, False, 0.25, hr, fold=fold, plan_sink=sink)
        grads = L.backward(do, q, k, v, kpm, out, lse, seg, dil, False, 0.25, hr, plan=sink[0])
        plan = sink[0]
        jit = [(name, c) for name, s in spies.items() for c in s.calls]
        assert jit and not _direct_calls(spies)  # the first call: Triton's path only
        assert plan.fwd.direct
        bw = next(iter(plan._bwd.values()))
        assert bw.delta.direct and bw.dkdv.direct and bw.dq.direct
        # the second call: the launchers only, with Triton's argument lists (pointers as ints)
        out2, lse2 = L.forward(q, k, v, kpm, seg, dil, False, 0.25, hr, fold=fold)
        L.backward(do, q, k, v, kpm, out, lse, seg, dil, False, 0.25, hr, plan=plan)
        assert sum(len(s.calls) for s in spies.values()) == len(jit)
        direct = _direct_calls(spies)
        assert len(direct) == len(jit)
        # in launch order per kernel: same grid, same non-pointer arguments, same constexprs
        for name, s in spies.items():
            for (grid, args, kwargs), d in zip(s.calls, s.compiled.run.calls, strict=True):
                g = tuple(grid) + (1,) * (3 - len(grid))
                assert d[:13] == (*g, 7, s.compiled.function, False, False, None, None, (4, 1, 0), None, None, None)
                n_ptr = getattr(L, name).n_ptr
                names = list(s.arg_names)
                want_tail = tuple(args[n_ptr:]) + tuple(kwargs[nm] for nm in names[len(args):])
                assert d[13 + n_ptr :] == want_tail, name
                assert all(isinstance(p, int) for p in d[13 : 13 + n_ptr])
                # the inputs' pointers are the call's (buffers are fresh per call)
                for i, a in enumerate(args[:n_ptr]):
                    if a is q or a is k or a is v:
                        assert d[13 + i] == a.data_ptr()
        assert torch.equal(out, ref)  # the first call ran the (interpreted) kernels
        del grads, out2, lse2
    finally:
        flags.set_direct_launch(None)


@interp_only
def test_direct_path_needs_alignment_hooks_and_the_switch(seed, monkeypatch):
    spies = _stand_ins(monkeypatch)
    try:
        q, k, v, do, _ = _inputs(1, 32, 32, 2, 2, 16, torch.float16)
        seg, dil, hr = (8, 16), (1, 2), [(0, 2), (0, 2)]
        L.forward(q, k, v, None, seg, dil, True, 0.25, hr)  # builds, collects the launchers
        n_jit = sum(len(s.calls) for s in spies.values())
        L.forward(q, k, v, None, seg, dil, True, 0.25, hr)
        assert sum(len(s.calls) for s in spies.values()) == n_jit and _direct_calls(spies)
        n_direct = len(_direct_calls(spies))

        def jit_only(what):
            before = sum(len(s.calls) for s in spies.values())
            L.forward(*what[:3], None, seg, dil, True, 0.25, hr)
            assert len(_direct_calls(spies)) == n_direct, "reached a compiled binary"
            assert sum(len(s.calls) for s in spies.values()) > before

        flat = torch.empty(q.numel() + 8, dtype=q.dtype)
        qm = flat[1 : 1 + q.numel()].view(q.shape)  # 2 bytes past a 16-byte boundary
        qm.copy_(q)
        jit_only((qm, k, v))
        monkeypatch.setattr(direct_launch, "hooks_idle", lambda: False)
        jit_only((q, k, v))
        monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
        # another current device: the plan switches to its own (the device guard) and launches
        # directly there, forward and backward, leaving the current device as it found it
        sw = device_switch(monkeypatch, 1)
        out, lse = L.forward(q, k, v, None, seg, dil, True, 0.25, hr)
        assert len(_direct_calls(spies)) > n_direct and sw.entered == [0] and sw.current == 1
        n_direct = len(_direct_calls(spies))
        L.backward(do, q, k, v, None, out, lse, seg, dil, True, 0.25, hr)
        assert sw.entered == [0, 0] and sw.current == 1
        sw.current = 0
        n_direct = len(_direct_calls(spies))
        flags.set_direct_launch(False)
        jit_only((q, k, v))
    finally:
        flags.set_direct_launch(None)


# --------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_cuda_plans_equal_per_call_path():
    """Plans (their first call through Triton, later calls through the kept launchers) against
    the per-call path (USE_PLANS False), bit for bit: out, lse, dq, dk, dv. The Gluon forward and
    backward are off: they run before any plan (tests/test_gluon_fwd.py, test_gluon_bwd.py test
    them), and a plan whose kernels never ran has no launchers to check."""
    from dilated_attention import flags

    flags.set_gluon_forward(False)
    flags.set_gluon_backward(False)
    try:
        _plans_equal_per_call_path()
    finally:
        flags.set_gluon_forward(None)
        flags.set_gluon_backward(None)


def _plans_equal_per_call_path():
    g = torch.Generator(device="cuda").manual_seed(0)
    seg, dil = [512, 1024, 2048], [1, 2, 4]
    cases = [
        (1, 4096, 8, 8, 64, torch.bfloat16, False, "all"),
        (2, 2048, 8, 2, 128, torch.float16, True, "all"),
        (1, 3000, 6, 3, 64, torch.bfloat16, False, "split"),
        (1, 2048, 4, 4, 32, torch.float32, False, "all"),
    ]
    for b, n, h, hkv, d, dt, pad, ha in cases:
        q = torch.randn(b, n, h, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
        k = torch.randn(b, n, hkv, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
        v = torch.randn(b, n, hkv, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
        do = torch.randn(b, n, h, d, dtype=dt, device="cuda", generator=g)
        mask = (torch.rand(b, n, device="cuda", generator=g) < 0.1) if pad else None
        for causal in (True, False):
            res = {}
            for use in (True, False, True, True):  # build, per-call, hit, hit
                L.USE_PLANS = use
                try:
                    out, lse = dilated_attention(q, k, v, seg, dil, causal=causal, key_padding_mask=mask,
                                                 impl="triton", return_lse=True, head_assignment=ha)  # fmt: skip
                    grads = torch.autograd.grad(out, (q, k, v), do)
                finally:
                    L.USE_PLANS = True
                res.setdefault(use, []).append((out, lse, *grads))
            want = res[False][0]
            for got in res[True]:
                _assert_same(want, got, f"{b}x{n}x{h}/{hkv}x{d} {dt} pad={pad} {ha} causal={causal}")
    if direct_launch.unavailable_reason() is None:
        assert all(p.fwd.direct for p in L._PLANS.values() if p is not None)
        assert all(bw.dq.direct and bw.dkdv.direct for p in L._PLANS.values() if p for bw in p._bwd.values())


@pytest.mark.cuda
@pytest.mark.timeout(900)
def test_cuda_packed_steps_reuse_plans_and_equal_per_call_path():
    """Packed training steps on a GPU (documents and max_seqlen varying per step, as
    StdlibBytes.packed_batch makes them): plans (first call through Triton, later ones through
    the kept launchers with per-call grids) against the per-call path, bit for bit; one plan
    per bucket of max_seqlen. Compile-bound with a cold Triton cache: the float32 variants
    compile in 15-60 s each (H100, Triton 3.6, 2026-11-26: 183 s for the first 8 of 28 steps,
    the GPU idle, ptxas busy), past the default 300 s per test; the runs themselves take ms."""
    from dilated_attention import dilated_attention_varlen

    g = torch.Generator(device="cuda").manual_seed(0)
    seg, dil = [1024, 4096, 16384], [1, 2, 4]
    total, h, hkv, d = 16384, 8, 4, 32
    steps = [[16384], [3000, 0, 7000, 6384], [1, 9000, 1, 7382], [4096] * 4, [8191, 8193],
             [5000, 5000, 6384], [2, 16382]]  # fmt: skip
    L._PLANS.clear()
    for dt in (torch.bfloat16, torch.float32):
        for causal in (True, False):
            for lens in steps:
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                  device="cuda")  # fmt: skip
                mx = max(lens)
                q = torch.randn(total, h, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
                k = torch.randn(total, hkv, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
                v = torch.randn(total, hkv, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
                do = torch.randn(total, h, d, dtype=dt, device="cuda", generator=g)
                res = {}
                for use in (True, False, True):  # (build or hit), per-call, hit
                    L.USE_PLANS = use
                    try:
                        out = dilated_attention_varlen(q, k, v, cu, cu, mx, mx, seg, dil,
                                                       causal=causal, impl="triton")  # fmt: skip
                        grads = torch.autograd.grad(out, (q, k, v), do)
                    finally:
                        L.USE_PLANS = True
                    res.setdefault(use, []).append((out, *grads))
                want = res[False][0]
                for got in res[True]:
                    for name, x, y in zip(("out", "dq", "dk", "dv"), want, got, strict=True):
                        assert torch.equal(x, y), f"{dt} causal={causal} {lens} {name}"
    buckets = {L.grid_bucket(max(lens)) for lens in steps}
    assert len(L._PLANS) <= 4 * len(buckets) < 4 * len(steps)  # (dtype, causal) x buckets
    if direct_launch.unavailable_reason() is None:
        assert all(p.fwd.direct for p in L._PLANS.values() if p is not None)
        assert all(bw.dq.direct and bw.dkdv.direct for p in L._PLANS.values() if p for bw in p._bwd.values())


# ------------------------------------------------------------------- backward_context


def test_backward_context_switches_off_what_is_on():
    from dilated_attention.autograd_rules import backward_context

    with torch.no_grad(), backward_context("cpu"):  # a plain backward: nothing to switch
        assert not torch.is_grad_enabled()
    with torch.enable_grad(), backward_context("cpu"):  # create_graph=True
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad(), backward_context("cpu"):
            assert not torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled()
            x = torch.randn(4, 4)
            assert (x @ x).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
