"""Peers of dilated attention that express the same function with other people's kernels.

Both compute exactly what ``dilated_attention(..., impl="reference")`` computes (docs/spec.md:
multiplicity-weighted softmax over the union of the branches' pairs), so a benchmark can put
them in the same table as ``impl="torch"`` / ``impl="triton"``:

- :func:`flex_dilated_attention`: FlexAttention (``torch.nn.attention.flex_attention``) with a
  block mask of the union of the branches' segments (every (query block, key block) pair that
  lies in one segment of some branch; built directly from the segment geometry, never from an
  N x N mask) and a ``score_mod`` that adds ``log m(i, j, h)`` (``-inf`` where m = 0). The
  residue condition of a branch (row ``(i mod w) mod r`` equal to the head's offset) is finer
  than a 128-row block, so the block mask can only skip whole segments: the kernel computes
  every score of a segment of the largest branch and discards the rest by the score_mod.
- :func:`torchscale_dilated_attention`: the algorithm of torchscale's LongNet: per branch,
  gather the dilated rows of each segment, run FlashAttention per segment, scatter back and merge
  the branches by softmax over their LSEs. torchscale detaches the mixing weights
  ``exp(lse_b - lse)``; this version does not: its backward runs FlashAttention's backward per
  branch with the *merged* output and LSE, which gives every pair of branch b
  ``dS = exp(S - lse) * (dO V^T - rowsum(dO * out))``, the exact derivative of the merged
  output including the weights (checked against the reference in tests/test_peers.py).

Both are benchmark peers, not library code: they live under benchmarks/ and are imported by
benchmarks/sweep.py.
"""

from __future__ import annotations

import math

import torch

from dilated_attention.branches import branch_head_ranges, normalize_branches


