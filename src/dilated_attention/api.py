"""The functional API: validation, semantics and dispatch to an implementation.

Every public entry point checks its inputs here, once, and hands validated tensors to one
implementation (``reference.py``, ``kernels/torch_dilated.py``, ``kernels/triton_ops.py``,
``distributed/``). Implementations never import each other's internals and an explicitly
requested ``impl`` never silently falls back.

Tensor contract (SPEC section 1):
    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    out: like q; lse: (batch, nheads, seqlen_q) float32, natural log.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from .branches import normalize_branches

IMPLS = ("auto", "reference", "torch", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str = "attention") -> None:
    """Shared shape/dtype/device checks for (B, N, H, D) tensors with GQA."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: {n} must have 4 dims (batch, seqlen, nheads, headdim), got shape "
                f"{tuple(t.shape)}; for a single sequence add a batch dim with {n}.unsqueeze(0)"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: {n} must be a floating tensor (fp16, bf16, fp32, fp64), got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{name}: head dims differ: q {q.shape[3]}, k {k.shape[3]}")
    h, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(
            f"{name}: nheads ({h}) must be a multiple of nheads_kv ({hkv}) for GQA/MQA; "
            "query head h reads kv head h // (nheads // nheads_kv)"
        )
    if q.shape[1] > k.shape[1]:
        raise ValueError(
            f"{name}: seqlen_q ({q.shape[1]}) > seqlen_k ({k.shape[1]}); queries may be shorter "
            "than keys (bottom-right aligned, for KV-cache decoding) but not longer"
        )


def resolve_scale(softmax_scale: float | None, headdim: int) -> float:
    if softmax_scale is None:
        return headdim**-0.5
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return scale


def _check_mask(key_padding_mask, q, k) -> None:
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a bool tensor, got {type(key_padding_mask).__name__}")
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(
            f"key_padding_mask must be torch.bool (True = padding, as nn.MultiheadAttention), got "
            f"{key_padding_mask.dtype}; use mask.bool() if 1 marks padding"
        )
    want = (k.shape[0], k.shape[1])
    if tuple(key_padding_mask.shape) != want:
        raise ValueError(
            f"key_padding_mask must have shape (batch, seqlen_k) = {want}, got {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.device != k.device:
        raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, k on {k.device}; move it to k's device")


def _check_dropout(dropout_p) -> float:
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def triton_unavailable_reason(q: torch.Tensor, k: torch.Tensor | None = None) -> str | None:
    """Why impl='triton' cannot run for these inputs (None if it can)."""
    try:
        from .kernels import triton_ops
    except ImportError as e:  # triton not installed
        return f"the triton package is not importable ({e}); pip install 'dilated-attention[triton]'"
    return triton_ops.unavailable_reason(q, k)


def available_impls(q: torch.Tensor | None = None) -> list[str]:
    """The implementations that can run for inputs like ``q`` (default: a CUDA bf16 probe if any)."""
    out = ["reference", "torch"]
    if q is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        q = torch.empty(1, 1, 1, 64, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    if triton_unavailable_reason(q) is None:
        out.append("triton")
    return out


def _pick_impl(impl: str, q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "triton":
        reason = triton_unavailable_reason(q, k)
        if reason is None and dropout_p > 0:
            reason = "the triton kernel has no dropout; use impl='torch' or 'auto' for dropout_p > 0"
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run here: {reason}")
        return "triton"
    if impl == "auto":
        if dropout_p == 0 and triton_unavailable_reason(q, k) is None:
            return "triton"
        return "torch"
    return impl


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
    """LongNet dilated attention, exactly as SPEC section 2 defines it.

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
        out (batch, seqlen_q, nheads, headdim) in q's dtype, or ``(out, lse)``.
        A query with no key (all masked) gets out = 0 and lse = -inf.
    """
    check_qkv(q, k, v, "dilated_attention")
    seg, dil = normalize_branches(segment_lengths, dilation_rates)
    if head_assignment not in ("all", "split"):
        raise ValueError(f"head_assignment must be 'all' or 'split', got {head_assignment!r}")
    _check_mask(key_padding_mask, q, k)
    p = _check_dropout(dropout_p)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    causal = bool(operator.truth(causal))
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if group is not None:
        from .distributed import sequence_parallel

        return sequence_parallel.dilated_attention_sp(
            q, k, v, seg, dil, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            dropout_p=p, head_assignment=head_assignment, return_lse=return_lse, impl=impl,
            group=group,
        )
    chosen = _pick_impl(impl, q, k, p)
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
