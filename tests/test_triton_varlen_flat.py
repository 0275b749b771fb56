"""The flat grid of the packed-documents Triton kernels (issue 22, item 2).

Per branch (segments of W rows, dilation R) a varlen launch has ``total_k // U + documents``
slots on its first axis, the heads on its second: a slot is one block of U = R * block key
rows where that divides W, else a segment (U = W, times the blocks per segment). Document d
owns the slots from ``a_d = cu_k[d] // U + d`` on, ceil(its keys / U) and at most one spare,
and a program finds its document by counting the slot starts at or below its slot
(``triton_kernels._doc_slot`` in ``_doc_block``: one vector load per 32 documents). Here:
the slot formula itself (pure Python, exhaustive over random offsets), the kernels' search (a
probe kernel in Triton's interpreter), the launched grids, and packed streams that stress the
mapping (many documents, empty ones first, last and in a row, one-token documents, documents a
multiple of W long, documents of many segments, documents starting exactly at a multiple of W
and just after, fewer queries than keys) against the float64 reference run on each document
alone, forward and backward, and the folded forward. The CUDA case of this subject is
``tests/test_triton_varlen.py::test_varlen_cuda_vs_per_document[...-30docs]``.
"""

from __future__ import annotations

import bisect
import random

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_triton_varlen import (  # noqa: E402
    INTERP,
    _close,
    _offsets,
    _packed,
    _per_document_reference,
    _triton_varlen,
)

from dilated_attention.kernels import triton_kernels as kern  # noqa: E402
from dilated_attention.kernels import triton_launch as L  # noqa: E402
from dilated_attention.reference import dilated_attention_reference  # noqa: E402

interp_only = pytest.mark.skipif(not INTERP, reason="interpreter tests run on the CPU")