# ------------------------------------------------------------------------------ FlexAttention
def segment_block_mask_dense(
    seqlen: int, segment_lengths, block_size: int = 128, causal: bool = False, device=None
) -> torch.Tensor:
    """(nblocks_q, nblocks_k) bool: key block c can hold a key that query block a attends.

    True when some branch puts a row of block a and a row of block c in one segment (a superset
    of the pairs: the residue classes are resolved by the score_mod); causal also needs
    c's first row <= a's last row. O(nblocks^2) per branch, no N x N tensor.
    """
    nb = -(-seqlen // block_size)
    start = torch.arange(nb, device=device) * block_size
    last = torch.clamp(start + block_size - 1, max=seqlen - 1)
    allowed = torch.zeros(nb, nb, dtype=torch.bool, device=device)
    for w in segment_lengths:
        lo, hi = start // w, last // w  # segments a block touches: [lo, hi]
        allowed |= (torch.maximum(lo[:, None], lo[None, :]) <= torch.minimum(hi[:, None], hi[None, :]))
    if causal:
        allowed &= start[None, :] <= last[:, None]
    return allowed


def flex_block_mask(seqlen: int, segment_lengths, block_size: int = 128, causal: bool = False, device=None):
    """A ``BlockMask`` (batch and heads broadcast) of :func:`segment_block_mask_dense`; every
    block is partial (no full blocks), so the score_mod decides every pair."""
    from torch.nn.attention.flex_attention import BlockMask

    allowed = segment_block_mask_dense(seqlen, segment_lengths, block_size, causal, device)
    num = allowed.sum(-1, dtype=torch.int32)
    # allowed key blocks first, in ascending order (stable sort of "not allowed")
    idx = torch.argsort((~allowed).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(
        num[None, None], idx[None, None], BLOCK_SIZE=block_size, seq_lengths=(seqlen, seqlen)
    )


def multiplicity_score_mod(segment_lengths, dilation_rates, nheads: int, causal: bool = False,
                           head_assignment: str = "all"):
    """``score_mod(score, b, h, i, j) = score + log m(i, j, h)`` (``-inf`` where m = 0).

    m is the number of branches (w, r) whose heads include h with i, j in one segment and
    ``(i mod w) mod r == (j mod w) mod r == h mod r`` (docs/spec.md), computed from the indices
    with integer arithmetic: no table of N x N.
    """
    seg, dil = normalize_branches(segment_lengths, dilation_rates)
    ranges = branch_head_ranges(nheads, len(seg), head_assignment)

    def score_mod(score, b, h, i, j):
        m = torch.zeros_like(i)
        for (w, r), (hs, he) in zip(zip(seg, dil, strict=True), ranges, strict=True):
            off = h % r
            hit = (i // w == j // w) & ((i % w) % r == off) & ((j % w) % r == off)
            if (hs, he) != (0, nheads):
                hit = hit & (h >= hs) & (h < he)
            m = m + hit.to(m.dtype)
        if causal:
            m = torch.where(j <= i, m, torch.zeros_like(m))
        # log(max(m, 1)) keeps the unselected branch of where() finite (no NaN in its gradient)
        logm = torch.log(torch.clamp(m, min=1).to(score.dtype))
        return torch.where(m > 0, score + logm, -math.inf)

    return score_mod


def flex_dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                           block_mask=None, score_mod=None, flex_fn=None, block_size: int = 128):
    """Dilated attention through FlexAttention; q: (B, N, H, D), k, v: (B, N, Hkv, D).

    ``flex_fn``: ``flex_attention`` itself (eager; the CPU forward) or a ``torch.compile``d
    copy (needed on CUDA for speed). ``block_mask`` / ``score_mod``: pass a cached
    :func:`flex_block_mask` / :func:`multiplicity_score_mod` to keep their construction out of
    the timing (and one score_mod object, so a compiled flex is not re-traced per call).
    Returns out (B, N, H, D).
    """
    from torch.nn.attention.flex_attention import flex_attention

    b, n, h, d = q.shape
    if k.shape[1] != n:
        raise ValueError(f"flex peer: seqlen_q ({n}) must equal seqlen_k ({k.shape[1]})")
    fn = flex_attention if flex_fn is None else flex_fn
    if block_mask is None:
        block_mask = flex_block_mask(n, segment_lengths, block_size, causal, q.device)
    sm = score_mod or multiplicity_score_mod(segment_lengths, dilation_rates, h, causal)
    out = fn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=sm, block_mask=block_mask,
        scale=scale, enable_gqa=k.shape[2] != h,
    )
    return out.transpose(1, 2)


# ------------------------------------------------------------------ torchscale-style branches
def _check_geometry(n, seg, dil):
    for w, r in zip(seg, dil, strict=True):
        if n % w or w % r:
            raise ValueError(
                f"torchscale peer: needs seqlen % w == 0 and w % r == 0 for every branch (it "
                f"gathers segments as (N/w, w/r, r) views); got seqlen {n}, w {w}, r {r}"
            )


def _gather(x, w, r, heads, offs):
    """x: (B, N, Hx, D) -> (B * N/w, H, w/r, D): rows s*w + offs[h] + r*t of head heads[h]."""
    b, n, hx, d = x.shape
    x6 = x.reshape(b, n // w, w // r, r, hx, d)
    g = x6[:, :, :, offs, heads]  # (B, nseg, L, H, D)
    return g.permute(0, 1, 3, 2, 4).reshape(b * (n // w), len(heads), w // r, d)


def _scatter(g, b, n, w, r, hx, heads, offs, accumulate=False):
    """Inverse of :func:`_gather` into zeros (B, N, Hx, D); ``accumulate`` sums the query heads
    that share one (offset, kv head)."""
    bs, h, L, d = g.shape
    nseg = n // w
    full = g.new_zeros(b, nseg, L, r, hx, d)
    vals = g.reshape(b, nseg, h, L, d).permute(0, 1, 3, 2, 4)  # (B, nseg, L, H, D)
    dev = g.device
    idx = (
        torch.arange(b, device=dev)[:, None, None, None],
        torch.arange(nseg, device=dev)[None, :, None, None],
        torch.arange(L, device=dev)[None, None, :, None],
        offs[None, None, None, :],
        heads[None, None, None, :],
    )
    full.index_put_(idx, vals, accumulate=accumulate)
    return full.view(b, n, hx, d)


def _flash_fwd(q, k, v, causal, scale):
    """(out, lse, meta): FlashAttention per (batch, head) through aten's op; meta is what the
    CUDA backward needs besides out and lse (sequence metadata, rng state)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1], tuple(res[2:8])


def _flash_bwd(dout, q, k, v, out, lse, causal, scale, meta):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    cq, ck, mq, mk, s1, s2 = meta
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, s1, s2, scale=scale)


def _cdt(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


class _TorchscaleExact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg, dil, causal, scale):
        b, n, h, d = q.shape
        hkv = k.shape[2]
        rep = h // hkv
        cdt = _cdt(q)
        heads = torch.arange(h, device=q.device)
        out = torch.zeros(b, n, h, d, dtype=cdt, device=q.device)
        lse = torch.full((b, n, h, 1), -math.inf, dtype=cdt, device=q.device)
        metas = []
        for w, r in zip(seg, dil, strict=True):
            offs = heads % r
            qg = _gather(q, w, r, heads, offs)
            kg = _gather(k, w, r, heads // rep, offs)
            vg = _gather(v, w, r, heads // rep, offs)
            ob, lb, meta = _flash_fwd(qg, kg, vg, causal, scale)
            metas.append(meta)
            ob = _scatter(ob.to(cdt), b, n, w, r, h, heads, offs)
            # rows of a head outside the branch's residue class keep lse_b = -inf (weight 0)
            lb = lb.to(cdt).unsqueeze(-1)
            lfull = _scatter_lse(lb, b, n, w, r, h, heads, offs)
            new = torch.logaddexp(lse, lfull)
            safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
            out = out * torch.exp(lse - safe) + ob * torch.exp(lfull - safe)
            lse = new
        out = out.to(q.dtype)
        lse = lse.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (seg, dil, causal, scale, metas)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        seg, dil, causal, scale, metas = ctx.args
        b, n, h, d = q.shape
        hkv = k.shape[2]
        rep = h // hkv
        heads = torch.arange(h, device=q.device)
        dout = dout.contiguous()
        cdt = _cdt(q)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
        # a row with no key in any branch (lse = -inf) must get P = 0, not NaN: lse = +inf
        lse_d = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf)).unsqueeze(-1)
        for (w, r), meta in zip(zip(seg, dil, strict=True), metas, strict=True):
            offs = heads % r
            kvh = heads // rep
            qg, kg, vg = _gather(q, w, r, heads, offs), _gather(k, w, r, kvh, offs), _gather(v, w, r, kvh, offs)
            # the MERGED out and lse: exp(S - lse) is branch b's share of the final softmax and
            # rowsum(dout * out) the final one's: the exact derivative through the weights
            og, dog = _gather(out, w, r, heads, offs), _gather(dout, w, r, heads, offs)
            lg = _gather(lse_d, w, r, heads, offs).squeeze(-1).contiguous()
            gq, gk, gv = _flash_bwd(dog, qg, kg, vg, og, lg, causal, scale, meta)
            dq += _scatter(gq.to(cdt), b, n, w, r, h, heads, offs)
            dk += _scatter(gk.to(cdt), b, n, w, r, hkv, kvh, offs, accumulate=rep > 1)
            dv += _scatter(gv.to(cdt), b, n, w, r, hkv, kvh, offs, accumulate=rep > 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _scatter_lse(lb, b, n, w, r, h, heads, offs):
    """Branch lse (B*nseg, H, L, 1) -> (B, N, H, 1) with -inf at rows outside the branch."""
    nseg, L = n // w, w // r
    full = lb.new_full((b, nseg, L, r, h, 1), -math.inf)
    vals = lb.reshape(b, nseg, h, L, 1).permute(0, 1, 3, 2, 4)
    dev = lb.device
    idx = (
        torch.arange(b, device=dev)[:, None, None, None],
        torch.arange(nseg, device=dev)[None, :, None, None],
        torch.arange(L, device=dev)[None, None, :, None],
        offs[None, None, None, :],
        heads[None, None, None, :],
    )
    full.index_put_(idx, vals)
    return full.view(b, n, h, 1)


def torchscale_dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None,
                                 return_lse=False):
    """Per-branch FlashAttention + LSE merge (torchscale's algorithm), exact gradients.

    q: (B, N, H, D); k, v: (B, N, Hkv, D); needs N % w == 0 and w % r == 0 per branch (the
    gather is a view) and head_assignment "all". CUDA: fp16/bf16 (FlashAttention); CPU: any
    float dtype (aten's CPU flash kernel). Returns out (B, N, H, D) [, lse (B, N, H)].
    """
    seg, dil = normalize_branches(segment_lengths, dilation_rates)
    b, n, h, d = q.shape
    if k.shape[1] != n:
        raise ValueError(f"torchscale peer: seqlen_q ({n}) must equal seqlen_k ({k.shape[1]})")
    _check_geometry(n, seg, dil)
    scale = d**-0.5 if scale is None else float(scale)
    out, lse = _TorchscaleExact.apply(q, k, v, seg, dil, bool(causal), scale)
    return (out, lse) if return_lse else out
