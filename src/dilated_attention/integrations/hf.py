"""Dilated attention as an attention implementation of Hugging Face ``transformers`` (>= 4.48).

    from dilated_attention.integrations.hf import register_dilated_attention
    register_dilated_attention([2048, 4096, 8192], [1, 2, 4])         # name "dilated"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="dilated")

``transformers`` calls the registered function with (batch, heads, seqlen, headdim) tensors; it is
transposed to this library's (batch, seqlen, heads, headdim) layout and passed to
:func:`dilated_attention.dilated_attention`. KV-cache decoding works (fewer queries than keys are
bottom-right aligned) and so does GQA (kv heads are never repeated): with ``transformers``'
cache the function receives the new query rows and the whole cached k, v, and a step of at most
64 rows without padding goes to the decode path (``dilated_attention_with_kvcache``), which
reads per branch only the keys of the query's segment and residue, whatever the cache length.

Masks: the mask function registered next to the attention (when ``transformers`` has
``AttentionMaskInterface``) is the flash-attention one: ``None`` without padding, else a 2-D
(batch, seqlen_k) bool mask, True = keep, which becomes ``key_padding_mask``. A 4-D mask (older
versions) is reduced to the keys that its last query row masks: exact for causal padding masks,
not for arbitrary 4-D masks. Causality is the attention module's ``is_causal``. Positions in
``segment_lengths`` refer to key-cache positions, so a left-padded batch shifts segments; pad on
the right for exactness. Sliding windows and softcapping are not supported (clear error).

Needs the optional extra: ``pip install 'dilated-attention[hf]'``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..api import dilated_attention
from ..branches import normalize_branches
from ..kernels.select import check_impl


def _key_padding_mask(attention_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor):
    """transformers' mask -> (B, Nk) bool, True = padding (or None)."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 4:  # (B, 1 or H, Nq, Nk): the last query row sees every non-padding key
        m = m[:, 0, -1, :]
        keep = m if m.dtype == torch.bool else m == 0
    elif m.dim() == 2:
        keep = m.bool()
    else:
        raise ValueError(f"dilated attention: unsupported attention_mask shape {tuple(m.shape)}")
    nk = k.shape[2]
    keep = keep[:, -nk:]
    if keep.shape[1] != nk:
        raise ValueError(f"dilated attention: mask covers {keep.shape[1]} keys, key has {nk}")
    return None if bool(keep.all()) else ~keep


def make_attention_function(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], impl: str = "auto"
):
    """The ``transformers`` attention function for one branch configuration."""
    seg, dil = normalize_branches(segment_lengths, dilation_rates)
    check_impl(impl)

    def dilated_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query (B, H, Nq, D), key/value (B, Hkv, Nk, D) -> ((B, Nq, H, D), None)."""
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise ValueError("dilated attention does not support sliding_window or softcap")
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        kpm = _key_padding_mask(attention_mask, query, key)
        q = query.transpose(1, 2)  # (B, Nq, H, D)
        k = key.transpose(1, 2)  # (B, Nk, Hkv, D)
        v = value.transpose(1, 2)
        out = dilated_attention(
            q, k, v, seg, dil, causal=bool(causal), softmax_scale=scaling, key_padding_mask=kpm,
            dropout_p=dropout if module.training else 0.0, impl=impl,
        )  # fmt: skip
        return out, None

    dilated_attention_forward.segment_lengths = seg
    dilated_attention_forward.dilation_rates = dil
    return dilated_attention_forward


def register_dilated_attention(
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    name: str = "dilated",
    impl: str = "auto",
):
    """Register dilated attention under ``name`` in ``transformers.AttentionInterface``.

    Afterwards ``attn_implementation=name`` (in ``from_pretrained``/``from_config`` or
    ``model.set_attn_implementation``) uses it. Registering a name again replaces its branches.
    Returns the registered function.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(
            "register_dilated_attention needs transformers >= 4.48 (AttentionInterface): "
            f"pip install 'dilated-attention[hf]' ({e})"
        ) from e
    fn = make_attention_function(segment_lengths, dilation_rates, impl)
    AttentionInterface.register(name, fn)
    try:  # transformers >= 4.53 builds masks per implementation: ask for a 2-D padding mask
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask

        AttentionMaskInterface.register(name, flash_attention_mask)
    except ImportError:
        pass
    return fn
