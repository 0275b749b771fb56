"""dilated_attention_varlen against the reference run on each document alone (float64), forward,
LSE and backward; the offset checks; the impl choice."""

from __future__ import annotations

import pytest
import torch
from helpers import check_close, interpreted, varlen_reference

from dilated_attention import dilated_attention, dilated_attention_varlen

BRANCHES = {
    "two": ((4, 8), (1, 2)),
    "w%r!=0": ((5, 12), (2, 3)),
    "paper/64": ((4, 8, 16, 32, 64), (1, 2, 4, 6, 12)),
}
# (queries, keys) per document: empty, one token, shorter than the smallest segment, no multiple
# of any w, fewer queries than keys (bottom-right aligned), a document with keys but no query
DOCS = {
    "mixed": [(7, 7), (0, 0), (1, 1), (3, 3), (23, 23), (2, 2)],
    "nq<nk": [(3, 9), (1, 1), (0, 5), (11, 19), (1, 30)],
    "one": [(29, 29)],
    # the torch path batches equal-length buckets (padded at the end, keys masked): 9 and 10 pad
    # to 10, 11 and 12 to 12, with nq < nk documents in between
    "bucketed": [(9, 9), (10, 10), (0, 0), (12, 12), (2, 6), (11, 11), (5, 5), (6, 6), (10, 10)],
}
HEADS = [(4, 4), (6, 2), (4, 1)]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(docs, h, hkv, d=8, dtype=torch.float64):
    tq, tk = sum(n for n, _ in docs), sum(n for _, n in docs)
    q = torch.randn(tq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(tk, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(tk, hkv, d, dtype=dtype, requires_grad=True)
    return q, k, v, _cu([n for n, _ in docs]), _cu([n for _, n in docs])


def _cases():
    cases = []
    i = 0
    for br in BRANCHES:
        for docs in DOCS:
            for causal in (False, True):
                heads = HEADS[i % len(HEADS)]
                ha = ("all", "split")[(i // 2) % 2]
                cases.append(pytest.param(br, docs, causal, heads, ha, id=f"{br}-{docs}-{'causal' if causal else 'full'}-H{heads[0]}kv{heads[1]}-{ha}"))
                i += 1
    return cases


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("branches, docs, causal, heads, ha", _cases())
def test_varlen_equals_each_document_alone(impl, branches, docs, causal, heads, ha, seed):
    seg, dil = BRANCHES[branches]
    q, k, v, cu_q, cu_k = _inputs(DOCS[docs], *heads)
    mq = max(n for n, _ in DOCS[docs])
    mk = max(n for _, n in DOCS[docs])
    do = torch.randn(q.shape, dtype=q.dtype)
    want, want_lse, want_g = varlen_reference(q, k, v, cu_q, cu_k, seg, dil, do, causal=causal, head_assignment=ha)
    out, lse = dilated_attention_varlen(
        q, k, v, cu_q, cu_k, mq, mk, seg, dil, causal=causal, head_assignment=ha, impl=impl,
        return_lse=True,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (heads[0], q.shape[0]) and lse.dtype == torch.float32
    check_close("out", out, want, atol=1e-12)
    check_close("lse", lse, want_lse.float(), atol=1e-5)
    got_g = torch.autograd.grad((out * do).sum(), (q, k, v), allow_unused=True)
    for name, g, w in zip("qkv", got_g, want_g, strict=True):
        check_close(f"d{name}", torch.zeros_like(w) if g is None else g, w, atol=1e-11)


def test_varlen_is_not_one_long_sequence(seed):
    # the documents are independent: the same tokens as one sequence give another result (so the
    # test above cannot pass by ignoring the offsets)
    q, k, v, cu_q, cu_k = _inputs([(6, 6), (10, 10)], 4, 2)
    got = dilated_attention_varlen(q, k, v, cu_q, cu_k, 10, 10, (4, 8), (1, 2), impl="torch")
    whole = dilated_attention(q[None], k[None], v[None], (4, 8), (1, 2), impl="reference")[0]
    assert not torch.allclose(got[6:], whole[6:])


def test_varlen_float32_and_device_offsets_int64(seed):
    q, k, v, cu_q, cu_k = _inputs(DOCS["mixed"], 4, 2, dtype=torch.float32)
    out = dilated_attention_varlen(q, k, v, cu_q.long(), cu_k.long(), 23, 23, (4, 8), (1, 2), causal=True)
    want = dilated_attention_varlen(
        q.double(), k.double(), v.double(), cu_q, cu_k, 23, 23, (4, 8), (1, 2), causal=True, impl="reference"
    )
    assert out.dtype == torch.float32
    check_close("out", out, want, atol=1e-5)


def test_varlen_no_query_anywhere(seed):
    q, k, v, cu_q, cu_k = _inputs([(0, 4), (0, 3)], 4, 2)
    out, lse = dilated_attention_varlen(q, k, v, cu_q, cu_k, 0, 4, (4,), (1,), return_lse=True, impl="torch")
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    out.sum().backward()
    assert k.grad is not None and torch.equal(k.grad, torch.zeros_like(k))


def test_varlen_autocast_follows_dilated_attention(seed, monkeypatch):
    from dilated_attention import varlen

    calls, real = [], varlen.dilated_attention_varlen
    monkeypatch.setattr(varlen, "dilated_attention_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, cu_q, cu_k = _inputs(DOCS["mixed"], 4, 2, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen.dilated_attention_varlen(q, k, v, cu_q, cu_k, 23, 23, (4, 8), (1, 2), impl="torch")
    assert out.dtype == torch.bfloat16
    assert len(calls) == 1  # the public function does not call itself again after the cast
    want = dilated_attention_varlen(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 23, 23, (4, 8), (1, 2), impl="torch"
    )
    assert torch.equal(out, want)


@interpreted
def test_varlen_triton_unavailable_is_a_clear_error():
    # where the fused kernel cannot run (float64 here; a CPU tensor without the interpreter) an
    # explicit impl="triton" raises and says why; auto runs the torch path
    q, k, v, cu_q, cu_k = _inputs([(3, 3)], 4, 2, d=16, dtype=torch.float64)
    with pytest.raises(ValueError, match="impl='triton' cannot run here.*float64"):
        dilated_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, (4,), (1,), impl="triton")
    out = dilated_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, (4,), (1,), impl="auto")
    check_close("auto", out, dilated_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, (4,), (1,), impl="torch"), atol=0)


def _triton_can_run(q, k) -> bool:
    from dilated_attention.kernels.select import triton_unavailable_reason

    return triton_unavailable_reason(q[None], k[None]) is None


# the fused kernel through the public entry point (the Triton interpreter on the CPU: a few cases)
TRITON_CASES = [
    ("two", "mixed", True, (4, 2), "all"),
    ("w%r!=0", "nq<nk", False, (6, 2), "split"),
    ("paper/64", "bucketed", True, (4, 1), "all"),
]


@pytest.mark.parametrize("branches, docs, causal, heads, ha", TRITON_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in TRITON_CASES])
def test_varlen_triton_equals_each_document_alone(branches, docs, causal, heads, ha, seed):
    seg, dil = BRANCHES[branches]
    q, k, v, cu_q, cu_k = _inputs(DOCS[docs], *heads, d=16)
    if not _triton_can_run(q.float(), k.float()):
        pytest.skip("the fused kernel cannot run here (no CUDA and no TRITON_INTERPRET=1)")
    mq, mk = max(n for n, _ in DOCS[docs]), max(n for _, n in DOCS[docs])
    do = torch.randn(q.shape, dtype=q.dtype)
    want, want_lse, want_g = varlen_reference(q, k, v, cu_q, cu_k, seg, dil, do, causal=causal, head_assignment=ha)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = dilated_attention_varlen(
        qf, kf, vf, cu_q, cu_k, mq, mk, seg, dil, causal=causal, head_assignment=ha, impl="triton",
        return_lse=True,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == torch.float32
    check_close("out", out, want.float(), atol=2e-5)
    check_close("lse", lse, want_lse.float(), atol=2e-5)
    got_g = torch.autograd.grad((out * do.float()).sum(), (qf, kf, vf))
    for name, g, w in zip("qkv", got_g, want_g, strict=True):
        check_close(f"d{name}", g, w.float(), atol=5e-5)


def _bad(**over):
    q, k, v, cu_q, cu_k = _inputs([(3, 4), (5, 5)], 4, 2, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)
    args.update(over)
    return args


BAD = {
    "float offsets": (dict(cu_seqlens_q=torch.tensor([0.0, 3.0, 8.0])), TypeError, "cu_seqlens_q must be an integer tensor"),
    "list offsets": (dict(cu_seqlens_k=[0, 4, 9]), TypeError, "cu_seqlens_k must be an integer tensor"),
    "2-D offsets": (dict(cu_seqlens_q=torch.tensor([[0, 3, 8]], dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    "not from 0": (dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
    "decreasing": (dict(cu_seqlens_k=torch.tensor([0, 6, 4, 9], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 3, 3, 8], dtype=torch.int32)), ValueError, "cu_seqlens_k must be non-decreasing"),
    # the smallest decreases (a check weakened to "drops by more than 1" passed every case above;
    # the per-document count checks then raised other errors, or with unchecked offsets none)
    "q drops by 1": (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 8], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 4, 4, 9], dtype=torch.int32)), ValueError, r"cu_seqlens_q must be non-decreasing .* entry 2 \(2\) < entry 1 \(3\)"),
    "k drops by 1": (dict(cu_seqlens_k=torch.tensor([0, 5, 4, 9], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 3, 3, 8], dtype=torch.int32)), ValueError, r"cu_seqlens_k must be non-decreasing .* entry 2 \(4\) < entry 1 \(5\)"),
    "last != total": (dict(cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError, r"last entry of cu_seqlens_k \(8\)"),
    "doc counts": (dict(cu_seqlens_k=torch.tensor([0, 4, 6, 9], dtype=torch.int32)), ValueError, "cu_seqlens_q has 2 documents and cu_seqlens_k 3"),
    "nq > nk": (dict(cu_seqlens_q=torch.tensor([0, 5, 8], dtype=torch.int32)), ValueError, "document 0 has 5 queries but 4 keys"),
    "max_seqlen_q small": (dict(max_seqlen_q=4), ValueError, "max_seqlen_q = 4 but document 1 has 5"),
    "max_seqlen_k small": (dict(max_seqlen_k=4), ValueError, "max_seqlen_k = 4 but document 1 has 5"),
    "max_seqlen tensor": (dict(max_seqlen_k=torch.tensor(5)), TypeError, "max_seqlen_k must be a Python int"),
    "4-D q": (dict(q=torch.randn(1, 8, 4, 8)), ValueError, "q must have 3 dims"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_varlen_bad_offsets_raise(case, impl):
    over, exc, msg = BAD[case]
    args = _bad(**over)
    with pytest.raises(exc, match=msg):
        dilated_attention_varlen(**args, segment_lengths=(4,), dilation_rates=(1,), impl=impl)


def test_varlen_total_q_larger_than_total_k():
    q = torch.randn(6, 2, 4)
    k = torch.randn(5, 2, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="more queries than keys"):
        dilated_attention_varlen(q, k, k, cu, torch.tensor([0, 5], dtype=torch.int32), 6, 5, (4,), (1,))
    with pytest.raises(ValueError, match="dropout_p"):
        dilated_attention_varlen(k, k, k, cu, cu, 6, 6, (4,), (1,), dropout_p=1.5)


def test_varlen_dropout(seed):
    # dropout on the torch path: training-mode noise, exact at p = 0, never NaN; the fused
    # kernel has none (impl="triton" raises, whatever else it lacks)
    q, k, v, cu_q, cu_k = _inputs(DOCS["mixed"], 4, 2, dtype=torch.float32)
    args = (q, k, v, cu_q, cu_k, 23, 23, (4, 8), (1, 2))
    plain = dilated_attention_varlen(*args, impl="torch")
    dropped = dilated_attention_varlen(*args, impl="torch", dropout_p=0.5)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, plain)
    dropped.sum().backward()
    assert torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="impl='triton' cannot run here"):
        dilated_attention_varlen(*args, impl="triton", dropout_p=0.5)


def test_varlen_torch_batches_equal_length_documents(seed, monkeypatch):
    # documents of the same padded length go to one call of the torch core (not one per document)
    import dilated_attention.kernels.torch_dilated as td

    calls = []
    orig = td.dilated_attention_torch
    monkeypatch.setattr(td, "dilated_attention_torch", lambda q, *a, **kw: calls.append(tuple(q.shape[:2])) or orig(q, *a, **kw))
    q, k, v, cu_q, cu_k = _inputs(DOCS["bucketed"], 4, 2)
    out = dilated_attention_varlen(q, k, v, cu_q, cu_k, 12, 12, (4, 8), (1, 2), causal=True, impl="torch")
    want = dilated_attention_varlen(q, k, v, cu_q, cu_k, 12, 12, (4, 8), (1, 2), causal=True, impl="reference")
    check_close("out", out, want, atol=1e-12)
    assert sorted(calls) == [(1, 2), (1, 5), (1, 6), (2, 12), (3, 10)]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_cuda_bf16_fast_paths_against_reference(causal, seed):
    # on a GPU: the torch path and the fused varlen kernel against the float64 reference per
    # document; the kernel's error at most 2x the torch path's plus a small atol
    docs = [(700, 700), (1, 1), (130, 130), (0, 0), (33, 97), (1500, 1500), (64, 64)]
    q, k, v, cu_q, cu_k = _inputs(docs, 8, 2, d=64, dtype=torch.float64)
    seg, dil = (64, 256, 1024), (1, 2, 4)
    args = (cu_q.cuda(), cu_k.cuda(), 1500, 1500, seg, dil)
    do = torch.randn(q.shape, dtype=torch.float64)
    want, _, want_g = varlen_reference(q, k, v, cu_q, cu_k, seg, dil, do, causal=causal)
    errs = {}
    for impl in ("torch", "triton"):
        qb, kb, vb = (t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v))
        out = dilated_attention_varlen(qb, kb, vb, *args, causal=causal, impl=impl)
        grads = torch.autograd.grad(out, (qb, kb, vb), do.cuda().bfloat16())
        errs[impl] = [(out.double().cpu() - want).abs().max().item()] + [
            (g.double().cpu() - w).abs().max().item() for g, w in zip(grads, want_g, strict=True)
        ]
    assert all(e < 0.1 for e in errs["torch"]), errs
    for et, eo in zip(errs["triton"], errs["torch"], strict=True):
        assert et <= 2 * eo + 1e-2, errs


@pytest.mark.cuda
def test_varlen_cuda_device_offsets_check_offsets_flag():
    # device offsets on the fused path are read only with check_offsets=True (one sync)
    q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
    bad = torch.tensor([0, 5, 7], dtype=torch.int32, device="cuda")  # ends at 7, total is 8
    with pytest.raises(ValueError, match="last entry of cu_seqlens_q"):
        dilated_attention_varlen(q, q, q, bad, bad, 5, 5, (4,), (1,), impl="triton", check_offsets=True)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_inference_decode_documents_take_the_decode_path(causal, seed, monkeypatch):
    # without gradients, documents with a few queries and more keys (the rows of a left-padded
    # batch while decoding) go to the decode path in one call per query count; still exact
    import dilated_attention.decode as decode

    calls = []
    orig = decode.decode_core
    monkeypatch.setattr(decode, "decode_core", lambda q, *a, **kw: calls.append(tuple(q.shape[:2])) or orig(q, *a, **kw))
    docs = [(1, 9), (3, 30), (1, 1), (1, 17), (0, 4), (3, 5), (70, 80), (6, 6)]
    q, k, v, cu_q, cu_k = _inputs(docs, 6, 2)
    with torch.no_grad():
        for impl in ("torch", "auto"):
            out, lse = dilated_attention_varlen(
                q, k, v, cu_q, cu_k, 70, 80, (4, 8, 16), (1, 2, 4), causal=causal, impl=impl,
                return_lse=True,
            )  # fmt: skip
            want, want_lse = dilated_attention_varlen(
                q, k, v, cu_q, cu_k, 70, 80, (4, 8, 16), (1, 2, 4), causal=causal,
                impl="reference", return_lse=True,
            )  # fmt: skip
            check_close("out", out, want, atol=1e-12)
            check_close("lse", lse, want_lse, atol=1e-5)
    # one query (two documents) and three (two) in one call each, per impl; (1, 1) and (6, 6)
    # are equal-length documents, 70 > 64 rows is not decoding
    assert sorted(calls) == [(2, 1), (2, 1), (2, 3), (2, 3)]
