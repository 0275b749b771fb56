"""The benchmark peers (benchmarks/peers.py) compute the same attention as impl="reference".

FlexAttention has no CPU backward: its forward is checked on the CPU (eager), forward and
backward on CUDA. The torchscale-style peer is checked forward and backward on both; a variant
with torchscale's detached mixing weights must fail the gradient check (so the check can fail).
"""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch

from dilated_attention import dilated_attention

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402

# (segment_lengths, dilation_rates): N % w == 0 and w % r == 0 for the torchscale peer
BRANCHES = {
    "longnet": ((8, 16, 32), (1, 2, 4)),
    "r=3,6": ((12, 24), (3, 6)),
    "one": ((16,), (2,)),
}
HEADS = [(4, 4), (6, 2), (6, 1)]


def _inputs(b, n, h, hkv, d, dtype, device="cpu", grad=True):
    mk = lambda hh: torch.randn(b, n, hh, d, dtype=dtype, device=device, requires_grad=grad)  # noqa: E731
    return mk(h), mk(hkv), mk(hkv)


def _ref(q, k, v, seg, dil, causal):
    return dilated_attention(q, k, v, seg, dil, causal=causal, impl="reference", return_lse=True)


@pytest.mark.parametrize("name", list(BRANCHES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_torchscale_peer_matches_reference(seed, name, causal, heads):
    seg, dil = BRANCHES[name]
    n = math.lcm(*seg) * 2
    q, k, v = _inputs(2, n, heads[0], heads[1], 8, torch.float64)
    do = torch.randn_like(q)
    ref, ref_lse = _ref(q, k, v, seg, dil, causal)
    rg = torch.autograd.grad(ref, (q, k, v), do)
    out, lse = peers.torchscale_dilated_attention(q, k, v, seg, dil, causal=causal, return_lse=True)
    pg = torch.autograd.grad(out, (q, k, v), do)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.transpose(1, 2).float(), ref_lse, atol=1e-5, rtol=1e-5)
    for name_, a, b in zip("qkv", pg, rg, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"d{name_}")


def _detached_torchscale(q, k, v, seg, dil, causal):
    """torchscale's own merge: per-branch SDPA, mixing weights exp(lse_b - lse) detached."""
    b, n, h, d = q.shape
    rep = h // k.shape[2]
    heads = torch.arange(h)
    outs, lses = [], []
    for w, r in zip(seg, dil, strict=True):
        offs = heads % r
        qg, kg, vg = (peers._gather(x, w, r, hh, offs) for x, hh in ((q, heads), (k, heads // rep), (v, heads // rep)))
        ob = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        with torch.no_grad():
            s = qg @ kg.transpose(-1, -2) * d**-0.5
            if causal:
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
            lb = torch.logsumexp(s, -1, keepdim=True)
        outs.append(peers._scatter(ob, b, n, w, r, h, heads, offs))
        lses.append(peers._scatter_lse(lb, b, n, w, r, h, heads, offs))
    lse = torch.logsumexp(torch.stack(lses), 0)
    return sum(o * torch.exp(lb - lse) for o, lb in zip(outs, lses, strict=True))


def test_detached_weights_fail_the_gradient_check(seed):
    """The gradient check above can fail: torchscale's detached weights give the same forward
    and a different gradient."""
    seg, dil = BRANCHES["longnet"]
    q, k, v = _inputs(1, 64, 4, 4, 8, torch.float64)
    do = torch.randn_like(q)
    ref = _ref(q, k, v, seg, dil, False)[0]
    det = _detached_torchscale(q, k, v, seg, dil, False)
    torch.testing.assert_close(det, ref, atol=1e-10, rtol=1e-10)
    rg = torch.autograd.grad(ref, (q, k, v), do)
    dg = torch.autograd.grad(det, (q, k, v), do)
    assert (dg[0] - rg[0]).abs().max() > 1e-3


def test_torchscale_peer_rejects_ragged_geometry():
    q, k, v = _inputs(1, 40, 2, 2, 8, torch.float64, grad=False)
    with pytest.raises(ValueError, match="seqlen % w == 0"):
        peers.torchscale_dilated_attention(q, k, v, (16,), (1,))
    with pytest.raises(ValueError, match="w % r == 0"):
        peers.torchscale_dilated_attention(q, k, v, (8,), (3,))


def test_segment_block_mask_is_a_superset_of_the_pairs(seed):
    """Every attended pair (multiplicity > 0) lies in an allowed block; N not a multiple of the
    block or of w; causal drops blocks above the diagonal."""
    from dilated_attention.reference import multiplicity

    n, bs = 200, 16
    seg, dil = (24, 64, 96), (1, 6, 12)
    for causal in (False, True):
        allowed = peers.segment_block_mask_dense(n, seg, bs, causal)
        m = multiplicity(n, n, 12, seg, dil, "all", causal)  # (H, N, N)
        blk = m.amax(0).reshape(1, n, n)
        pad = -n % bs
        blk = torch.nn.functional.pad(blk, (0, pad, 0, pad))[0]
        nb = (n + pad) // bs
        used = blk.reshape(nb, bs, nb, bs).amax((1, 3)) > 0
        assert not (used & ~allowed).any()
        # and it skips something: blocks in no common segment of the largest w
        assert (~allowed).any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=lambda x: f"{x[0]}x{x[1]}")
def test_flex_peer_forward_matches_reference_cpu(seed, causal, heads):
    # N = 96 with block 32: N not a multiple of the largest w (40) nor w % r == 0 needed
    seg, dil = (8, 20, 40), (1, 3, 6)
    q, k, v = _inputs(2, 96, heads[0], heads[1], 8, torch.float32, grad=False)
    ref = _ref(q, k, v, seg, dil, causal)[0]
    out = peers.flex_dilated_attention(q, k, v, seg, dil, causal=causal, block_size=32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_flex_and_torchscale_peers_cuda(seed, causal):
    """Both peers against the float64 reference on CUDA, forward and backward, in bf16: error
    within 2x (+ bf16 slack) of impl='torch' in the same dtype."""
    seg, dil = (256, 512, 1024), (1, 2, 4)
    n, h, hkv, d = 2048, 4, 2, 64
    q, k, v = _inputs(1, n, h, hkv, d, torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _ref(q64, k64, v64, seg, dil, causal)[0]
    rg = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    base = dilated_attention(q, k, v, seg, dil, causal=causal, impl="torch")
    bg = torch.autograd.grad(base, (q, k, v), do)
    flex = torch.compile(__import__("torch.nn.attention.flex_attention", fromlist=["x"]).flex_attention)
    for name, fn in (
        ("torchscale", lambda: peers.torchscale_dilated_attention(q, k, v, seg, dil, causal=causal)),
        ("flex", lambda: peers.flex_dilated_attention(q, k, v, seg, dil, causal=causal, flex_fn=flex)),
    ):
        out = fn()
        g = torch.autograd.grad(out, (q, k, v), do)
        for what, a, b, r in zip(("out", "dq", "dk", "dv"), (out, *g), (base, *bg), (ref, *rg), strict=True):
            err = (a.double() - r).abs().max().item()
            berr = (b.double() - r).abs().max().item()
            assert err <= 2 * berr + 1e-2 * r.abs().max().item(), f"{name} {what}: {err} vs torch {berr}"
