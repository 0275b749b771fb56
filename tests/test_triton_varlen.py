"""The fused Triton kernels over packed documents (varlen) against the float64 reference run on
each document alone.

``kernels.triton_ops.dilated_attention_triton_varlen`` (q (total_q, H, D), k/v (total_k, Hkv, D),
int32 ``cu_seqlens`` offsets): each document is its own sequence (segments start at its first
token, queries bottom-right aligned within it, causal within it, nothing crosses a boundary).
The oracle is ``dilated_attention_reference`` per document (batch 1), concatenated. On the CPU
the kernels run in Triton's interpreter at tiny sizes (float32 and float16: the interpreter's
bf16 loads are broken); the ``cuda`` test runs a moderate packed batch in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers import poisoned_empty  # noqa: E402

from dilated_attention.kernels import triton_launch, triton_ops
from dilated_attention.reference import dilated_attention_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = DEV == "cpu"
interp_only = pytest.mark.skipif(not INTERP, reason="interpreter tests run on the CPU")


def _offsets(lens, device):
    return torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)


def _packed(qlens, klens, h, hkv, d, dtype, device):
    q = torch.randn(sum(qlens), h, d, dtype=dtype, device=device)
    k = torch.randn(sum(klens), hkv, d, dtype=dtype, device=device)
    v = torch.randn(sum(klens), hkv, d, dtype=dtype, device=device)
    do = torch.randn_like(q)
    return q, k, v, do


def _per_document_reference(q, k, v, do, qlens, klens, seg, dil, cdtype, **kw):
    """out (total_q, H, D), lse (H, total_q), dq, dk, dv: the reference on each document alone
    (batch 1) in ``cdtype``, concatenated; documents without queries contribute no rows (and
    zero dk/dv)."""
    xs = [t.detach().to(cdtype).requires_grad_() for t in (q, k, v)]
    cq, ck = _offsets(qlens, "cpu").tolist(), _offsets(klens, "cpu").tolist()
    outs, lses = [], []
    for i in range(len(qlens)):
        if qlens[i] == 0:
            continue
        o, lse = dilated_attention_reference(
            xs[0][cq[i]:cq[i + 1]][None], xs[1][ck[i]:ck[i + 1]][None],
            xs[2][ck[i]:ck[i + 1]][None], seg, dil, **kw,
        )
        outs.append(o[0])
        lses.append(lse[0])
    h = q.shape[1]
    out = torch.cat(outs) if outs else xs[0][:0] * 0
    lse = torch.cat(lses, 1) if lses else torch.zeros(h, 0, dtype=cdtype, device=q.device)
    grads = torch.autograd.grad(out, xs, do.to(cdtype), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs, strict=True)]
    return out.detach(), lse.detach(), grads


def _per_document_backward_each(fn, impl, q, k, v, do, qlens, klens, seg, dil, dtype, **kw):
    """out (total_q, H, D), lse (H, total_q), [dq, dk, dv]: ``fn(..., impl=impl)`` on each
    document alone in ``dtype``, each document's backward run before the next document's forward,
    so that one document's graph is alive at a time (all 30 documents' float32 reference graphs
    at once held tens of GiB: out of memory beside 3 other pytest workers on one GPU,
    2026-11-26). Rows of documents without queries: zero gradients."""
    cq, ck = _offsets(qlens, "cpu").tolist(), _offsets(klens, "cpu").tolist()
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = None
    grads = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v)]
    for i in range(len(qlens)):
        if not qlens[i]:
            continue
        rows = [(cq[i], cq[i + 1]), (ck[i], ck[i + 1]), (ck[i], ck[i + 1])]
        xs = [t[a:b].detach().to(dtype).requires_grad_() for t, (a, b) in zip((q, k, v), rows, strict=True)]
        o, l = fn(*(x[None] for x in xs), seg, dil, return_lse=True, impl=impl, **kw)
        gs = torch.autograd.grad(o[0], xs, do[cq[i]:cq[i + 1]].to(dtype), allow_unused=True)
        out[cq[i]:cq[i + 1]] = o[0].detach()
        if lse is None:
            lse = torch.zeros(l.shape[1], q.shape[0], dtype=l.dtype, device=q.device)
        lse[:, cq[i]:cq[i + 1]] = l[0].detach()
        for g, gi, (a, b) in zip(grads, gs, rows, strict=True):
            if gi is not None:
                g[a:b] = gi
    return out, lse, grads


def _triton_varlen(q, k, v, do, qlens, klens, seg, dil, dtype, same_offsets=False, **kw):
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    cu_q = _offsets(qlens, q.device)
    cu_k = cu_q if same_offsets else _offsets(klens, q.device)
    out, lse = triton_ops.dilated_attention_triton_varlen(
        *xs, cu_q, cu_k, max(qlens), max(klens), seg, dil,
        scale=q.shape[-1] ** -0.5, **kw,
    )
    grads = torch.autograd.grad(out, xs, do.to(dtype))
    return out, lse, grads


def _close(name, got, ref, atol):
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    err = torch.where(both_inf, torch.zeros_like(got), (got - ref).abs())
    assert (err <= atol).all(), f"{name}: max err {err.max().item():.3g} > atol {atol}"


# (query lengths, key lengths, heads, kv heads, branches, same offsets, head_assignment, dtype)
# lengths: empty documents, one-token documents, documents shorter than the smallest w,
# lengths no multiple of any w, documents with fewer queries than keys
CASES = {
    # nested LongNet-like branches, queries = keys, offsets shared: the non-causal forward
    # takes the folded kernel (one launch for all branches), GQA
    "fold_gqa": ([0, 1, 3, 21, 37], None, 4, 2, ([8, 16, 32], [1, 2, 4]), True, "all",
                 torch.float32),
    # fewer queries than keys in some documents (an empty one and a keys-only one too), MQA,
    # w % r != 0, split heads
    "short_q_mqa_split": ([2, 0, 1, 5, 0, 19], [9, 0, 1, 5, 4, 30], 4, 1, ([6, 20], [1, 3]),
                          False, "split", torch.float32),
    # fp16 (compensated accumulation across branches), GQA 6/2, 3 branches (r = 3 with w = 4),
    # a partial last segment everywhere
    "fp16_gqa": ([13, 1, 27], [13, 1, 27], 6, 2, ([4, 12, 24], [1, 3, 2]), False, "all",
                       torch.float16),
}


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_varlen_vs_per_document_reference(seed, monkeypatch, case, causal):
    qlens, klens, h, hkv, (seg, dil), same, head_assignment, dtype = CASES[case]
    klens = klens or qlens
    folded = []  # launches of the folded kernel (plans and the per-call path alike)
    real = triton_launch._FWD_FOLDED.launch
    monkeypatch.setattr(triton_launch._FWD_FOLDED, "launch",
                        lambda *a, **k: folded.append(1) or real(*a, **k))
    # at these sizes w_min / r_max is below the interpreter's BM: fold as if it filled the tile
    monkeypatch.setattr(triton_launch, "fold_fills_tile", lambda geo, bm: True)
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())  # plans under that rule
    q, k, v, do = _packed(qlens, klens, h, hkv, 16, torch.float64, "cpu")
    if dtype != torch.float32:  # the oracle sees the same rounded inputs
        q, k, v, do = (t.to(dtype).double() for t in (q, k, v, do))
    kw = dict(causal=causal, head_assignment=head_assignment)
    ref = _per_document_reference(q, k, v, do, qlens, klens, seg, dil, torch.float64, **kw)
    got = _triton_varlen(q, k, v, do, qlens, klens, seg, dil, dtype, same_offsets=same, **kw)
    assert len(folded) == (1 if same and not causal else 0)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[2])
    assert got[1].dtype == torch.float32 and got[1].shape == (h, sum(qlens))
    tol_o, tol_g = (2e-5, 5e-5) if dtype == torch.float32 else (4e-3, 2e-2)
    _close("out", got[0], ref[0], tol_o)
    _close("lse", got[1], ref[1], 2e-5 if dtype == torch.float32 else 2e-3)
    for name, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{name}", g, r, tol_g)


@interp_only
def test_varlen_equals_batch_path_on_equal_documents(seed):
    """Two documents of the same length packed = a batch of 2 through the batch path: the same
    kernels with explicit offsets vs implicit ones (b * N), so the results are bitwise equal."""
    n, h, hkv, d = 23, 4, 2, 16
    seg, dil = [6, 16], [1, 4]
    q, k, v, do = _packed([n, n], [n, n], h, hkv, d, torch.float32, "cpu")
    cu = _offsets([n, n], "cpu")
    args = (seg, dil, True, d**-0.5, [(0, h)] * 2)
    out_b, lse_b = triton_launch.forward(
        q.view(2, n, h, d), k.view(2, n, hkv, d), v.view(2, n, hkv, d), None, *args
    )
    docs = triton_launch.Docs(cu, cu, n, n)
    out_v, lse_v = triton_launch.forward(q[None], k[None], v[None], None, *args, docs=docs)
    assert torch.equal(out_v[0].view(2, n, h, d), out_b)
    assert torch.equal(lse_v[0].view(h, 2, n).transpose(0, 1), lse_b)
    gb = triton_launch.backward(do.view(2, n, h, d), q.view(2, n, h, d), k.view(2, n, hkv, d),
                                v.view(2, n, hkv, d), None, out_b, lse_b, *args)
    gv = triton_launch.backward(do[None], q[None], k[None], v[None], None, out_v, lse_v, *args,
                                docs=docs)
    for a, b in zip(gv, gb, strict=True):
        assert torch.equal(a[0].reshape(b.shape), b)


@interp_only
def test_varlen_torch_compile(seed):
    """The varlen op (forward + backward) under torch.compile, fullgraph, equals eager."""
    qlens = [5, 0, 12]
    q, k, v, do = _packed(qlens, qlens, 2, 1, 16, torch.float32, "cpu")
    cu = _offsets(qlens, "cpu")

    def f(q, k, v):
        return triton_ops.dilated_attention_triton_varlen(
            q, k, v, cu, cu, 12, 12, [4, 8], [1, 2], causal=True, scale=0.25,
            head_assignment="all",
        )[0]

    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*xs)
    g = torch.autograd.grad(out, xs, do)
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    out_e = f(*ys)
    g_e = torch.autograd.grad(out_e, ys, do)
    torch.testing.assert_close(out, out_e)
    for a, b in zip(g, g_e, strict=True):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------- checked offsets: no zero-fills (issue 22)
# (query lengths, key lengths or None, heads, kv heads, branches, fold): leading, trailing and
# inner empty documents, one-token documents, documents shorter than the smallest w, lengths
# no multiple of any w, documents with fewer queries than keys and keys-only ones
FILL_CASES = {
    # GQA, queries = keys; "fold": the non-causal forward folds (one launch, its own buffers)
    "gqa": ([0, 1, 3, 21, 37, 0], None, 4, 2, ([8, 16, 32], [1, 2, 4]), False, torch.float32),
    "gqa_fold": ([0, 1, 3, 21, 37, 0], None, 4, 2, ([8, 16, 32], [1, 2, 4]), True, torch.float32),
    "short_q_mqa": ([2, 0, 1, 5, 0, 19, 0], [9, 0, 1, 5, 4, 30, 3], 4, 1, ([6, 20], [1, 3]), False,
                    torch.float32),
    # fp16 with rows in several branches: the compensated (hi, lo) sums, lo unfilled too
    "fp16_lo": ([13, 1, 27, 0, 5], [13, 1, 30, 2, 5], 3, 1, ([4, 12, 24], [1, 3, 2]), False,
                torch.float16),
}  # fmt: skip


def _fill_route(docs_checked: bool) -> tuple:
    """(forward fill, dq fill, dk/dv fill) of the one plan the call built."""
    (plan,) = triton_launch._PLANS.values()
    (bwd,) = plan._bwd.values()
    fwd_fill = (not plan.lay.covered) if plan.folded else plan.fwd_fill
    assert plan.lay.covered == docs_checked
    return fwd_fill, bwd.q_fill, bwd.kv_fill


# (gqa_fold, causal) would repeat (gqa, causal): a causal call never folds
FILL_RUNS = [(c, causal) for c in FILL_CASES for causal in (False, True) if (c, causal) != ("gqa_fold", True)]


@interp_only
@pytest.mark.parametrize("case,causal", FILL_RUNS, ids=[f"{c}-{x}" for c, x in FILL_RUNS])
def test_checked_offsets_skip_the_fills(seed, monkeypatch, case, causal):
    """Offsets on the host (the front door checks their values: they cover q and k) take the
    one-sequence route: out, lse, dq, dk, dv (and lo) allocated empty, the first branch storing
    without reading. With every torch.empty / empty_like buffer full of NaN, the results equal
    the filled route (unchecked offsets) bit for bit and the float64 reference per document."""
    from dilated_attention import dilated_attention_varlen

    qlens, klens, h, hkv, (seg, dil), fold, dtype = FILL_CASES[case]
    klens = klens or qlens
    monkeypatch.setattr(triton_launch, "fold_fills_tile", lambda geo, bm: fold)
    q, k, v, do = _packed(qlens, klens, h, hkv, 16, torch.float64, "cpu")
    q, k, v, do = (t.to(dtype).double() for t in (q, k, v, do))  # the oracle's inputs rounded
    kw = dict(causal=causal, head_assignment="all")
    ref = _per_document_reference(q, k, v, do, qlens, klens, seg, dil, torch.float64, **kw)
    # unchecked: the filled route
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())
    want = _triton_varlen(q, k, v, do, qlens, klens, seg, dil, dtype, same_offsets=klens == qlens, **kw)
    assert _fill_route(False) == (True, True, True)
    # checked (host offsets through the front door), every empty buffer poisoned
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with monkeypatch.context() as m:
        poisoned_empty(m)
        out, lse = dilated_attention_varlen(
            *xs, _offsets(qlens, "cpu"), _offsets(klens, "cpu"), max(qlens), max(klens), seg, dil,
            impl="triton", return_lse=True, **kw,
        )  # fmt: skip
        grads = torch.autograd.grad(out, xs, do.to(dtype))
    plan = next(iter(triton_launch._PLANS.values()))
    assert plan.folded == (fold and not causal)
    assert _fill_route(True) == (False, False, False)
    if dtype == torch.float16:  # the lo buffers are allocated empty too
        (bwd,) = plan._bwd.values()
        assert plan.fwd_comp and bwd.q_comp and bwd.kv_comp
    tol_o, tol_g = (2e-5, 5e-5) if dtype == torch.float32 else (4e-3, 2e-2)
    for name, got, exp, r, tol in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (want[0], want[1], *want[2]),
        (ref[0], ref[1], *ref[2]), (tol_o, 2e-5 if dtype == torch.float32 else 2e-3, *[tol_g] * 3),
        strict=True,
    ):  # fmt: skip
        assert torch.equal(got, exp), f"{name}: checked != filled route"
        _close(name, got, r, tol)


@interp_only
@pytest.mark.parametrize("causal", [False, True])
def test_unchecked_offsets_keep_the_fills(seed, monkeypatch, causal):
    """Device offsets (unchecked: never read on the host) may end before the tensors' rows: those
    rows belong to no program and must read as out 0, lse -inf, zero gradients, so the fills
    stay (poisoned empty buffers would show through otherwise); the documents' rows are exact."""
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())
    qlens, klens, tail = [5, 0, 17, 1], [9, 0, 17, 1], 6  # 6 rows of q and k past the last document
    h, hkv, seg, dil = 4, 2, [8, 16], [1, 2]
    q, k, v, do = _packed(qlens + [tail], klens + [tail], h, hkv, 16, torch.float64, "cpu")
    ref = _per_document_reference(q[:-tail], k[:-tail], v[:-tail], do[:-tail], qlens, klens, seg,
                                  dil, torch.float64, causal=causal)  # fmt: skip
    xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with monkeypatch.context() as m:
        poisoned_empty(m)
        out, lse = triton_ops.dilated_attention_triton_varlen(
            *xs, _offsets(qlens, "cpu"), _offsets(klens, "cpu"), 17, 17, seg, dil, causal=causal,
            scale=0.25, head_assignment="all",
        )  # fmt: skip
        grads = torch.autograd.grad(out, xs, do.float())
    assert torch.equal(out[-tail:], torch.zeros_like(out[-tail:]))
    assert torch.equal(lse[:, -tail:], torch.full_like(lse[:, -tail:], float("-inf")))
    for name, g in zip("qkv", grads, strict=True):
        assert torch.equal(g[-tail:], torch.zeros_like(g[-tail:])), f"d{name} past the last document"
    _close("out", out[:-tail], ref[0], 2e-5)
    _close("lse", lse[:, :-tail], ref[1], 2e-5)
    for name, g, r in zip("qkv", grads, ref[2], strict=True):
        _close(f"d{name}", g[:-tail], r, 5e-5)
    assert _fill_route(False) == (True, True, True)


