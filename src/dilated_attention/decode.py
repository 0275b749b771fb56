"""KV-cache decoding: a few new query rows against a static cache, at a cost independent of its length.

:func:`dilated_attention_with_kvcache` is the decode entry point (``flash_attn_with_kvcache``
style): the cache buffers have a fixed shape, ``cache_seqlens`` (an int32 device tensor, one
entry per batch) says how many positions are valid, and query row t of batch b is position
``cache_seqlens[b] - seqlen_q + t`` (bottom-right aligned, causal within the new rows when
``causal``). Per branch a row reads only the keys of its own segment with its residue, at most
``sum_b ceil(w_b / r_b)`` keys whatever the cache length (``docs/spec.md`` gives the math).

No host synchronisation and no planning that depends on tensor values: the launch grid depends
only on the branch configuration, so one call can be captured in a CUDA graph and replayed as the
cache grows (``cache_seqlens`` updated in place), and it runs under
``torch.compile(mode="reduce-overhead")``: the work is the custom op ``dilated_attention::decode``
with a fake implementation.

Cache slots: position p lives in slot ``p % cache_len``. A cache at least as long as the
sequence is the plain cache; a shorter one is a rolling cache, exact as long as it holds the
last ``max(w) + seqlen_q - 1`` positions (no branch reads a key older than its own segment
start). The caller keeps ``cache_seqlens`` within its cache (it is never read on the host).

Implementations: ``kernels/triton_decode.py`` (GPU; on the CPU under ``TRITON_INTERPRET=1``) and
``kernels/torch_decode.py`` (any device, float64). Inference only: no autograd.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .branches import branch_head_ranges, normalize_branches
from .checks import check_bool, check_head_assignment, resolve_scale
from .kernels import torch_decode

MAX_DECODE_ROWS = 64  # the kernel walks the query rows one by one: meant for a few new tokens
DECODE_IMPLS = ("auto", "torch", "triton")


_INTERPRET: bool | None = None


@torch.compiler.assume_constant_result
def _interpret() -> bool:
    """Triton's interpreter mode, decided once per process at the first decode call (not at
    import: test modules set TRITON_INTERPRET before their first call)."""
    global _INTERPRET
    if _INTERPRET is None:
        _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return _INTERPRET


def _triton_decode():
    # imported at the first decode call, not with the package: ``triton.jit`` picks the
    # interpreter or the compiler when the kernels are defined, and test modules set
    # TRITON_INTERPRET after the package may have been imported by another module
    from .kernels import triton_decode

    return triton_decode


def triton_unavailable_reason(q: torch.Tensor) -> str | None:
    """Why the Triton decode kernel cannot run on inputs like ``q`` (None if it can)."""
    return _triton_decode().unavailable_reason(q, _interpret())


def _branch_rows(nheads: int, seg, dil, head_assignment: str) -> list[int]:
    """Flat (w, r, head start, head stop) of the branches that have at least one head."""
    ranges = branch_head_ranges(nheads, len(seg), head_assignment)
    flat = []
    for w, r, (hs, he) in zip(seg, dil, ranges, strict=True):
        if he > hs:
            flat += [w, r, hs, he]
    return flat


@torch.library.custom_op("dilated_attention::decode", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    branches: list[int],
    causal: bool,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tuple(branches[i : i + 4]) for i in range(0, len(branches), 4)]
    if impl == "triton":
        return _triton_decode().decode_triton(q, k_cache, v_cache, cache_seqlens, rows, causal, scale)
    return torch_decode.decode_torch(q, k_cache, v_cache, cache_seqlens, rows, causal, scale)


@_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, branches, causal, scale, impl):
    b, nq, h, d = q.shape
    return q.new_empty((b, nq, h, d)), q.new_empty((b, h, nq), dtype=torch.float32)


def _check(q, k_cache, v_cache, cache_seqlens) -> None:
    name = "dilated_attention_with_kvcache"
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {n} must be a 4-D tensor (batch, seqlen, nheads, headdim), got {shape}")
    if not q.is_floating_point() or not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"{name}: q, k_cache, v_cache must share a floating dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device == cache_seqlens.device):
        raise ValueError(
            f"{name}: q, k_cache, v_cache, cache_seqlens must be on one device, got {q.device}, "
            f"{k_cache.device}, {v_cache.device}, {cache_seqlens.device}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    b, nq, h, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(
            f"{name}: q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} must agree in batch and headdim"
        )
    if h % k_cache.shape[2] != 0:
        raise ValueError(
            f"{name}: nheads ({h}) must be a multiple of the cache's nheads_kv ({k_cache.shape[2]})"
        )
    if not 1 <= nq <= MAX_DECODE_ROWS:
        raise ValueError(
            f"{name}: seqlen_q = {nq}; the decode path takes 1..{MAX_DECODE_ROWS} new rows, "
            "prefill longer chunks with dilated_attention(q, k, v, ...)"
        )
    if cache_seqlens.shape != (b,) or cache_seqlens.dtype != torch.int32:
        raise ValueError(
            f"{name}: cache_seqlens must be an int32 tensor of shape (batch,) = ({b},), got "
            f"{cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}"
        )


def dilated_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    head_assignment: str = "all",
    return_lse: bool = False,
    impl: str = "auto",
):
    """Dilated attention of a few new query rows against a KV cache (inference only).

    Args:
        q: (batch, seqlen_q, nheads, headdim), ``1 <= seqlen_q <= 64``.
        k_cache, v_cache: (batch, cache_len, nheads_kv, headdim), ``nheads % nheads_kv == 0``;
            the new rows' own keys/values must already be written. Position p is slot
            ``p % cache_len``.
        cache_seqlens: (batch,) int32 device tensor (or an int for every batch entry): valid
            positions per batch entry, the new rows included. Query row t of batch b is
            position ``cache_seqlens[b] - seqlen_q + t``.
        segment_lengths, dilation_rates, causal, softmax_scale, head_assignment: as in
            :func:`dilated_attention.dilated_attention`.
        return_lse: also return lse (batch, nheads, seqlen_q) float32.
        impl: ``"auto"`` (the Triton kernel on CUDA where it can run, else the torch path),
            ``"triton"`` or ``"torch"``.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, or ``(out, lse)``. A row that no
        branch selects (no head of its residue) gets out = 0 and lse = -inf.
    """
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    _check(q, k_cache, v_cache, cache_seqlens)
    seg, dil = normalize_branches(segment_lengths, dilation_rates)
    check_head_assignment(head_assignment)
    causal = check_bool("causal", causal)
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        raise ValueError(
            "dilated_attention_with_kvcache is inference only (no autograd); call it under "
            "torch.no_grad() or use dilated_attention for training"
        )
    scale = resolve_scale(softmax_scale, q.shape[-1])
    reason = triton_unavailable_reason(q)
    if impl == "triton" and reason is not None:
        raise ValueError(f"impl='triton' cannot run here: {reason}")
    # auto: the kernel on CUDA; never the Triton interpreter (TRITON_INTERPRET=1), which is for tests
    auto_triton = impl == "auto" and reason is None and q.is_cuda
    chosen = "triton" if impl == "triton" or auto_triton else "torch"
    if chosen == "triton":  # the kernel reads rows with unit stride in the last dim
        q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    branches = _branch_rows(q.shape[2], seg, dil, head_assignment)
    out, lse = _decode_op(q, k_cache, v_cache, cache_seqlens, branches, bool(causal), scale, chosen)
    return (out, lse) if return_lse else out


def decode_applies(q, k, v, key_padding_mask, dropout_p: float) -> bool:
    """Whether ``dilated_attention(q, k, v, ...)`` can take the decode path: a few query rows
    against more keys, no padding mask, no dropout, no gradient needed."""
    nq, nk = q.shape[1], k.shape[1]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # nk > nq first: for self-attention under torch.compile(dynamic=True) it is decided without a
    # guard (same symbol), so nq's size never guards (no recompile at MAX_DECODE_ROWS)
    return nk > nq and nq <= MAX_DECODE_ROWS and key_padding_mask is None and dropout_p == 0 and not needs_grad
