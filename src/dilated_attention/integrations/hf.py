"""Dilated attention as an attention implementation of Hugging Face ``transformers`` (>= 4.48).

    from dilated_attention.integrations.hf import register_dilated_attention
    register_dilated_attention([2048, 4096, 8192], [1, 2, 4])         # name "dilated"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="dilated")

``transformers`` calls the registered function with (batch, heads, seqlen, headdim) tensors; it is
transposed to this library's (batch, seqlen, heads, headdim) layout. GQA works (kv heads are never
repeated). Every row is exact (docs/spec.md, "Hugging Face"): its dilated positions, like its
rotary positions, count from its own first real token, and nothing crosses a document boundary.

Which keys a call sees (the rule, tested against ``sdpa`` in tests/test_hf.py):

- **Cache slots.** The function gets the new query rows and the cache's keys. A static cache
  hands over its whole buffer; the filled slots are the length of the 2-D padding mask, or, with
  no mask, ``position_ids[:, -1] + 1`` (the position of the last query). Unfilled slots are never
  attended, and the queries are the last filled slots (bottom-right aligned).
- **Padding.** The mask registered next to the attention (when ``transformers`` has
  ``AttentionMaskInterface``) is the flash-attention one: ``None`` without padding, else a 2-D
  (batch, filled slots) bool mask, True = real token. A row's real tokens must be contiguous
  (left padding, as ``generate`` pads, or right padding); the row is then the document of its
  real tokens, so a left-padded row's segments start at its first real token. Query rows that
  are padding get zeros. A mask with padding between real tokens raises. A 4-D mask (older
  versions, or one handed to the model as is) is reduced to the keys its last query row keeps,
  after checking that every real query row keeps exactly those (causally, for a causal module).
- **Packing.** ``cu_seq_lens_q``/``cu_seq_lens_k`` with ``max_length_q``/``max_length_k``
  (flash-attention keyword arguments, e.g. ``DataCollatorWithFlattening(return_flash_attn_kwargs=
  True)``) give the documents of the flattened batch; without them, when the queries fill the
  row and there is no padding mask, ``position_ids`` that do not go up by one (restarting at 0,
  ``DataCollatorWithFlattening``'s default) start a new document, as ``transformers``' own masks
  read them.

Rows that are one document starting at slot 0 (no padding, no packing) go to
:func:`dilated_attention.dilated_attention` on the filled slots, so a decode step of at most 64
rows takes the decode path (``dilated_attention_with_kvcache``), which reads per branch only the
keys of the query's segment and residue. A decode step of a left-padded batch (each row one
document ending at the last filled slot) goes to ``dilated_attention_with_kvcache`` with
``cache_leftpad`` = each row's first real slot: the cache is read in place. Every other call runs
:func:`dilated_attention.dilated_attention_varlen` over the rows' documents. Reading the mask and
the positions costs one host synchronisation per call (as ``transformers``' flash-attention path
unpads). Causality is the attention module's ``is_causal``. What a model means by its attention
beyond q, k, v and the padding mask raises a ``ValueError`` rather than being dropped: sliding or
chunked windows (passed as an argument, or held only by the model's mask: a ``sliding_attention``
/ ``chunked_attention`` layer type, ``module.sliding_window``, a config window), softcapping,
attention sinks (``s_aux`` / ``sinks``: GPT-OSS), a relative position bias (``position_bias``:
T5), any other tensor argument, a value head size other than the query's (multi-head latent
attention), a model mask under which some tokens attend later ones and others not (PaliGemma's
bidirectional prefix with ``token_type_ids``, Gemma 3's image blocks: refused by
:func:`padding_mask`, the mask function registered beside the attention), and a 4-D mask other
than causal (or bidirectional) with padding. One dense branch equals the family's own sdpa attention in tests/test_hf.py for
Llama, Qwen3, Mistral, Gemma, Phi3 and GPT-NeoX (a one-off probe of 2026-11-30 also found Qwen2,
Gemma2/3, Phi, Granite, Cohere2, OLMo2, Starcoder2, StableLM, SmolLM3, Qwen2-MoE, PhiMoE and
Llama 4 exact with full-attention layers).

Needs the optional extra: ``pip install 'dilated-attention[hf]'``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..api import dilated_attention
from ..branches import normalize_branches
from ..decode import dilated_attention_with_kvcache
from ..kernels.select import check_impl, decode_shaped
from ..varlen import dilated_attention_varlen

_NAME = "dilated attention (transformers)"


def _keep_mask(attention_mask: torch.Tensor | None, nk: int, causal: bool = True) -> torch.Tensor | None:
    """transformers' mask -> (B, filled slots) bool, True = real token (or None: no padding)."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 4:  # (B, 1 or H, Nq, Nk): the last query row sees every non-padding key
        allowed = m if m.dtype == torch.bool else m == 0
        keep = allowed[:, 0, -1, :]
        # a static cache's 4-D mask also hides the unfilled slots: they end the row
        filled = int(keep.any(0).nonzero().max()) + 1 if bool(keep.any()) else keep.shape[1]
        keep = keep[:, :filled]
        why = _mask_4d_problem(allowed, keep, causal)
        if why is not None:
            raise ValueError(f"{_NAME}: {why}")
    elif m.dim() == 2:
        keep = m.bool()
    else:
        raise ValueError(f"{_NAME}: unsupported attention_mask shape {tuple(m.shape)}")
    if keep.shape[1] > nk:  # older versions: a mask longer than the keys (slice from the right)
        keep = keep[:, -nk:]
    return keep


