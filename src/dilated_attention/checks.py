"""Input checks shared by every public entry point (a leaf module: imports only torch and
``branches.py``).

Each check raises a ``TypeError`` / ``ValueError`` that names the bad value and the fix. The
functional API (``api.py``), ring attention and sequence-parallel attention all check their
inputs here, so one input gets one error message whichever entry point it reaches. The tensor
contract is the one of docs/spec.md ("Tensor contract").
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .branches import normalize_branches

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str = "attention",
              kv_names: tuple[str, str] = ("k", "v"), seqlen_rule: bool = True) -> None:  # fmt: skip
    """Shape/dtype/device checks for (B, N, H, D) tensors with GQA: the one copy of these rules
    (``dilated_attention``, ``dilated_attention_with_kvcache`` with ``kv_names=("k_cache",
    "v_cache")`` and no ``seqlen_rule``, ring and sequence-parallel attention). ``seqlen_rule``:
    seqlen_q <= seqlen_k (a KV cache's length is not its valid length, so the decode path checks
    its own)."""
    kn, vn = kv_names
    for n, t in (("q", q), (kn, k), (vn, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: {n} must have 4 dims (batch, seqlen, nheads, headdim), got shape "
                f"{tuple(t.shape)}; for a single sequence add a batch dim with {n}.unsqueeze(0)"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: {n} must be a floating tensor (fp16, bf16, fp32, fp64), got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        # the KV-cache entry takes no autocast (a cast of the whole cache per step): cast there
        hint = ("; keep the cache in q's dtype (LongNetLM.setup_cache under autocast does)"
                if kn == "k_cache" else
                " (or run under torch.autocast, which casts them to its dtype, see docs/autocast.md)")  # fmt: skip
        raise TypeError(
            f"{name}: q, {kn}, {vn} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them{hint}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: {kn} and {vn} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: batch sizes differ: q {q.shape[0]}, {kn} {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{name}: head dims differ: q {q.shape[3]}, {kn} {k.shape[3]}")
    h, hkv = q.shape[2], k.shape[2]
    if hkv == 0:
        raise ValueError(f"{name}: {kn} {tuple(k.shape)} has 0 kv heads; give it nheads_kv >= 1")
    if h % hkv != 0:
        raise ValueError(
            f"{name}: nheads ({h}) must be a multiple of nheads_kv ({hkv}) of {kn} {tuple(k.shape)} "
            "for GQA/MQA; query head h reads kv head h // (nheads // nheads_kv)"
        )
    if seqlen_rule and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"{name}: seqlen_q ({q.shape[1]}) > seqlen_k ({k.shape[1]}); queries may be shorter "
            "than keys (bottom-right aligned, for KV-cache decoding) but not longer"
        )


def check_bool(name: str, value) -> bool:
    """``value`` must be a real bool: ``causal="no"`` would otherwise mean True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")
    return value


