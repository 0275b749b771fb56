"""The functional API: validation, semantics and dispatch to an implementation.

:func:`dilated_attention` checks its inputs once (with the checks of ``checks.py``), picks an
implementation (``kernels/select.py``) and hands validated tensors to it (``reference.py``,
``kernels/torch_dilated.py``, the fused Triton kernel, ``distributed/sequence_parallel.py``).
Dependencies flow one way: this module imports the implementations and nothing inside them
imports it back; implementations never import each other's internals, and an explicitly
requested ``impl`` never silently falls back.

Tensor contract (docs/spec.md, "Tensor contract"):
    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    out: like q; lse: (batch, nheads, seqlen_q) float32, natural log.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .autograd_rules import autocast_inputs
from .branches import normalize_branches
from .checks import (
    check_bool,
    check_dropout,
    check_head_assignment,
    check_key_padding_mask,
    check_qkv,
    resolve_scale,
)
from .kernels.select import IMPLS, available_impls, check_impl, pick_impl, triton_unavailable_reason

__all__ = ["IMPLS", "available_impls", "dilated_attention", "triton_unavailable_reason"]


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    head_assignment: str = "all",
    return_lse: bool = False,
    impl: str = "auto",
    group=None,
):
    """LongNet dilated attention, exactly as docs/spec.md ("Definition") defines it.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_k, nheads_kv, headdim); ``nheads % nheads_kv == 0`` (GQA/MQA).
            ``seqlen_q <= seqlen_k``; query row t is position ``seqlen_k - seqlen_q + t``.
        segment_lengths, dilation_rates: one (w_b, r_b) per branch, ``1 <= r_b <= w_b``.
        causal: key j is masked for query position i when j > i.
        softmax_scale: default ``headdim ** -0.5``.
        key_padding_mask: (batch, seqlen_k) bool, True = padding (ignored key).
        dropout_p: attention dropout after normalisation (pass 0.0 at eval time).
        head_assignment: ``"all"`` (every head in every branch, the paper) or ``"split"``.
        return_lse: also return lse (batch, nheads, seqlen_q) float32 (not differentiable).
        impl: ``"auto"``, ``"reference"``, ``"torch"`` or ``"triton"``.
        group: a ``torch.distributed`` process group (or 1-D DeviceMesh) for sequence-parallel
            execution: each rank passes its contiguous shard (dim 1) of q, k, v and
            key_padding_mask and gets its shard of the single-device result, with exact gradients
            (see ``distributed/sequence_parallel.py``; seqlen_q == seqlen_k, no dropout there).

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, or ``(out, lse)``. Under
        ``torch.autocast`` q, k, v are first cast to the autocast dtype, as SDPA does
        (docs/autocast.md). Second-order gradients: impl="reference" only; the others raise.
        A query with no key (all masked) gets out = 0 and lse = -inf.
    """
    q, k, v, amp_device = autocast_inputs(q, k, v)
    if amp_device is not None:  # the SDPA rule (docs/autocast.md): cast once, run with autocast off
        with torch.autocast(amp_device, enabled=False):
            return dilated_attention(
                q, k, v, segment_lengths, dilation_rates, causal=causal, softmax_scale=softmax_scale,
                key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                head_assignment=head_assignment, return_lse=return_lse, impl=impl, group=group,
            )
    check_qkv(q, k, v, "dilated_attention")
    seg, dil = normalize_branches(segment_lengths, dilation_rates)
    check_head_assignment(head_assignment)
    check_key_padding_mask(key_padding_mask, q, k)
    p = check_dropout(dropout_p)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    causal = check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_impl(impl)
    if group is not None:
        from .distributed import sequence_parallel

        return sequence_parallel.dilated_attention_sp(
            q, k, v, seg, dil, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            dropout_p=p, head_assignment=head_assignment, return_lse=return_lse, impl=impl,
            group=group,
        )
    if q.shape[0] == 0 or q.shape[1] == 0:
        # nothing to attend (batch 0 or no query): an empty output, still connected to q, k, v
        # so that backward gives (empty or zero) gradients, as SDPA does
        out = q * 0 + (k.sum() + v.sum()) * 0
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        return (out, lse) if return_lse else out
    if q.shape[3] == 0:
        # headdim 0: every logit is 0, so out is empty and lse = log(number of keys); run the
        # chosen impl on one zero feature (the same multiplicities) and drop it
        zq, zk = q.new_zeros(*q.shape[:3], 1), k.new_zeros(*k.shape[:3], 1)
        _, lse = dilated_attention(
            zq, zk, zk, seg, dil, causal=causal, softmax_scale=1.0, key_padding_mask=key_padding_mask,
            head_assignment=head_assignment, return_lse=True, impl=impl,
        )
        out = q * 0 + (k.sum() + v.sum()) * 0
        return (out, lse) if return_lse else out
    chosen = pick_impl(
        impl, q, k, p, causal=causal, segment_lengths=seg, dilation_rates=dil,
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    )
    if chosen != "reference":
        from .decode import decode_applies, dilated_attention_with_kvcache

        if decode_applies(q, k, v, key_padding_mask, p):  # a few rows against a longer cache
            out, lse = dilated_attention_with_kvcache(
                q, k, v, k.shape[1], seg, dil, causal=causal, softmax_scale=scale,
                head_assignment=head_assignment, return_lse=True, impl=chosen,
            )  # fmt: skip
            return (out, lse) if return_lse else out
    if chosen == "reference":
        from .reference import dilated_attention_reference

        out, lse = dilated_attention_reference(
            q, k, v, seg, dil, causal=causal, softmax_scale=scale,
            key_padding_mask=key_padding_mask, dropout_p=p, head_assignment=head_assignment,
        )
        lse = lse.to(torch.float32)
    elif chosen == "torch":
        from .kernels.torch_dilated import dilated_attention_torch

        out, lse = dilated_attention_torch(
            q, k, v, seg, dil, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            dropout_p=p, head_assignment=head_assignment,
        )
    else:
        from .kernels.triton_ops import dilated_attention_triton

        out, lse = dilated_attention_triton(
            q, k, v, seg, dil, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            head_assignment=head_assignment,
        )
    return (out, lse) if return_lse else out