def _mask_4d_problem(allowed: torch.Tensor, keep: torch.Tensor, causal: bool) -> str | None:
    """Why a 4-D mask (B, 1 or H, Nq, Nk) bool, True = attend, is more than this function reads
    from it (None: it is not): the keys ``keep`` (B, filled) of its last row, causal or not, for
    every real query row (the queries are the last ``Nq`` filled slots; rows of padding queries
    are not compared: transformers may unmask them). A mask that differs, per head, in a window, a
    bidirectional prefix or block, or any custom pattern, would be dropped: an O(B H Nq Nk)
    comparison, the size of the mask itself."""
    b, h, nq, nk = allowed.shape
    filled = keep.shape[1]
    if filled < nq:
        return None  # _row_documents names this
    if h > 1 and not bool((allowed == allowed[:, :1]).all()):
        return "the 4-D attention_mask differs between heads; dilated attention takes one mask for every head"
    slots = torch.arange(filled - nq, filled, device=allowed.device)
    want = keep[:, None, :].expand(b, nq, filled)
    if causal:
        want = want & (torch.arange(filled, device=allowed.device)[None, :] <= slots[:, None])
    real = keep[:, filled - nq:]  # (B, Nq): query rows that are tokens
    got = allowed[:, 0]
    bad = ((got[:, :, :filled] != want).any(-1) | got[:, :, filled:].any(-1)) & real
    if bool(bad.any()):
        bi, qi = (int(x) for x in bad.nonzero()[0])
        kind = "causal" if causal else "bidirectional"
        return (f"the 4-D attention_mask is not a {kind} mask with padding (batch {bi}, query row {qi} "
                "attends other keys: a window, a bidirectional prefix or block, or a custom pattern); "
                "dilated attention would drop it. Pass a 2-D padding mask, or position_ids / "
                "cu_seq_lens for packed documents")  # fmt: skip
    return None