@interp_only
@pytest.mark.parametrize("causal", [False, True])
def test_unchecked_offsets_with_a_leading_gap(seed, monkeypatch, causal):
    """Unchecked device offsets that start past row 0 (the front door refuses them only when it
    may read them): the rows before the first document belong to no document (out 0, lse -inf,
    zero gradients, as rows past the last one) and the documents are exact. The flat grid then
    gives document 0 cu_k[0] // w extra slots with negative segments (19 rows: two of w = 8):
    their rows lie inside the gap (never before row 0), hold no query (qrow < 0) and add zeros
    to the gap's dK/dV."""
    monkeypatch.setattr(triton_launch, "_PLANS", type(triton_launch._PLANS)())
    qlens, klens, lead = [5, 17, 1], [9, 17, 1], 19  # 19 rows of q and k before the first document
    h, hkv, seg, dil = 4, 2, [8, 16], [1, 2]
    q, k, v, do = _packed([lead] + qlens, [lead] + klens, h, hkv, 16, torch.float64, "cpu")
    ref = _per_document_reference(q[lead:], k[lead:], v[lead:], do[lead:], qlens, klens, seg,
                                  dil, torch.float64, causal=causal)  # fmt: skip
    xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = (_offsets(n, "cpu")[1:] for n in ([lead] + qlens, [lead] + klens))
    with monkeypatch.context() as m:
        poisoned_empty(m)
        out, lse = triton_ops.dilated_attention_triton_varlen(
            *xs, cu_q, cu_k, 17, 17, seg, dil, causal=causal, scale=0.25, head_assignment="all",
        )  # fmt: skip
        grads = torch.autograd.grad(out, xs, do.float())
    assert torch.equal(out[:lead], torch.zeros_like(out[:lead]))
    assert torch.equal(lse[:, :lead], torch.full_like(lse[:, :lead], float("-inf")))
    for name, g in zip("qkv", grads, strict=True):
        assert torch.equal(g[:lead], torch.zeros_like(g[:lead])), f"d{name} before the first document"
    _close("out", out[lead:], ref[0], 2e-5)
    _close("lse", lse[:, lead:], ref[1], 2e-5)
    for name, g, r in zip("qkv", grads, ref[2], strict=True):
        _close(f"d{name}", g[lead:], r, 5e-5)