def check_real(name: str, value) -> float:
    """``value`` must be a real number (not a bool, not a string); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def resolve_scale(softmax_scale: float | None, headdim: int) -> float:
    """``softmax_scale`` as a finite float; ``None`` means ``headdim ** -0.5``."""
    if softmax_scale is None:
        # headdim 0: every logit q.k is 0 whatever the scale (SDPA accepts it too); use 1
        return headdim**-0.5 if headdim > 0 else 1.0
    scale = check_real("softmax_scale", softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return scale


def check_key_padding_mask(key_padding_mask, q: torch.Tensor, k: torch.Tensor) -> None:
    """``None`` or a bool (batch, seqlen_k) tensor on k's device, True = padding."""
    if key_padding_mask is None:
        return
    want = (k.shape[0], k.shape[1])
    if not isinstance(key_padding_mask, torch.Tensor):
        raise TypeError(
            f"key_padding_mask must be a bool tensor of shape (batch, seqlen_k) = {want} with True = "
            f"padding, got {type(key_padding_mask).__name__} (MultiheadDilatedAttention.forward takes "
            "nn.MultiheadAttention's order, key_padding_mask 4th: pass is_causal by keyword)"
        )
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(
            f"key_padding_mask must be a bool tensor (torch.bool, True = padding, as nn.MultiheadAttention), got "
            f"{key_padding_mask.dtype}; for a float mask with -inf at padding use mask.isinf(), for "
            "1 = padding use mask.bool()"
        )
    if tuple(key_padding_mask.shape) != want:
        raise ValueError(
            f"key_padding_mask must have shape (batch, seqlen_k) = {want}, got {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.device != k.device:
        raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, k on {k.device}; move it to k's device")


def check_dropout(dropout_p) -> float:
    """``dropout_p`` as a float in [0, 1)."""
    p = check_real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def check_head_assignment(head_assignment) -> str:
    """``"all"`` (every head in every branch, the paper) or ``"split"``."""
    if head_assignment not in ("all", "split"):
        raise ValueError(f"head_assignment must be 'all' or 'split', got {head_assignment!r}")
    return head_assignment



class Call(NamedTuple):
    """One validated call of :func:`dilated_attention.dilated_attention` (built by
    :func:`describe_call`): everything below the front door reads its options from here and
    checks nothing again."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    causal: bool
    scale: float
    dropout_p: float
    head_assignment: str
    return_lse: bool
    impl: str


_IMPLS = ("auto", "reference", "torch", "triton")

# the branch lists, validated once per distinct (lists of exact ints) value
_BRANCHES: dict = {}


def branch_lists(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``normalize_branches(segment_lengths, dilation_rates)``, computed once per distinct value
    of lists (or tuples) of exact ints: the one branch check of every entry point. Not under
    ``torch.compile``: Dynamo guarded on the cache's contents (empty at a process's first call),
    so the second call of a compiled model recompiled; the lists are constants of the graph."""
    if torch.compiler.is_compiling():
        return normalize_branches(segment_lengths, dilation_rates)
    if type(segment_lengths) in (list, tuple) and type(dilation_rates) in (list, tuple):
        key = (tuple(segment_lengths), tuple(dilation_rates))
        hit = _BRANCHES.get(key)
        # only lists of exact ints are cached (a bool or numpy int equal to a cached int misses)
        if hit is not None and all(type(x) is int for x in key[0]) and all(type(x) is int for x in key[1]):
            return hit
        res = normalize_branches(segment_lengths, dilation_rates)
        if len(_BRANCHES) >= 1024:
            _BRANCHES.clear()
        _BRANCHES[key] = res
        return res
    return normalize_branches(segment_lengths, dilation_rates)


def describe_call(
    q, k, v, segment_lengths, dilation_rates, *, causal, softmax_scale, key_padding_mask,
    dropout_p, head_assignment, return_lse, impl, name: str = "dilated_attention",
) -> Call:
    """Check every argument of a ``dilated_attention`` call once and describe it (:class:`Call`).

    Raises ``TypeError`` / ``ValueError`` naming the bad value and the fix.
    """
    check_qkv(q, k, v, name)
    seg, dil = branch_lists(segment_lengths, dilation_rates)
    check_head_assignment(head_assignment)
    check_key_padding_mask(key_padding_mask, q, k)
    p = check_dropout(dropout_p) if type(dropout_p) is not float or dropout_p != 0.0 else 0.0
    scale = resolve_scale(softmax_scale, q.shape[-1])
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    if impl not in _IMPLS:  # the names of kernels/select.py's IMPLS (a leaf does not import it)
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    return Call(seg, dil, causal, scale, p, head_assignment, return_lse, impl)


def check_cu_seqlens_meta(cu_q, cu_k, device, name: str = "dilated_attention_varlen",
                          names: tuple[str, str] = ("cu_seqlens_q", "cu_seqlens_k")) -> None:
    """Shape/dtype/device checks of packed-document offsets (no host synchronisation); errors
    name the offsets (``names``) and are prefixed by the entry point ``name``."""
    for n, t in ((names[0], cu_q), (names[1], cu_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name}: {n} must be an integer tensor of document offsets (docs + 1,), got "
                f"{type(t).__name__}; e.g. torch.tensor([0, 5, 12], dtype=torch.int32)"
            )
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name}: {n} must be an integer tensor (int32 as flash-attn), got {t.dtype}")
        if t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(
                f"{name}: {n} must be 1-D with docs + 1 >= 1 entries (0, then each document's end "
                f"offset), got shape {tuple(t.shape)}"
            )
        if t.device != device and t.device.type != "cpu":
            raise ValueError(f"{name}: {n} is on {t.device}, q on {device}; pass it on q's device or the CPU")
    if cu_q is not cu_k and cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(
            f"{name}: cu_seqlens_q has {cu_q.shape[0] - 1} documents and cu_seqlens_k "
            f"{cu_k.shape[0] - 1}; each document needs both its query and its key offsets"
        )


def check_cu_seqlens_values(
    cu_q: list[int], cu_k: list[int], total_q: int, total_k: int, max_q: int, max_k: int,
    name: str = "dilated_attention_varlen", totals: tuple[str, str] | None = None,
    names: tuple[str, str] = ("cu_seqlens_q", "cu_seqlens_k"),
) -> None:
    """Value checks of host offsets: start at 0, non-decreasing, end at the totals, no document
    with more queries than keys, ``max_seqlen`` at least every document's length (``None``: not
    checked). ``name``: the entry point, ``names``: the offsets' argument names, ``totals``: what
    ``total_q``/``total_k`` are (default: dim 0 of q, of k and v), all for the messages."""
    for n, cu, total in ((names[0], cu_q, total_q), (names[1], cu_k, total_k)):
        if cu[0] != 0:
            raise ValueError(f"{name}: {n} must start at 0, got {cu[0]} ({n} = {cu})")
        for i in range(len(cu) - 1):
            if cu[i + 1] < cu[i]:
                raise ValueError(
                    f"{name}: {n} must be non-decreasing (document offsets), but entry {i + 1} "
                    f"({cu[i + 1]}) < entry {i} ({cu[i]})"
                )
        if cu[-1] != total:
            what = (totals or ("dim 0 of q", "dim 0 of k and v"))[0 if n == names[0] else 1]
            raise ValueError(
                f"{name}: the last entry of {n} ({cu[-1]}) must equal the number of packed tokens "
                f"({total}, {what})"
            )
    for i in range(len(cu_q) - 1):
        nq, nk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if nq > nk:
            raise ValueError(
                f"{name}: document {i} has {nq} queries but {nk} keys (cu_seqlens_q, "
                "cu_seqlens_k); queries may be fewer than keys (bottom-right aligned), not more"
            )
        for n, length, mx in (("max_seqlen_q", nq, max_q), ("max_seqlen_k", nk, max_k)):
            if mx is not None and length > mx:
                raise ValueError(
                    f"{name}: {n} = {mx} but document {i} has {length} "
                    f"{'queries' if n.endswith('q') else 'keys'}; pass the longest document's length"
                )