def _mask_function_problem(batch_size: int, q_pos: torch.Tensor, kv_length: int, kv_offset,
                           mask_function) -> str | None:  # fmt: skip
    """Why the model's mask function (``transformers.masking_utils``: causal or bidirectional, and
    the model's overlays) is more than this function computes (None: it is not): some query rows
    attend the next position and others do not (a bidirectional prefix as PaliGemma's
    ``token_type_ids``, bidirectional image blocks as Gemma 3's). ``q_pos``: the queries'
    positions. Evaluated on the superdiagonal only (B x Nq pairs): a bidirectional block of two
    or more tokens sets it, a causal mask never does, a bidirectional one everywhere."""
    k0 = int(kv_offset)
    q = q_pos[(q_pos + 1 >= k0) & (q_pos + 1 < k0 + kv_length)]
    if q.numel() == 0:  # (a decode step: no later key)
        return None
    device = q.device
    bi = torch.arange(batch_size, device=device)
    hi = torch.zeros((), dtype=torch.long, device=device)
    try:
        later = torch.as_tensor(mask_function(bi[:, None], hi, q[None, :], q[None, :] + 1), device=device)
        later = torch.broadcast_to(later, (batch_size, q.numel()))
    except Exception:  # noqa: BLE001 - not index-broadcastable: as transformers, by vmap
        one = torch.vmap(lambda b_, q_: torch.as_tensor(mask_function(b_, hi, q_, q_ + 1)), in_dims=(None, 0))
        later = torch.vmap(one, in_dims=(0, None))(bi, q)
    later = later.bool()
    if bool(later.any()) and not bool(later.all()):
        return ("the model's mask lets some tokens attend later ones and not others (a bidirectional "
                "prefix or blocks: PaliGemma's token_type_ids, Gemma 3's image tokens); dilated "
                "attention is causal or bidirectional over a whole sequence, and would drop it")  # fmt: skip
    return None


def padding_mask(*args, **kwargs):
    """The mask function :func:`register_dilated_attention` registers in transformers'
    ``AttentionMaskInterface``: flash-attention's 2-D padding mask (``masking_utils.
    flash_attention_mask``, called with the same arguments: None without padding), after refusing
    a model mask that this function would drop (:func:`_mask_function_problem`). transformers
    passes keywords: the queries as ``q_length`` / ``q_offset`` (5.x) or ``cache_position``
    (4.53-4.57)."""
    from transformers.masking_utils import flash_attention_mask

    fn = kwargs.get("mask_function")
    cache_position = kwargs.get("cache_position")
    nq = cache_position.numel() if cache_position is not None else int(kwargs.get("q_length", 0))
    # one query row (a decode step) has no later token to attend: nothing to check, no sync
    if fn is not None and not args and nq > 1:
        if cache_position is not None:
            q_pos = cache_position.reshape(-1)
        else:
            dev = kwargs.get("device")
            if dev is None:
                am = kwargs.get("attention_mask")
                dev = am.device if isinstance(am, torch.Tensor) else "cpu"
            q0 = int(kwargs.get("q_offset", 0))
            q_pos = torch.arange(q0, q0 + int(kwargs["q_length"]), device=dev)
        why = _mask_function_problem(int(kwargs["batch_size"]), q_pos, int(kwargs["kv_length"]),
                                     kwargs.get("kv_offset", 0), fn)  # fmt: skip
        if why is not None:
            raise ValueError(f"{_NAME}: {why}")
    return flash_attention_mask(*args, **kwargs)


def _row_documents(keep, position_ids, b: int, nq: int, nk: int):
    """(filled slots, documents): documents is None when every row is one document
    [0, filled), else per row a list of [start, end) slot intervals (host ints)."""
    pos = None
    if position_ids is not None and position_ids.dim() == 2 and position_ids.shape[-1] == nq:
        pos = position_ids.expand(b, -1)
    if keep is not None:
        filled = keep.shape[1]
    else:
        filled = nk
        if pos is not None and nk > nq:  # a static cache without padding: the last query's position
            last = int(pos[:, -1].max()) + 1
            if nq <= last < nk:
                filled = last
    if filled < nq:
        raise ValueError(
            f"{_NAME}: {nq} query rows but only {filled} filled key slots (attention_mask of "
            f"length {filled}); the queries must be the last filled slots"
        )
    docs = None
    if keep is not None and not bool(keep.all()):
        keep_h = keep.cpu()
        docs = []
        for row in range(b):
            real = keep_h[row].nonzero().flatten()
            if real.numel() == 0:
                docs.append([])
                continue
            a, c = int(real[0]), int(real[-1]) + 1
            if c - a != real.numel():
                raise ValueError(
                    f"{_NAME}: attention_mask row {row} has padding between real tokens; a row's "
                    "real tokens must be contiguous (left padding, as generate() pads, or right "
                    "padding) so that its positions and segments are defined"
                )
            docs.append([(a, c)])
    if keep is None and pos is not None and nq == filled and nq > 1:
        # packed rows (no cache content besides the queries): a document starts where the
        # position does not go up by one
        starts = pos[:, 1:] != pos[:, :-1] + 1  # (B, N-1)
        if bool(starts.any()):
            starts_h = starts.cpu()
            docs = []
            for row in range(b):
                cuts = [0, *(int(t) + 1 for t in starts_h[row].nonzero().flatten()), filled]
                docs.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return filled, docs


