"""``DilatedAttention`` and ``MultiheadDilatedAttention``: thin ``nn.Module`` shells over the functions.

``DilatedAttention`` owns no parameters: it stores the branch configuration and calls
:func:`dilated_attention.dilated_attention`. ``MultiheadDilatedAttention`` adds the q/k/v/out
projections, MAGNETO's sub-LayerNorm before the output projection and its gamma initialisation,
takes ``nn.MultiheadAttention.forward``'s arguments in its order and returns ``(out, None)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .api import dilated_attention
from .branches import normalize_branches
from .checks import check_real, resolve_scale
from .decode import dilated_attention_with_kvcache
from .kernels.select import check_impl


def _check_ordering(ordering, grid):
    if ordering not in (None, "none", "hilbert"):
        raise ValueError(f"ordering must be None, 'none' or 'hilbert', got {ordering!r}")
    if ordering == "hilbert":
        if grid is None or len(grid) != 2 or min(int(g) for g in grid) < 1:
            raise ValueError(
                f"ordering='hilbert' needs grid=(height, width) with positive sizes, got grid={grid!r}"
            )
        return "hilbert", (int(grid[0]), int(grid[1]))
    return None, None


def magneto_init_(
    q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, out_proj: nn.Linear, gamma: float
) -> None:
    """MAGNETO (Wang et al. 2022) attention init: xavier_normal_ with gain 1 for the query and key
    projections and gain ``gamma`` for the value and output projections; biases zero."""
    nn.init.xavier_normal_(q_proj.weight)
    nn.init.xavier_normal_(k_proj.weight)
    nn.init.xavier_normal_(v_proj.weight, gain=gamma)
    nn.init.xavier_normal_(out_proj.weight, gain=gamma)
    for lin in (q_proj, k_proj, v_proj, out_proj):
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)


# the decode implementation of each module impl ("reference" decodes on the torch path)
_DECODE_IMPL = {"auto": "auto", "triton": "triton", "torch": "torch", "reference": "torch"}


def _raise_everywhere(group, err, tensors):
    """A packed call's argument error on this rank of a sequence-parallel module: raised on
    every rank (the others would wait in dilated_attention_varlen's cross-rank check)."""
    from .distributed.sequence_parallel import sp_varlen_arg_error

    sp_varlen_arg_error(group, err, tensors, "dilated_attention_varlen")


class DilatedAttention(nn.Module):
    """Dilated attention over (batch, seqlen, nheads, headdim) tensors.

    Args:
        segment_lengths, dilation_rates: one (w_b, r_b) per branch (docs/spec.md, "Definition").
        softmax_scale: default headdim ** -0.5.
        attention_dropout: dropout on attention probabilities, applied in training mode only.
        head_assignment: "all" (paper) or "split".
        impl: "auto", "reference", "torch" or "triton".
        process_group: sequence-parallel group; each rank passes its contiguous shard.
        ordering: None or "hilbert" (with ``grid=(height, width)``): tokens of a flattened 2-D
            grid are reordered along a Hilbert curve before attention and restored after.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        softmax_scale: float | None = None,
        attention_dropout: float = 0.0,
        head_assignment: str = "all",
        impl: str = "auto",
        process_group=None,
        ordering: str | None = None,
        grid: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.segment_lengths, self.dilation_rates = normalize_branches(segment_lengths, dilation_rates)
        if head_assignment not in ("all", "split"):
            raise ValueError(f"head_assignment must be 'all' or 'split', got {head_assignment!r}")
        check_impl(impl)
        if not 0.0 <= check_real("attention_dropout", attention_dropout) < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout!r}")
        if softmax_scale is not None:  # a bad scale fails here, not at the first forward
            resolve_scale(softmax_scale, 1)
        self.softmax_scale = softmax_scale
        self.attention_dropout = float(attention_dropout)
        self.head_assignment = head_assignment
        self.impl = impl
        self.process_group = process_group
        self.ordering, self.grid = _check_ordering(ordering, grid)

    def extra_repr(self) -> str:
        s = (
            f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}, "
            f"head_assignment={self.head_assignment!r}, impl={self.impl!r}"
        )
        if self.ordering:
            s += f", ordering={self.ordering!r}, grid={self.grid}"
        return s

    @property
    def period(self) -> int:
        """The least common multiple of the segment lengths: a key window that starts at a
        multiple of it keeps every segment's absolute alignment (what a chunked prefill over a
        KV cache needs)."""
        return math.lcm(*self.segment_lengths)

    def decode(self, query, k_cache, v_cache, cache_seqlens, is_causal: bool = True) -> torch.Tensor:
        """``query`` (B, Tq, H, D), the newest ``Tq`` positions, against the first
        ``cache_seqlens[b]`` slots of a KV cache (B, S, Hkv, D): this module's branches, scale,
        head assignment and impl through :func:`dilated_attention_with_kvcache` (no host
        synchronisation; ``impl="reference"`` decodes on the torch path, which is exact and reads
        the same keys)."""
        return dilated_attention_with_kvcache(
            query, k_cache, v_cache, cache_seqlens, self.segment_lengths, self.dilation_rates,
            causal=is_causal, softmax_scale=self.softmax_scale,
            head_assignment=self.head_assignment, impl=_DECODE_IMPL[self.impl],
        )  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """query (B, Nq, H, D), key/value (B, Nk, Hkv, D) -> (B, Nq, H, D).

        Packed documents (varlen, as ``flash_attn_varlen_func``): with ``cu_seqlens`` (int32
        (docs + 1,) offsets, shared by query and key/value) query is (total, H, D) and key/value
        (total, Hkv, D), or the same with a leading batch dimension of 1 (one packed row); the
        output has query's shape. Each document is its own sequence
        (:func:`dilated_attention.dilated_attention_varlen`). ``max_seqlen``: the longest
        document (computed from ``cu_seqlens`` when None, one host sync). With
        ``process_group``, query/key/value are this rank's contiguous shard of ONE packed stream
        and ``cu_seqlens`` its global offsets (the same on every rank; documents may cross rank
        boundaries): ``dilated_attention_varlen(..., group=process_group)``.
        """
        if cu_seqlens is not None:
            return self._attend_packed(query, key, value, is_causal, key_padding_mask, cu_seqlens, max_seqlen)
        if max_seqlen is not None:
            raise ValueError("max_seqlen is given without cu_seqlens; pass both for packed documents")
        if self.ordering == "hilbert":
            from .ordering import hilbert_attention

            return hilbert_attention(
                self._attend, self.grid, query, key, value, is_causal, key_padding_mask, self.process_group
            )
        return self._attend(query, key, value, is_causal, key_padding_mask)

    def _attend_packed(self, query, key, value, is_causal, key_padding_mask, cu_seqlens, max_seqlen):
        from .varlen import dilated_attention_varlen

        try:
            query, key, value, squeeze, max_seqlen = self._check_packed(
                query, key, value, key_padding_mask, cu_seqlens, max_seqlen
            )
        except (TypeError, ValueError) as e:
            if self.process_group is None:
                raise
            _raise_everywhere(self.process_group, e, (query, key, value, cu_seqlens))
        out = dilated_attention_varlen(
            query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, self.segment_lengths,
            self.dilation_rates, causal=is_causal, softmax_scale=self.softmax_scale,
            dropout_p=self.attention_dropout if self.training else 0.0,
            head_assignment=self.head_assignment, impl=self.impl, group=self.process_group,
        )  # fmt: skip
        return out[None] if squeeze else out

    def _check_packed(self, query, key, value, key_padding_mask, cu_seqlens, max_seqlen):
        """The module's own checks of a packed call: (query, key, value as (total, H, D),
        whether they came as one packed row, max_seqlen)."""
        if key_padding_mask is not None:
            raise ValueError(
                "key_padding_mask with cu_seqlens: packed documents have no padding; leave the "
                "padding out of the packed tensor (or make it a document of its own)"
            )
        if self.ordering is not None:
            raise ValueError(
                "cu_seqlens (packed documents) is not supported with ordering on this module; use "
                "a module without it"
            )
        squeeze = isinstance(query, torch.Tensor) and query.dim() == 4
        if squeeze:
            for name, t in (("query", query), ("key", key), ("value", value)):
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != 1:
                    raise ValueError(
                        f"with cu_seqlens, {name} must be (total, heads, headdim) or one packed row "
                        f"(1, total, heads, headdim), got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                    )
            query, key, value = query[0], key[0], value[0]
        if (max_seqlen is None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
                and cu_seqlens.numel() > 1 and cu_seqlens.dtype != torch.bool):  # (bool: varlen's error)
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        elif (max_seqlen is None and isinstance(cu_seqlens, (list, tuple)) and len(cu_seqlens) > 1
              and all(isinstance(c, int) for c in cu_seqlens)):
            # a list of ints (accepted with a process group): its longest document, not 0 (which
            # failed with "max_seqlen_q = 0 ... pass the longest document's length")
            max_seqlen = max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False))
        elif max_seqlen is None:
            max_seqlen = 0
        return query, key, value, squeeze, max_seqlen

    def _attend(self, query, key, value, is_causal, key_padding_mask):
        return dilated_attention(
            query,
            key,
            value,
            self.segment_lengths,
            self.dilation_rates,
            causal=is_causal,
            softmax_scale=self.softmax_scale,
            key_padding_mask=key_padding_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            head_assignment=self.head_assignment,
            impl=self.impl,
            group=self.process_group,
        )


class MultiheadDilatedAttention(nn.Module):
    """Multi-head dilated attention with MAGNETO sub-LayerNorm, a drop-in for
    ``nn.MultiheadAttention``'s self- and cross-attention calls.

    ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` takes the arguments of
    ``nn.MultiheadAttention.forward`` in the same order and with the same meaning, and returns
    ``(out, None)``: no attention weights are ever materialised, so ``need_weights=True`` raises.
    Tensors are ``(batch, seqlen, embed_dim)`` with ``batch_first=True`` (the default) and
    ``(seqlen, batch, embed_dim)`` with ``batch_first=False``. ``key_padding_mask`` is a
    ``(batch, seqlen_k)`` bool tensor, True = padding. Causality is ``is_causal=True``; the only
    ``attn_mask`` accepted is the causal one ``nn.Transformer`` passes along with it (True or
    ``-inf`` strictly above the diagonal, nothing else masked), which means the same; any other
    ``attn_mask`` raises. The semantics of the dilated branches are in ``docs/spec.md``.

    ``num_kv_heads`` < ``num_heads`` gives GQA/MQA (k/v projections to num_kv_heads * head_dim).
    ``gamma_init`` is MAGNETO's gain for the value and output projections (xavier_normal_);
    the query and key projections use gain 1.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        num_kv_heads: int | None = None,
        device=None,
        dtype=None,
        impl: str = "auto",
        process_group=None,
        head_assignment: str = "all",
        ordering: str | None = None,
        grid: tuple[int, int] | None = None,
        batch_first: bool = True,
    ):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got {batch_first!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.gamma_init = gamma_init
        self.batch_first = batch_first
        kv_dim = num_kv_heads * self.head_dim
        fk = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **fk)
        self.attention = DilatedAttention(
            segment_lengths,
            dilation_rates,
            attention_dropout=dropout,
            head_assignment=head_assignment,
            impl=impl,
            process_group=process_group,
            ordering=ordering,
            grid=grid,
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **fk) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        magneto_init_(self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.gamma_init)
        if self.norm is not None:
            self.norm.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, batch_first={self.batch_first}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> tuple[torch.Tensor, None]:
        """query (B, Nq, E), key/value (B, Nk, E) -> ((B, Nq, E), None) with ``batch_first``;
        (Nq, B, E), (Nk, B, E) -> ((Nq, B, E), None) without. ``key_padding_mask``: (B, Nk)
        bool, True = padding. Nq < Nk is allowed (queries are the last Nq positions).

        Packed documents (as flash-attn's ``MHA`` with ``cu_seqlens``): query/key/value are
        (total, E), or one packed row (1, total, E) ((total, 1, E) without ``batch_first``), and
        ``cu_seqlens`` the int32 (docs + 1,) document offsets; each document attends only to
        itself, from its own position 0. ``max_seqlen`` as in :class:`DilatedAttention`.
        """
        if cu_seqlens is not None:
            return self._forward_packed(
                query, key, value, key_padding_mask, need_weights, attn_mask, is_causal, cu_seqlens, max_seqlen
            )
        if not isinstance(is_causal, bool):
            raise TypeError(
                f"is_causal must be a bool, got {type(is_causal).__name__}; forward takes "
                "(query, key, value, key_padding_mask, need_weights, attn_mask, "
                "average_attn_weights, is_causal) in nn.MultiheadAttention's order, so pass "
                "is_causal by keyword"
            )
        if need_weights:
            raise ValueError(
                "need_weights=True: dilated attention never materialises the attention weights "
                "(that is what makes long sequences fit); call with need_weights=False, the default"
            )
        if not isinstance(average_attn_weights, bool):
            raise TypeError(f"average_attn_weights must be a bool, got {average_attn_weights!r}")
        layout = "(batch, seqlen, embed_dim)" if self.batch_first else "(seqlen, batch, embed_dim)"
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(
                    f"{name} must be 3-D {layout} (batch_first={self.batch_first}), got shape "
                    f"{tuple(t.shape)}; for a single sequence add the batch dimension"
                )
            if t.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"{name}'s last dimension is {t.shape[-1]}, but this module has "
                    f"embed_dim={self.embed_dim}; got {name} shape {tuple(t.shape)} {layout}"
                )
        if not self.batch_first:  # (N, B, E) -> (B, N, E); transposed views, no copy here
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"key and value must have the same batch and length, got key {tuple(key.shape)} "
                f"and value {tuple(value.shape)} {layout}"
            )
        b, nq, _ = query.shape
        nk = key.shape[1]
        if key.shape[0] != b:
            raise ValueError(f"query has batch {b} but key/value have batch {key.shape[0]}; they must match")
        if nq > nk:
            raise ValueError(
                f"query length {nq} > key length {nk}: queries may be shorter than keys (the last "
                "positions, for KV-cache decoding) but not longer"
            )
        # key_padding_mask is checked once, by the functional front door (checks.py)
        if attn_mask is not None:
            if not _is_causal_mask(attn_mask, nq, nk):
                raise ValueError(
                    "attn_mask: dilated attention has a fixed sparsity pattern; only "
                    "key_padding_mask (batch, seqlen_k) and is_causal=True are supported. A causal "
                    "attn_mask (True or -inf strictly above the diagonal) is accepted and means "
                    f"is_causal=True; got a {tuple(attn_mask.shape)} {attn_mask.dtype} mask that is not one"
                )
            is_causal = True
        q = self.q_proj(query).reshape(b, nq, self.num_heads, self.head_dim)  # (B, Nq, H, D)
        k = self.k_proj(key).reshape(b, nk, self.num_kv_heads, self.head_dim)  # (B, Nk, Hkv, D)
        v = self.v_proj(value).reshape(b, nk, self.num_kv_heads, self.head_dim)
        x = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask)
        x = x.reshape(b, nq, self.embed_dim)
        if self.norm is not None:
            x = self.norm(x)
        out = self.out_proj(x)  # (B, Nq, E)
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _forward_packed(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal, cu_seqlens, max_seqlen):
        """MultiheadDilatedAttention.forward over packed documents (see its docstring)."""
        try:
            shapes, flat = self._check_packed(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        except (TypeError, ValueError) as e:
            if self.attention.process_group is None:
                raise
            _raise_everywhere(self.attention.process_group, e, (query, key, value, cu_seqlens))
        n = flat[0].shape[0]
        q = self.q_proj(flat[0]).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(flat[1]).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(flat[2]).view(n, self.num_kv_heads, self.head_dim)
        x = self.attention(q, k, v, is_causal=is_causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        x = x.reshape(n, self.embed_dim)
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x).view(shapes[0]), None

    def _check_packed(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """The module's own checks of a packed call: (input shapes, inputs as (total, E))."""
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        if need_weights or attn_mask is not None or key_padding_mask is not None:
            raise ValueError(
                "with cu_seqlens (packed documents) need_weights, attn_mask and key_padding_mask are "
                "not supported: documents have no padding and is_causal=True is the causal mask"
            )
        shapes = []
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            row_dim = 0 if self.batch_first else 1
            ok = t.dim() == 2 or (t.dim() == 3 and t.shape[row_dim] == 1)
            if not ok or t.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"with cu_seqlens, {name} must be (total, embed_dim={self.embed_dim}) or one packed "
                    f"row ({'(1, total, E)' if self.batch_first else '(total, 1, E)'}), got {tuple(t.shape)}"
                )
            shapes.append(t.shape)
        if key.shape != value.shape or query.dim() != key.dim():
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} must agree")
        flat = [t.reshape(-1, self.embed_dim) for t in (query, key, value)]
        if flat[0].shape[0] != flat[1].shape[0]:
            raise ValueError(
                f"with cu_seqlens (one set of offsets for queries and keys) query and key need the same "
                f"number of tokens, got {flat[0].shape[0]} and {flat[1].shape[0]}"
            )
        return shapes, flat


def _is_causal_mask(mask, nq: int, nk: int) -> bool:
    """True iff ``mask`` is the (nq, nk) causal mask of ``nn.MultiheadAttention``: bool with True
    (masked) exactly strictly above the bottom-right-aligned diagonal, or float with -inf
    exactly there and 0 elsewhere."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (nq, nk):
        return False
    future = torch.ones(nq, nk, dtype=torch.bool, device=mask.device).triu(nk - nq + 1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, future))
    if mask.is_floating_point():
        return bool(torch.equal(mask.isneginf(), future) and (mask[~future] == 0).all())
    return False
