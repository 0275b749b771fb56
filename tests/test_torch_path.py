"""impl="torch" against impl="reference": forward, LSE and gradients, over the axes that break things."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from dilated_attention import dilated_attention

BRANCHES = {
    "one": ((8,), (1,)),
    "two": ((8, 16), (1, 2)),
    "w%r!=0": ((7, 20), (3, 6)),
    "paper/256": ((8, 16, 32, 64, 128), (1, 2, 4, 6, 12)),
    "w>N": ((16, 256), (2, 4)),
}
LENGTHS = [(37, 37), (64, 64), (97, 97), (5, 37), (1, 64)]  # (seqlen_q, seqlen_k)
HEADS = [(4, 4), (6, 2), (6, 1)]


def _inputs(b, nq, nk, h, hkv, d, dtype, mask):
    q = torch.randn(b, nq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, nk, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, nk, hkv, d, dtype=dtype, requires_grad=True)
    kpm = (torch.rand(b, nk) < 0.25) if mask else None
    return q, k, v, kpm


def _run(impl, q, k, v, seg, dil, causal, ha, kpm, do):
    out, lse = dilated_attention(
        q, k, v, seg, dil, causal=causal, head_assignment=ha, key_padding_mask=kpm, impl=impl, return_lse=True
    )
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out, lse, grads


def _fp64_cases():
    """Every (branches, causal, lengths) combination, each with a different (heads, head
    assignment, key padding) mix cycled so that every value of those axes meets every other."""
    cases = []
    i = 0
    for branches in BRANCHES:
        for causal in (False, True):
            for lengths in LENGTHS:
                for rep in range(2):
                    heads = HEADS[(i + rep) % len(HEADS)]
                    ha = ("all", "split")[(i // 3 + rep) % 2]
                    mask = bool((i // 2 + rep) % 2)
                    cases.append(
                        pytest.param(
                            branches, causal, heads, lengths, ha, mask,
                            id=f"{branches}-{'causal' if causal else 'full'}-H{heads[0]}kv{heads[1]}-"
                            f"{lengths[0]}of{lengths[1]}-{ha}-{'kpm' if mask else 'nomask'}",
                        )
                    )
                i += 1
    return cases


@pytest.mark.parametrize("branches,causal,heads,lengths,ha,mask", _fp64_cases())
def test_torch_matches_reference_fp64(seed, branches, causal, heads, lengths, ha, mask):
    seg, dil = BRANCHES[branches]
    (nq, nk), (h, hkv) = lengths, heads
    q, k, v, kpm = _inputs(2, nq, nk, h, hkv, 8, torch.float64, mask)
    do = torch.randn(2, nq, h, 8, dtype=torch.float64)
    o_r, l_r, g_r = _run("reference", q, k, v, seg, dil, causal, ha, kpm, do)
    o_t, l_t, g_t = _run("torch", q, k, v, seg, dil, causal, ha, kpm, do)
    assert o_t.dtype == torch.float64 and l_t.dtype == torch.float32 and l_t.shape == (2, h, nq)
    torch.testing.assert_close(o_t, o_r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(l_t, l_r)  # both float32; -inf where a row has no key
    for a, b in zip(g_t, g_r, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("branches", ["two", "w%r!=0", "paper/256"])
def test_torch_low_precision(seed, dtype, tol, causal, branches):
    seg, dil = BRANCHES[branches]
    q, k, v, _ = _inputs(1, 150, 150, 6, 2, 32, dtype, False)
    do = torch.randn(1, 150, 6, 32, dtype=dtype)
    o_t, _, g_t = _run("torch", q, k, v, seg, dil, causal, "all", None, do)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_r, _, g_r = _run("reference", q64, k64, v64, seg, dil, causal, "all", None, do.double())
    assert o_t.dtype == dtype and all(g.dtype == dtype for g in g_t)
    assert rel_err(o_t, o_r) < tol
    for a, b in zip(g_t, g_r, strict=True):
        assert rel_err(a, b) < 2 * tol


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_fp64(seed, causal):
    q, k, v, _ = _inputs(1, 11, 11, 4, 2, 4, torch.float64, False)
    kpm = torch.zeros(1, 11, dtype=torch.bool)
    kpm[0, 3] = True
    fn = lambda q, k, v: dilated_attention(q, k, v, [4, 8], [1, 3], causal=causal, key_padding_mask=kpm, impl="torch")
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_dropout_statistics_and_exact_backward(seed):
    q, k, v, _ = _inputs(1, 10, 10, 2, 2, 4, torch.float64, False)

    def fn(q, k, v):
        torch.manual_seed(1234)  # the same masks every call, so gradcheck sees one function
        return dilated_attention(q, k, v, [4, 8], [1, 2], dropout_p=0.3, impl="torch")

    assert torch.autograd.gradcheck(fn, (q, k, v))
    o1, o2 = fn(q, k, v), dilated_attention(q, k, v, [4, 8], [1, 2], dropout_p=0.3, impl="torch")
    assert not torch.allclose(o1, o2)  # masks differ across calls
    # dropout is unbiased: the mean over many draws approaches the no-dropout output
    with torch.no_grad():
        mean = sum(dilated_attention(q, k, v, [4, 8], [1, 2], dropout_p=0.3, impl="torch") for _ in range(300)) / 300
        plain = dilated_attention(q, k, v, [4, 8], [1, 2], impl="torch")
    assert rel_err(mean, plain) < 0.1


def test_lse_matches_logsumexp_definition(seed):
    q, k, v, _ = _inputs(1, 33, 33, 4, 4, 8, torch.float64, False)
    _, lse = dilated_attention(q, k, v, [8, 16], [2, 4], return_lse=True, impl="torch")
    _, lse_ref = dilated_attention(q, k, v, [8, 16], [2, 4], return_lse=True, impl="reference")
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 33)
    torch.testing.assert_close(lse, lse_ref)


def test_no_nan_when_everything_is_padding(seed):
    q, k, v, _ = _inputs(2, 20, 20, 2, 2, 8, torch.float32, False)
    kpm = torch.zeros(2, 20, dtype=torch.bool)
    kpm[1] = True
    out = dilated_attention(q, k, v, [8], [2], key_padding_mask=kpm, impl="torch")
    assert (out[1] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[1] == 0).all()


def test_no_global_side_effects():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    import dilated_attention as da

    da.MultiheadDilatedAttention(32, 4, [8], [1])
    da.dilated_attention(torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8), [8], [2])
    after = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    assert before == after


def test_the_oracle_comparison_can_fail(seed):
    """Guard against a vacuous comparison: a different branch config must NOT match."""
    q, k, v, _ = _inputs(1, 32, 32, 4, 4, 8, torch.float64, False)
    a = dilated_attention(q, k, v, [8, 16], [1, 2], impl="torch")
    b = dilated_attention(q, k, v, [8, 16], [1, 4], impl="reference")
    assert not torch.allclose(a, b, atol=1e-3)


@pytest.mark.parametrize("ha", ["all", "split"])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_groups_match_reference(seed, monkeypatch, ha, causal):
    """Large groups are split into attention calls of ~_GROUP_ROWS rows; force tiny chunks so the
    splitting (views and gathers, partial last segment, decode) runs against the oracle."""
    from dilated_attention.kernels import torch_dilated

    monkeypatch.setattr(torch_dilated, "_GROUP_ROWS", 16)
    for nq, nk in ((100, 100), (7, 100)):
        q, k, v, kpm = _inputs(2, nq, nk, 6, 2, 8, torch.float64, True)
        do = torch.randn(2, nq, 6, 8, dtype=torch.float64)
        seg, dil = (8, 16, 40), (1, 2, 3)
        o_r, l_r, g_r = _run("reference", q, k, v, seg, dil, causal, ha, kpm, do)
        o_t, l_t, g_t = _run("torch", q, k, v, seg, dil, causal, ha, kpm, do)
        if nq == nk:  # really chunked (decode computes only the last segments)
            assert len(torch_dilated.make_plan(nq, nk, 6, 2, seg, dil, ha, q.device)) > 6
        torch.testing.assert_close(o_t, o_r, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(l_t, l_r)
        for a, b in zip(g_t, g_r, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("heads,kmode", [((8, 8), "diag"), ((8, 2), "shared")])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_groups_match_reference(seed, heads, kmode, causal):
    """Branches with r > 1 whose groups are strided diagonal views (no index tensors): plain MHA
    ("diag") and GQA with r dividing the group size ("shared"), with key padding, whole and
    partial segments, against the oracle; the plan must really contain such groups."""
    from dilated_attention.kernels import torch_dilated

    h, hkv = heads
    seg, dil = (8, 16, 32), (1, 2, 4)
    n = 88  # 88 % 32 != 0: a partial last segment (gathered) next to strided whole segments
    plan = torch_dilated.make_plan(n, n, h, hkv, seg, dil, "all", torch.device("cpu"))
    assert {g.kmode for g in plan if g.kind == "strided"} == {kmode}
    assert sum(g.kind == "strided" for g in plan) >= 2
    q, k, v, kpm = _inputs(2, n, n, h, hkv, 8, torch.float64, True)
    do = torch.randn(2, n, h, 8, dtype=torch.float64)
    o_r, l_r, g_r = _run("reference", q, k, v, seg, dil, causal, "all", kpm, do)
    o_t, l_t, g_t = _run("torch", q, k, v, seg, dil, causal, "all", kpm, do)
    torch.testing.assert_close(o_t, o_r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(l_t, l_r)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_path_cuda_vs_reference(seed, dtype, causal):
    """Real block sizes on the GPU (blocks of >= 128 rows take the cuDNN/flash private ops):
    bf16/fp16 torch path against the float32 dense reference, forward and backward."""
    dev = "cuda"
    n, h, d = 4096, 4, 128
    seg, dil = (512, 1024, 4096), (1, 2, 4)
    q, k, v, do = (torch.randn(1, n, h, d, device=dev, dtype=dtype) for _ in range(4))
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = dilated_attention(qs, ks, vs, seg, dil, causal=causal, impl="torch")
    grads = torch.autograd.grad(out, (qs, ks, vs), do)
    q32, k32, v32 = (t.float().requires_grad_(True) for t in (q, k, v))
    ref = dilated_attention(q32, k32, v32, seg, dil, causal=causal, impl="reference")
    refg = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert rel_err(out, ref) < tol
    for a, b in zip(grads, refg, strict=True):
        assert a.dtype == dtype and rel_err(a, b) < 2 * tol


@pytest.mark.parametrize("n", [40, 300])  # the fused small-call path and the per-group blocks
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_head_dim_matches_reference(n, which, causal):
    # a view whose last dim is not unit-stride (a permuted (B, D, N, H) buffer): PyTorch's CPU
    # flash kernel reads it as if it were, so impl="torch" used to return wrong values silently
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    assert args[which].stride(-1) != 1
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_s = [a.detach().requires_grad_() for a in (args["q"], args["k"], args["v"])]
    ref = dilated_attention(*leaves, (8, 16), (1, 2), causal=causal, impl="reference")
    out = dilated_attention(*leaves_s, (8, 16), (1, 2), causal=causal, impl="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    do = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(ref, leaves, do), torch.autograd.grad(out, leaves_s, do), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("scale", [0.0, -0.7])
@pytest.mark.parametrize("n", [40, 300])
def test_causal_nonpositive_scale_matches_reference(scale, n):
    # any finite softmax_scale is legal; PyTorch's CPU flash kernel gave NaN for causal blocks
    # with scale <= 0 (it scales the -inf of masked scores)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    ref = dilated_attention(q, k, v, (128,), (1,), causal=True, softmax_scale=scale, impl="reference")
    out = dilated_attention(q, k, v, (128,), (1,), causal=True, softmax_scale=scale, impl="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    do = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(ref, (q, k, v), do), torch.autograd.grad(out, (q, k, v), do), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_cpu_flash_strided_head_dim(causal):
    # the per-block kernel that ring / sequence-parallel attention call directly: a strided
    # head dim must give the contiguous result (forward and backward)
    from dilated_attention.kernels.block_attention import attn_bwd, attn_fwd

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 40, 8, dtype=torch.float64, generator=g) for _ in range(4))

    def strided(x):
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    out, lse = attn_fwd(q, k, v, 0.35, causal, backend="cpu_flash")
    out_s, lse_s = attn_fwd(strided(q), strided(k), strided(v), 0.35, causal, backend="cpu_flash")
    torch.testing.assert_close(out_s, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_s, lse, rtol=0, atol=1e-12)
    grads = attn_bwd(do, q, k, v, out, lse, 0.35, causal, backend="cpu_flash")
    grads_s = attn_bwd(strided(do), strided(q), strided(k), strided(v), strided(out), lse, 0.35, causal, backend="cpu_flash")
    for a, b in zip(grads, grads_s, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("first", ["contiguous", "other"])
def test_cudnn_backward_follows_dout_and_out_strides(seed, first):
    """cuDNN attention's backward on one shape, called again with dO (and out) in another memory
    layout: PyTorch 2.11 reused the graph of the first layout and gave gradients off by ~1-2
    (benchmarks/probe_cudnn_bwd_strides.py, H200, 2026-11-28). Each call must equal the flash
    backend's gradients for the same values, whatever layout came first."""
    from dilated_attention.kernels import block_attention as ba

    if not ba._cudnn_usable(torch.cuda.current_device()):
        pytest.skip("cuDNN attention is not used on this GPU")
    l_rows = 256 if first == "contiguous" else 384  # one shape per order: its own cached graphs
    q, k, v, g = (torch.randn(1, 4, l_rows, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 64**-0.5
    out, lse = ba.attn_fwd(q, k, v, scale, False, backend="cudnn")
    out_f, lse_f = ba.attn_fwd(q, k, v, scale, False, backend="flash")
    want = ba.attn_bwd(g, q, k, v, out_f, lse_f, scale, False, backend="flash")

    def other(t):  # the same values in (B, L, H, D) memory
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    layouts = [(g, out), (other(g), other(out))]
    if first == "other":
        layouts.reverse()
    for gg, oo in layouts:
        assert torch.equal(gg, g) and torch.equal(oo, out)
        got = ba.attn_bwd(gg, q, k, v, oo, lse, scale, False, backend="cudnn")
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