def _leftpad_decode(docs, q, k, v, filled: int, impl: str, dropout_p: float) -> torch.Tensor | None:
    """Each row's first real slot as an int32 device tensor when the call is a left-padded decode
    step (every row one document ending at the last filled slot, a few query rows against more
    keys, no gradient, no dropout, a fast impl), else None. Query rows before a row's first real
    token are at negative positions for the decode path: out 0, as padding query rows get."""
    nq = q.shape[1]
    if impl == "reference" or dropout_p > 0 or not decode_shaped(nq, filled):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if any(len(r) > 1 or (r and r[0][1] != filled) for r in docs):
        return None
    starts = [r[0][0] if r else filled for r in docs]
    return torch.tensor(starts, dtype=torch.int32).to(q.device, non_blocking=True)


def _varlen_rows(q, k, v, filled: int, docs, seg, dil, **kw) -> torch.Tensor:
    """q (B, Nq, H, D), k/v (B, Nk, Hkv, D) over per-row documents -> (B, Nq, H, D)."""
    b, nq, h, d = q.shape
    nk = k.shape[1]
    q0 = filled - nq  # slot of query row 0
    qidx, kidx, cu_q, cu_k = [], [], [0], [0]
    for row, row_docs in enumerate(docs):
        for a, c in row_docs:
            qa = max(a, q0)
            qidx.extend(range(row * nq + qa - q0, row * nq + c - q0))
            kidx.extend(range(row * nk + a, row * nk + c))
            cu_q.append(cu_q[-1] + max(0, c - qa))
            cu_k.append(cu_k[-1] + c - a)
    dev = q.device
    qi = torch.tensor(qidx, dtype=torch.long, device=dev)
    ki = torch.tensor(kidx, dtype=torch.long, device=dev)
    qf = q.reshape(b * nq, h, d).index_select(0, qi)
    kf = k.reshape(b * nk, k.shape[2], d).index_select(0, ki)
    vf = v.reshape(b * nk, v.shape[2], v.shape[3]).index_select(0, ki)
    lq = [y - x for x, y in zip(cu_q[:-1], cu_q[1:], strict=True)]
    lk = [y - x for x, y in zip(cu_k[:-1], cu_k[1:], strict=True)]
    out = dilated_attention_varlen(
        qf, kf, vf, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
        max(lq, default=0), max(lk, default=0), seg, dil, **kw,
    )  # fmt: skip
    # query rows outside every document (padding) get zeros
    return q.new_zeros(b * nq, h, d).index_copy(0, qi, out).view(b, nq, h, d)


# keyword arguments of the attention call that change what attention computes, which this
# function does not implement: refused when given (they were dropped, a silently other model:
# GPT-OSS's sinks, T5's relative position bias)
_REFUSED_KWARGS = ("s_aux", "sinks", "position_bias", "head_mask", "attention_chunk_size")
# tensor keyword arguments that carry positions or offsets only (read here, or not needed);
# any other tensor is refused, as an input this function would drop
_TENSOR_KWARGS = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "cache_position",
                            "max_length_q", "max_length_k"})  # fmt: skip


