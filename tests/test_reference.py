"""The oracle itself, checked against an independent per-branch LongNet Eq. 10 and dense attention."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.branches import branch_head_ranges


def eq10_per_branch(q, k, v, seg, dil, causal, head_assignment):
    """LongNet Eq. 10 written independently: softmax per (segment, offset) block, branches mixed
    with weights proportional to their softmax denominators. Loops, float64, tiny sizes only."""
    b, n, h, d = q.shape
    rep = h // k.shape[2]
    scale = d**-0.5
    out = torch.zeros(b, n, h, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                num = torch.zeros(d, dtype=torch.float64)
                den = torch.zeros((), dtype=torch.float64)
                for (w, r), (hs, he) in zip(zip(seg, dil, strict=True), branch_head_ranges(h, len(seg), head_assignment), strict=True):
                    if not hs <= hi < he:
                        continue
                    o = hi % r
                    if (i % w) % r != o:
                        continue
                    s0 = (i // w) * w
                    keys = [j for j in range(s0, min(s0 + w, n)) if (j - s0) % r == o and (not causal or j <= i)]
                    if not keys:
                        continue
                    kk = k[bi, keys, hi // rep].double()
                    vv = v[bi, keys, hi // rep].double()
                    e = torch.exp((kk @ q[bi, i, hi].double()) * scale)
                    num += e @ vv
                    den += e.sum()
                if den > 0:
                    out[bi, i, hi] = num / den
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_assignment", ["all", "split"])
@pytest.mark.parametrize(
    "seg,dil", [((4,), (1,)), ((4, 8), (1, 2)), ((3, 6, 13), (1, 4, 6)), ((5, 20), (2, 3))]
)
def test_reference_equals_independent_eq10(seed, causal, head_assignment, seg, dil):
    q = torch.randn(1, 23, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 23, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 23, 2, 8, dtype=torch.float64)
    out = dilated_attention(q, k, v, seg, dil, causal=causal, head_assignment=head_assignment, impl="reference")
    ref = eq10_per_branch(q, k, v, seg, dil, causal, head_assignment)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_single_full_branch_is_dense_attention(seed, causal):
    q, k, v = (torch.randn(2, 30, 3, 16, dtype=torch.float64) for _ in range(3))
    for impl in ("reference", "torch"):
        out = dilated_attention(q, k, v, [64], [1], causal=causal, impl=impl)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)
        torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10)


def test_double_counting_of_shared_keys(seed):
    """Two identical branches count every key twice: the output equals one branch's (the weights
    cancel) but the LSE is log 2 larger."""
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64) for _ in range(3))
    o1, l1 = dilated_attention(q, k, v, [8], [2], impl="reference", return_lse=True)
    o2, l2 = dilated_attention(q, k, v, [8, 8], [2, 2], impl="reference", return_lse=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l2, l1 + torch.log(torch.tensor(2.0)))


def test_rows_without_keys_are_zero_not_nan(seed):
    # split: head 1 only in branch (8, 2) with offset 1: even positions have no key for head 1
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for impl in ("reference", "torch"):
        out, lse = dilated_attention(q, k, v, [4, 8], [1, 2], head_assignment="split", impl=impl, return_lse=True)
        assert torch.isneginf(lse[0, 1, 0::2]).all() and torch.isfinite(lse[0, 1, 1::2]).all()
        assert (out[0, 0::2, 1] == 0).all()
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        for t in (q, k, v):
            t.grad = None


def test_split_head_ranges_first_groups_larger():
    # docs/spec.md: the first H % B groups are one head larger; the reference and the torch path
    # share branch_head_ranges, so only the independent loop (spec_loop) could see it otherwise
    from spec_loop import spec

    assert branch_head_ranges(4, 3, "split") == [(0, 2), (2, 3), (3, 4)]
    assert branch_head_ranges(7, 3, "split") == [(0, 3), (3, 5), (5, 7)]
    assert branch_head_ranges(2, 3, "split") == [(0, 1), (1, 2), (2, 2)]
    q, k, v = (torch.randn(1, 12, 5, 4, dtype=torch.float64) for _ in range(3))
    seg, dil = (4, 6, 12), (1, 2, 3)
    want, _ = spec(q, k, v, seg, dil, ha="split")
    for impl in ("reference", "torch"):
        out = dilated_attention(q, k, v, seg, dil, head_assignment="split", impl=impl)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", range(6))
def test_reference_and_torch_equal_the_spec_loop(seed, case):
    """out and lse of the reference and the torch path against tests/spec_loop.py on random tiny
    calls: fewer queries than keys (bottom-right), key padding, a custom scale, GQA, split heads,
    batch 2 (the older independent check, test_reference_equals_independent_eq10, has none of
    these and no lse)."""
    from spec_loop import spec

    g = torch.Generator().manual_seed(seed + case)
    nk = int(torch.randint(9, 26, (1,), generator=g))
    nq = nk if case % 2 == 0 else int(torch.randint(1, nk + 1, (1,), generator=g))
    h, hkv = [(4, 4), (6, 2), (4, 1)][case % 3]
    seg, dil = [((4, 8, 16), (1, 2, 4)), ((6, 9), (2, 3)), ((5, 24), (1, 3))][case % 3]
    ha = "split" if case in (1, 4) else "all"
    causal = case % 2 == 1 or case == 4
    scale = None if case < 3 else 0.7
    q = torch.randn(2, nq, h, 4, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, nk, hkv, 4, dtype=torch.float64, generator=g) for _ in range(2))
    kpm = torch.rand(2, nk, generator=g) < 0.2 if case >= 2 else None
    want, want_lse = spec(q, k, v, seg, dil, causal=causal, scale=scale, kpm=kpm, ha=ha)
    for impl in ("reference", "torch"):
        out, lse = dilated_attention(q, k, v, seg, dil, causal=causal, softmax_scale=scale, key_padding_mask=kpm,
                                     head_assignment=ha, return_lse=True, impl=impl)  # fmt: skip
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10, msg=impl)
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), fin), impl
        torch.testing.assert_close(lse.double()[fin], want_lse[fin], rtol=1e-6, atol=1e-6, msg=impl)