# ------------------------------------------------------------------------------- CUDA, real sizes
# (key lengths, query lengths when they differ): 8 documents, ~16K tokens; 30 documents, ~46K
# tokens, for the flat (document, segment) grid: empty ones first, last and three in a row,
# one-token documents, multiples of w, a document of 9 segments of w = 1024, documents starting
# at multiples of w (1024, 4096, 8192) and one just after (8193)
_CUDA_K30 = [0, 1, 1023, 3072, 4096, 0, 0, 1, 2047, 9000, 0, 512, 4097, 1, 1, 6000, 0, 0, 0, 2048,
             300, 7, 4095, 1, 5000, 128, 0, 1024, 3333, 0]  # fmt: skip
CUDA_DOCS = {
    "8docs": ([4000, 1, 700, 2500, 0, 3333, 4096, 1570], [4000, 1, 350, 2500, 0, 3333, 4000, 1]),
    "30docs": (_CUDA_K30, [n if i % 3 else n // 2 for i, n in enumerate(_CUDA_K30)]),
}


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("same_offsets", [False, True], ids=["short_q", "same_offsets"])
@pytest.mark.parametrize("docs", list(CUDA_DOCS))
def test_varlen_cuda_vs_per_document(seed, causal, same_offsets, docs):
    """Packed documents (CUDA_DOCS), bf16, GQA 8/2 x 128, branches up to w = 4096 (longer than
    most documents), some documents with fewer queries than keys (or, with shared offsets, the
    folded forward when not causal). Judged as tests/test_triton.py's CUDA tests: the error
    against the float32 reference run on each document alone is <= 2x the error of
    impl="torch" in bf16 (the same-dtype baseline, per document) + 1e-3."""
    from dilated_attention import dilated_attention

    klens, short_q = CUDA_DOCS[docs]
    qlens = list(klens) if same_offsets else short_q
    h, hkv, d = 8, 2, 128
    seg, dil = [1024, 2048, 4096], [1, 2, 4]
    q, k, v, do = _packed(qlens, klens, h, hkv, d, torch.bfloat16, "cuda")
    kw = dict(causal=causal, head_assignment="all")

    def per_doc(impl, dtype):
        return _per_document_backward_each(dilated_attention, impl, q, k, v, do, qlens, klens,
                                           seg, dil, dtype, **kw)  # fmt: skip

    ref = per_doc("reference", torch.float32)
    base = per_doc("torch", torch.bfloat16)
    got = _triton_varlen(q, k, v, do, qlens, klens, seg, dil, torch.bfloat16,
                         same_offsets=same_offsets, **kw)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got[2])
    pairs = [("out", got[0], base[0], ref[0])]
    pairs += [(f"d{c}", a, b, r) for c, a, b, r in zip("qkv", got[2], base[2], ref[2], strict=True)]
    for name, a, b, r in pairs:
        ea = (a.float() - r.float()).abs().max().item()
        eb = (b.float() - r.float()).abs().max().item()
        print(f"{name}: triton err {ea:.3g}, impl='torch' bf16 err {eb:.3g}")
        assert ea <= 2 * eb + 1e-3, f"{name}: triton err {ea:.3g} > 2 x baseline err {eb:.3g} + 1e-3"
    fin = torch.isfinite(ref[1])
    assert torch.equal(fin, torch.isfinite(got[1])), "lse: rows without keys differ"
    assert (got[1][fin] - ref[1][fin]).abs().max().item() <= 2e-2, "lse"


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("docs", list(CUDA_DOCS))
def test_varlen_cuda_checked_offsets_skip_the_fills(seed, monkeypatch, causal, docs):
    """On the GPU (CUDA_DOCS, fewer queries than keys in some documents, keys-only ones, bf16,
    GQA 8/2 x 128): host offsets through the front door (checked there: no zero-fills) give the
    bits of unchecked device offsets (the filled route; dq and dk up to the GPU's rounding of
    the two stores, in a few elements) with every empty buffer poisoned; the
    front door calls the kernels checked for CPU offsets and check_offsets=True, unchecked for
    device offsets; and neither route synchronises the host (after a first call)."""
    from dilated_attention import dilated_attention_varlen

    klens, qlens = CUDA_DOCS[docs]
    h, hkv, d = 8, 2, 128
    seg, dil = [1024, 2048, 4096], [1, 2, 4]
    q, k, v, do = _packed(qlens, klens, h, hkv, d, torch.bfloat16, "cuda")
    kw = dict(causal=causal, head_assignment="all")
    want = _triton_varlen(q, k, v, do, qlens, klens, seg, dil, torch.bfloat16, **kw)
    cpu_q, cpu_k = _offsets(qlens, "cpu"), _offsets(klens, "cpu")
    args = (max(qlens), max(klens), seg, dil)

    def front_door(cu_q, cu_k, **extra):
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention_varlen(*xs, cu_q, cu_k, *args, impl="triton",
                                            return_lse=True, **kw, **extra)  # fmt: skip
        return out, lse, torch.autograd.grad(out, xs, do)

    with monkeypatch.context() as m:
        poisoned_empty(m)
        got = front_door(cpu_q, cpu_k)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got[:2], *got[2]),
                          (*want[:2], *want[2]), strict=True):  # fmt: skip
        assert not a.isnan().any(), f"{name}: an element no launch wrote (NaN poison)"
        if name in ("dq", "dk"):
            # compiled for the GPU, the FIRST store (x = val) and the filled one (x = 0 + val)
            # round the first branch's fp32 residue differently, and the compensated sum over
            # the branches carries that to the result (measured on an H100: ~100 of 17M
            # elements apart, by at most 0.004 absolute; dv, out and lse
            # bit-equal). A skipped or doubled contribution moves whole rows by O(value).
            diff, scale = (a.float() - b.float()).abs(), b.float().abs().max().item()
            frac = (a != b).float().mean().item()
            msg = f"{name}: max diff {diff.max().item():.3g} (largest {scale:.3g}), {frac:.2e} differ"
            assert diff.max().item() <= 2.0**-6 * scale, msg
            assert frac < 1e-3, msg
        else:
            assert torch.equal(a, b), f"{name}: checked offsets != filled route"
    flags_seen = []
    real = triton_ops.dilated_attention_triton_varlen
    monkeypatch.setattr(triton_ops, "dilated_attention_triton_varlen",
                        lambda *a, **k_: flags_seen.append(k_["offsets_checked"]) or real(*a, **k_))
    dev_q, dev_k = cpu_q.cuda(), cpu_k.cuda()
    front_door(dev_q, dev_k, check_offsets=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        front_door(cpu_q, cpu_k)
        front_door(dev_q, dev_k)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert flags_seen == [True, True, False]


@interp_only
def test_varlen_strided_offsets(seed):
    """Offsets that are a strided view (the columns of a (docs + 1, 2) table) read as their
    values, not as the first entries of the underlying storage: the fused kernel loads
    ``cu_seqlens[i]`` with unit stride, so the entry point must hand it contiguous offsets."""
    from dilated_attention import dilated_attention_varlen

    q, k, v, do = _packed([3, 5], [4, 5], 4, 2, 16, torch.float32, "cpu")
    table = torch.tensor([[0, 0], [3, 4], [8, 9]], dtype=torch.int32)
    cu_q, cu_k = table[:, 0], table[:, 1]  # stride 2
    assert not cu_q.is_contiguous()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention_varlen(*xs, cu_q, cu_k, 5, 5, (4, 8), (1, 2), causal=True,
                                        impl="triton", return_lse=True)
    grads = torch.autograd.grad(out, xs, do)
    ref = _per_document_reference(q, k, v, do, [3, 5], [4, 5], (4, 8), (1, 2), torch.float64,
                                  causal=True)
    _close("out", out, ref[0], 2e-5)
    _close("lse", lse, ref[1], 2e-5)
    for name, g, r in zip("qkv", grads, ref[2], strict=True):
        _close(f"d{name}", g, r, 5e-5)
