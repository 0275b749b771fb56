"""Exact merge of partial attentions by their log-sum-exp, shared by dilated branches and ring steps.

Two partial results over disjoint key sets (or the same key counted twice: LongNet's branches)
combine as ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b
- lse)``. Both weights are <= 1, so this is stable; a side with ``lse = -inf`` (no keys) gets weight
0, and when both are -inf the result is out = 0, lse = -inf (never NaN).
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype for inputs of ``dtype``: float64 for float64, else float32.

    The one rule every implementation follows for partial outputs, LSEs, merged results and
    gradient accumulators, so that float64 calls are exact to float64 rounding (the reference
    tests rely on it) and every other dtype accumulates in float32.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions. ``lse_*`` broadcast against ``out_*`` without the last dim.

    out_a, out_b: (..., D); lse_a, lse_b: (...) float. Returns (out, lse) with out in
    ``out_a``'s dtype promoted with float32 arithmetic.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    # where both sides are empty lse = -inf; use 0 as the shift so that both weights are exp(-inf)=0
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - shift).unsqueeze(-1)
    wb = torch.exp(lse_b - shift).unsqueeze(-1)
    out = out_a * wa + out_b.to(wa.dtype) * wb
    return out, lse


def merge_partial_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """In-place :func:`merge_partial` into (out_acc, lse_acc), which may be strided views.

    Fewer temporaries than the functional form: the hot path of the torch impl, the ring steps
    and the sequence-parallel merge. ``out_b`` may have a lower precision than ``out_acc`` (a bf16
    partial into an fp32 accumulator): it is read as it is, with no converted copy of it on the
    GPU (on the CPU, torch may still convert it on the fly).
    """
    lse_b = lse_b.to(lse_acc.dtype)
    lse = torch.logaddexp(lse_acc, lse_b)
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out_acc.mul_(torch.exp(lse_acc - shift).unsqueeze(-1))
    out_acc.addcmul_(out_b, torch.exp(lse_b - shift).unsqueeze(-1))  # no out_b-sized temporary
    lse_acc.copy_(lse)