def _slot_starts(cu: list[int], w: int) -> list[int]:
    # a_d for d = 0..docs: the first slot of document d (a_docs: the number of slots)
    return [c // w + d for d, c in enumerate(cu)]


def _random_offsets(rng: random.Random, ndocs: int, w: int) -> list[int]:
    # lengths: empty (often several in a row), one token, multiples of w and one off them,
    # several segments long
    cu = [0]
    for _ in range(ndocs):
        kinds = [0, 0, 1, w - 1, w, w + 1, 2 * w, 3 * w + rng.randrange(w), rng.randrange(5 * w)]
        cu.append(cu[-1] + rng.choice(kinds))
    return cu


def test_slot_formula_partitions_the_segments(seed):
    """Every (document, segment) gets exactly one slot, spares are at most one per document,
    every slot below ``total // w + docs`` (the count the launcher gives from shapes alone:
    ``_axis0``) belongs to one document, and the largest d with a_d <= g finds it."""
    rng = random.Random(seed)
    for trial in range(400):
        w = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 2048])
        ndocs = rng.randrange(1, 41)
        cu = _random_offsets(rng, ndocs, w)
        total = cu[-1]
        a = _slot_starts(cu, w)
        nslots = total // w + ndocs
        assert a[-1] == nslots and a[0] == 0
        lay = L._Layout(1, 0, 0, total, 0, None, None, True, ndocs, total, covered=True)
        _, fixed, per_doc = L._axis0(lay, w, 1, 0, 0)
        assert fixed + per_doc * ndocs == nslots, (w, cu)
        seen = {}
        for g in range(nslots):
            d = bisect.bisect_right(a, g, 0, ndocs) - 1  # the kernel's count
            s = g - a[d]
            assert 0 <= d < ndocs and s >= 0
            seen.setdefault(d, []).append(s)
        for d in range(ndocs):
            n = cu[d + 1] - cu[d]
            need = -(-n // w)
            got = seen.get(d, [])
            assert got == list(range(len(got))), (trial, d)  # consecutive segments from 0
            assert need <= len(got) <= need + 1, (trial, w, cu, d)  # one spare at most
            assert len(got) >= 1  # an empty document owns exactly one (spare) slot


@triton.jit
def _doc_slot_probe(CU_K, DOC, SEG, W, NDOCS):
    g = tl.program_id(0)
    d, s = kern._doc_slot(CU_K, g, W, NDOCS)
    tl.store(DOC + g, d)
    tl.store(SEG + g, s)


@interp_only
def test_kernel_doc_slot_is_the_formula(seed):
    """The kernels' search (``_doc_slot``) maps every slot of the flat grid to the
    document and segment of the formula, empty documents first, last and in a row included."""
    rng = random.Random(seed)
    fixed = [[0, 0, 1, 8, 8, 16, 17, 17, 17, 40], [0, 3], [0, 0], [0, 8, 8, 8]]
    for cu in fixed + [_random_offsets(rng, rng.randrange(1, 33), 4) for _ in range(4)]:
        for w in (1, 3, 4, 8):
            ndocs = len(cu) - 1
            nslots = cu[-1] // w + ndocs
            doc = torch.full((nslots,), -1, dtype=torch.int32)
            seg = torch.full((nslots,), -1, dtype=torch.int32)
            _doc_slot_probe[(nslots,)](torch.tensor(cu, dtype=torch.int32), doc, seg, w, ndocs)
            a = _slot_starts(cu, w)
            want_d = [bisect.bisect_right(a, g, 0, ndocs) - 1 for g in range(nslots)]
            want_s = [g - a[d] for g, d in enumerate(want_d)]
            assert doc.tolist() == want_d, (cu, w)
            assert seg.tolist() == want_s, (cu, w)


@interp_only
@pytest.mark.parametrize("ndocs", [32, 33, 34, 65, 130])
def test_kernel_doc_slot_many_documents(seed, ndocs):
    """More documents than one vector load of offsets covers (32 past the first): the count
    goes on over every load, up to the last document (int32 and int64 offsets)."""
    rng = random.Random(seed + ndocs)
    cu = _random_offsets(rng, ndocs, 2)
    cu[-1] += 3  # the last document is not empty
    for dtype, w in ((torch.int32, 2), (torch.int64, 3)):
        nslots = cu[-1] // w + ndocs
        doc = torch.full((nslots,), -1, dtype=torch.int32)
        seg = torch.full((nslots,), -1, dtype=torch.int32)
        _doc_slot_probe[(nslots,)](torch.tensor(cu, dtype=dtype), doc, seg, w, ndocs)
        a = _slot_starts(cu, w)
        want_d = [bisect.bisect_right(a, g, 0, ndocs) - 1 for g in range(nslots)]
        assert doc.tolist() == want_d, (ndocs, w)
        assert seg.tolist() == [g - a[d] for g, d in enumerate(want_d)], (ndocs, w)
        assert doc.max().item() == ndocs - 1


# 30 documents over W = 4, 8, 6: empty first, last and three in a row, one-token documents,
# multiples of 8 (8, 16, 24), documents of several segments (33: 9 segments of 4), a document
# starting at 8 and at 32 (multiples of W = 4 and 8) and one at 33 (just after)
MANY = [0, 0, 1, 7, 8, 16, 0, 1, 3, 24, 0, 0, 0, 5, 2, 33, 1, 8, 9, 0, 4, 12, 1, 1, 17, 6, 0, 2,
        8, 0]  # fmt: skip
# keys of 24 documents with fewer (or no) queries in some (bottom-right aligned), the last one
# not empty (a search that never reaches the last document fails here)
KEYS = [0, 1, 9, 16, 0, 0, 4, 13, 1, 25, 8, 3, 0, 10, 5, 20, 2, 0, 7, 12, 1, 6, 15, 3]
QUERIES = [0, 1, 4, 16, 0, 0, 0, 13, 1, 7, 8, 1, 0, 3, 5, 20, 0, 0, 7, 2, 1, 6, 11, 2]

# slots of one block (r * block divides w; the interpreter's blocks are 32 rows): documents
# around the block and segment edges (31, 32, 33; 64, 65; 96; 128, 129), several segments
# (160), empty ones first and in a row, one-token documents
BLOCKS = [0, 1, 31, 32, 33, 64, 65, 0, 0, 160, 96, 128, 129, 5, 0, 97, 2]
BLOCK_KEYS = [40, 1, 33, 0, 130, 64, 200, 9]
BLOCK_QUERIES = [7, 1, 33, 0, 97, 2, 200, 9]

CASES = {
    # (query lengths, key lengths (None: the same), heads, kv heads, branches, head_assignment)
    # w % r != 0 (6 % 4), r > 1, MQA (2 query heads on one kv head)
    "many_docs_mqa": (MANY, None, 2, 1, ([4, 8, 6], [1, 2, 4]), "all"),
    # own query offsets (queries shorter than keys), GQA 4/2, split heads, 12 % 5 != 0
    "short_q_gqa": (QUERIES, KEYS, 4, 2, ([5, 12], [1, 5]), "split"),
    # block slots: two blocks per segment (64 / (1 * 32), 128 / (2 * 32)), one (96 = 3 * 32),
    # and a branch of segment slots beside them (40 % 32 != 0)
    "block_slots": (BLOCKS, None, 3, 1, ([64, 128, 96, 40], [1, 2, 3, 1]), "all"),
    # block slots with fewer queries than keys, GQA 4/2, split heads
    "block_slots_short_q": (BLOCK_QUERIES, BLOCK_KEYS, 4, 2, ([64, 128], [1, 2]), "split"),
}


def _launch_spy(monkeypatch) -> list:
    """Records (kernel, grid, arguments by name) of every fwd / dK/dV / dQ / folded launch."""
    seen = []
    for name in ("_FWD", "_DKDV", "_DQ", "_FWD_FOLDED"):
        dk = getattr(L, name)

        def launch(grid, args, options, dk=dk, name=name, real=dk.launch):
            a = dict(zip(dk.names, args))
            a.update(options)
            seen.append((name, tuple(grid), a))
            return real(grid, args, options)

        monkeypatch.setattr(dk, "launch", launch)
    return seen


def _assert_flat_grids(seen, total_k: int, ndocs: int) -> set:
    """Every launch is the flat grid, the heads only on its second axis: on the first, a
    program per slot of R * block key rows (total_k // (R * block) + documents) where that
    divides W, else blocks per segment x (total_k // W + documents). Returns the kinds of slot
    seen ("block", "segment", "window")."""
    assert seen
    kinds = set()
    for name, grid, a in seen:
        assert a["VARLEN"] and a["NDOCS"] == ndocs, name
        if name == "_FWD_FOLDED":
            assert grid == (a["NT"] * a["RMAX"] * (total_k // a["WMIN"] + ndocs), a["H"])
            kinds.add("window")
            continue
        per_seg = a["NNB"] if name == "_DKDV" else a["NM"]
        block = a["BN"] if name == "_DKDV" else a["BM"]
        heads = a["HKV"] * a["NI"] if name == "_DKDV" else a["NHB"]
        u = a["R"] * block
        if a["W"] % u == 0:
            assert L.block_slot_rows(a["W"], a["R"], block) == u
            assert grid == (total_k // u + ndocs, heads), (name, grid, a["W"], a["R"])
            kinds.add("block")
        else:
            assert L.block_slot_rows(a["W"], a["R"], block) == a["W"]
            assert grid == (per_seg * (total_k // a["W"] + ndocs), heads), (name, grid)
            kinds.add("segment")
    return kinds


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_flat_grid_vs_per_document_reference(seed, monkeypatch, case, causal):
    qlens, klens, h, hkv, (seg, dil), ha = CASES[case]
    klens = klens or qlens
    seen = _launch_spy(monkeypatch)
    q, k, v, do = _packed(qlens, klens, h, hkv, 16, torch.float64, "cpu")
    kw = dict(causal=causal, head_assignment=ha)
    ref = _per_document_reference(q, k, v, do, qlens, klens, seg, dil, torch.float64, **kw)
    got = _triton_varlen(q, k, v, do, qlens, klens, seg, dil, torch.float32, **kw)
    kinds = _assert_flat_grids(seen, sum(klens), len(klens))
    assert kinds == ({"block", "segment"} if case == "block_slots" else
                     {"block"} if case == "block_slots_short_q" else {"segment"}), kinds
    _close("out", got[0], ref[0], 2e-5)
    _close("lse", got[1], ref[1], 2e-5)
    for name, g, r in zip("qkv", got[2], ref[2], strict=True):
        _close(f"d{name}", g, r, 5e-5)


@interp_only
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flat_grid_folded_forward(seed, monkeypatch, causal):
    """The folded forward (one launch for nested branches, queries = keys) on the flat grid of
    w_min windows, plan and per-call path, against the reference per document (causal: only
    with ``fold=True``, hence slow-marked)."""
    lens = MANY
    seg, dil = [4, 8, 16], [1, 2, 4]
    h, hkv, d = 2, 1, 16
    seen = _launch_spy(monkeypatch)
    monkeypatch.setattr(L, "_PLANS", type(L._PLANS)())
    q, k, v, _ = _packed(lens, lens, h, hkv, d, torch.float32, "cpu")
    cu = _offsets(lens, "cpu")
    docs = L.Docs(cu, cu, max(lens), max(lens))
    args = (None, seg, dil, causal, d**-0.5, [(0, h)] * 3)
    per_call = L.forward_per_call(q[None], k[None], v[None], *args, fold=True, docs=docs)
    planned = L.forward(q[None], k[None], v[None], *args, fold=True, docs=docs)
    assert [name for name, _, _ in seen] == ["_FWD_FOLDED"] * 2
    _assert_flat_grids(seen, sum(lens), len(lens))
    assert torch.equal(per_call[0], planned[0]) and torch.equal(per_call[1], planned[1])
    outs, lses = [], []
    for i in range(len(lens)):
        if lens[i]:
            rows = slice(cu[i], cu[i + 1])
            o, s = dilated_attention_reference(*(x[rows][None].double() for x in (q, k, v)), seg,
                                               dil, causal=causal)  # fmt: skip
            outs.append(o[0])
            lses.append(s[0])
    _close("out", planned[0][0], torch.cat(outs), 2e-5)
    _close("lse", planned[1][0], torch.cat(lses, 1), 2e-5)