def _unsupported(module: torch.nn.Module, query, value, kwargs: dict) -> str | None:
    """Why this call cannot be dilated attention as the model means it (None: it can): a sliding
    or chunked window (passed as an argument, or only in the model's mask: the layer's type in
    ``config.layer_types``, ``module.sliding_window``, or a config window without layer types),
    a logit softcap, an argument in :data:`_REFUSED_KWARGS` or another tensor argument, or a
    value head size other than the query's."""
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        return "dilated attention does not support sliding_window or softcap"
    for name, val in kwargs.items():
        if val is None:
            continue
        if name in _REFUSED_KWARGS or (isinstance(val, torch.Tensor) and name not in _TENSOR_KWARGS):
            return (f"the model passes {name}= to its attention (e.g. attention sinks, a relative "
                    "position bias): dilated attention does not implement it and would drop it")  # fmt: skip
    cfg = getattr(module, "config", None)
    idx = getattr(module, "layer_idx", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and isinstance(idx, int) and 0 <= idx < len(types):
        if types[idx] in ("sliding_attention", "chunked_attention"):
            return (f"layer {idx} is {types[idx]!r} (config.layer_types): its window lives in the "
                    "mask this function does not receive; dilated attention supports full-attention "
                    "layers only")  # fmt: skip
    if getattr(module, "sliding_window", None):
        return f"the layer has sliding_window={module.sliding_window}: dilated attention does not support it"
    if cfg is not None and types is None:
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            return f"config.sliding_window={cfg.sliding_window}: dilated attention does not support sliding windows"
        if getattr(cfg, "attention_chunk_size", None):
            return f"config.attention_chunk_size={cfg.attention_chunk_size}: dilated attention does not support chunked attention"
    if value.shape[-1] != query.shape[-1]:
        return (f"value head size {value.shape[-1]} != query/key head size {query.shape[-1]} "
                "(e.g. multi-head latent attention): dilated attention needs one head size")
    return None


def make_attention_function(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], impl: str = "auto"
):
    """The ``transformers`` attention function for one branch configuration.

    Register it with :func:`register_dilated_attention`, or, by hand, together with
    ``transformers.masking_utils.flash_attention_mask`` in ``AttentionMaskInterface`` under the
    same name: transformers (>= 4.53) passes a name with no registered mask function no padding
    mask at all, and the rows of a padded batch would then attend to their padding.
    """
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
        why = _unsupported(module, query, value, kwargs)
        if why is not None:
            raise ValueError(f"{_NAME}: {why}")
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        q = query.transpose(1, 2)  # (B, Nq, H, D)
        k = key.transpose(1, 2)  # (B, Nk, Hkv, D)
        v = value.transpose(1, 2)
        b, nq, h, d = q.shape
        kw = dict(
            causal=bool(causal), softmax_scale=scaling,
            dropout_p=dropout if module.training else 0.0, impl=impl,
        )  # fmt: skip
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if (cu_q is not None or cu_k is not None) and attention_mask is None:
            if cu_q is None or cu_k is None:
                raise ValueError(f"{_NAME}: pass both cu_seq_lens_q and cu_seq_lens_k (packed documents)")
            max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
            max_q = int(max_q) if max_q is not None else int(cu_q.diff().max())
            max_k = int(max_k) if max_k is not None else int(cu_k.diff().max())
            # as flash-attention: the batch is flattened and the offsets index the flat tokens
            out = dilated_attention_varlen(
                q.reshape(-1, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                cu_q, cu_k, max_q, max_k, seg, dil, **kw,
            )  # fmt: skip
            return out.view(b, nq, h, d), None
        keep = _keep_mask(attention_mask, k.shape[1], bool(causal))
        filled, docs = _row_documents(keep, kwargs.get("position_ids"), b, nq, k.shape[1])
        if docs is None:  # every row is one document [0, filled): the plain (or decode) path
            out = dilated_attention(q, k[:, :filled], v[:, :filled], seg, dil, **kw)
            return out, None
        leftpad = _leftpad_decode(docs, q, k, v, filled, impl, kw["dropout_p"])
        if leftpad is not None:  # a left-padded decode step: the cache read in place
            out = dilated_attention_with_kvcache(
                q, k[:, :filled], v[:, :filled], filled, seg, dil, causal=kw["causal"],
                softmax_scale=scaling, impl=impl, cache_leftpad=leftpad,
            )  # fmt: skip
            return out, None
        return _varlen_rows(q, k, v, filled, docs, seg, dil, **kw), None

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
        from transformers.masking_utils import flash_attention_mask  # noqa: F401 - padding_mask calls it: check it exists

        AttentionMaskInterface.register(name, padding_mask)
    except ImportError:
        pass
    return fn
