"""The dense oracle: the definition of docs/spec.md ("Definition") written out literally, as
masked dense attention. It deliberately does not use :mod:`.geometry` (it tests it): the
multiplicity is built from the definition position by position.

Builds the multiplicity m(i, j, h) as an integer tensor of shape (nheads, seqlen_q, seqlen_k)
and computes ``lse = log sum_j m exp(s)`` and ``out = sum_j m exp(s - lse) v_j`` in the input
dtype (use float64 for an oracle). O(N^2) memory: for tests and verification only.
Differentiable by plain autograd.
"""

from __future__ import annotations

import torch

from .branches import branch_head_ranges
from .merge import acc_dtype


def branch_masks(
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    head_assignment: str = "all",
    causal: bool = False,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """One bool (nheads, seqlen_q, seqlen_k) tensor per branch: does branch b put key j in the
    block of query i for head h (causal mask applied, key padding not)."""
    i = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=device)[:, None]  # (Nq, 1)
    j = torch.arange(seqlen_k, device=device)[None, :]  # (1, Nk)
    h = torch.arange(nheads, device=device)[:, None, None]  # (H, 1, 1)
    masks = []
    ranges = branch_head_ranges(nheads, len(segment_lengths), head_assignment)
    for (w, r), (hs, he) in zip(zip(segment_lengths, dilation_rates, strict=True), ranges, strict=True):
        takes_part = (h >= hs) & (h < he)  # (H, 1, 1)
        same_seg = (i // w) == (j // w)  # (Nq, Nk)
        off = h % r
        sel_i = ((i % w) % r)[None] == off  # (H, Nq, 1)
        sel_j = ((j % w) % r)[None] == off  # (H, 1, Nk)
        m = takes_part & same_seg[None] & sel_i & sel_j
        if causal:
            m = m & ~(j > i)
        masks.append(m)
    return masks


def multiplicity(
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    head_assignment: str = "all",
    causal: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """m(i, j, h) of docs/spec.md ("Definition") as int32, shape (nheads, seqlen_q, seqlen_k).

    Query row t is absolute position ``seqlen_k - seqlen_q + t`` (bottom-right alignment).
    Key padding is not included (it depends on the batch); apply it on top.
    """
    m = torch.zeros(nheads, seqlen_q, seqlen_k, dtype=torch.int32, device=device)
    for mb in branch_masks(
        seqlen_q, seqlen_k, nheads, segment_lengths, dilation_rates, head_assignment, causal, device
    ):
        m += mb.to(torch.int32)
    return m


def dilated_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    head_assignment: str = "all",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense dilated attention. q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D).

    Returns out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) in the compute dtype
    (float64 for float64 input, else float32); the public API casts lse to float32.
    """
    bsz, nq, nheads, hd = q.shape
    nk, nheads_kv = k.shape[1], k.shape[2]
    scale = hd**-0.5 if softmax_scale is None else softmax_scale
    rep = nheads // nheads_kv
    masks = branch_masks(nq, nk, nheads, segment_lengths, dilation_rates, head_assignment, causal, q.device)
    m = torch.stack(masks).sum(0, dtype=torch.int32)  # (H, Nq, Nk)
    m = m[None].expand(bsz, -1, -1, -1)  # (B, H, Nq, Nk)
    if key_padding_mask is not None:
        m = m.masked_fill(key_padding_mask[:, None, None, :], 0)
    cdt = acc_dtype(q.dtype)
    qh = q.transpose(1, 2).to(cdt)  # (B, H, Nq, D)
    kh = k.transpose(1, 2).to(cdt).repeat_interleave(rep, dim=1)  # (B, H, Nk, D)
    vh = v.transpose(1, 2).to(cdt).repeat_interleave(rep, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (B, H, Nq, Nk)
    attended = m > 0
    # a row with no key gets lse = -inf and out = 0; keep its math finite so autograd gives 0, not NaN
    empty = ~attended.any(-1, keepdim=True)  # (B, H, Nq, 1)
    logits = torch.where(attended, s + m.to(cdt).log(), torch.full((), float("-inf"), dtype=cdt, device=q.device))
    logits = torch.where(empty, torch.zeros_like(logits), logits)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, H, Nq, 1)
    p = torch.where(attended, torch.exp(logits - lse), torch.zeros_like(logits))
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse).squeeze(-1)  # (B, H, Nq)
    if dropout_p > 0.0:
        # each branch occurrence of a pair is dropped independently (as the fast paths do): the
        # pair's weight p / m is kept once per surviving occurrence, scaled by 1 / (1 - dropout_p)
        kept = torch.zeros_like(p)
        for mb in masks:
            keep = torch.rand(p.shape, dtype=cdt, device=q.device) >= dropout_p
            kept = kept + (mb[None] & keep).to(cdt)
        p = p / m.to(cdt).clamp(min=1) * kept / (1.0 - dropout_p)
    # contiguous like every other impl's output (the transpose alone would be a strided view)
    out = torch.matmul(p, vh).transpose(1, 2).to(q.dtype).contiguous()  # (B, Nq, H, D)
    return out, lse
