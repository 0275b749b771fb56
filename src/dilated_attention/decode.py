"""KV-cache decoding: a few new query rows against a static cache, at a cost independent of its length.

:func:`dilated_attention_with_kvcache` is the decode entry point (``flash_attn_with_kvcache``
style): the cache buffers have a fixed shape, ``cache_seqlens`` (an int32 device tensor, one
entry per batch) says where each row's valid slots end, ``cache_leftpad`` (optional, int32, one
entry per batch) where they start, and query row t of batch b is position
``cache_seqlens[b] - cache_leftpad[b] - seqlen_q + t`` of its sequence (bottom-right aligned,
causal within the new rows when ``causal``). Per branch a row reads only the keys of its own
segment with its residue, at most ``sum_b ceil(w_b / r_b)`` keys whatever the cache length
(``docs/spec.md`` gives the math).

No host synchronisation and no planning that depends on tensor values: the launch grid depends
only on the branch configuration, so one call can be captured in a CUDA graph and replayed as the
cache grows (``cache_seqlens`` updated in place), and it runs under
``torch.compile(mode="reduce-overhead")``: under compilation the work is the custom op
``dilated_attention::decode`` with a fake implementation; in eager mode the implementation is
called directly (the custom op's Python dispatch costs more than the torch decode path's host work).

Layers: :func:`dilated_attention_with_kvcache` (the public front door: every check, then
:func:`.kernels.select.pick_decode_impl`) and :func:`decode_core` (validated inputs, an already chosen impl,
no checks). What depends only on the configuration (the branch rows of the heads, the impl a
device/dtype/headdim can run) is computed once and cached.

Cache slots: position p of row b is slot index ``cache_leftpad[b] + p`` and lives in slot
``(cache_leftpad[b] + p) % cache_len``. A cache at least as long as the sequence is the plain
cache; a shorter one is a rolling cache, exact as long as it holds the last
``max(w) + seqlen_q - 1`` positions (no branch reads a key older than its own segment start).
The caller keeps ``cache_seqlens`` within its cache (it is never read on the host).

Implementations: ``kernels/triton_decode.py`` (GPU; on the CPU under ``TRITON_INTERPRET=1``) and
``kernels/torch_decode.py`` (any device, float64). Inference only: no autograd. An eager Triton
call runs through its configuration's plan (``triton_decode.DecodePlan``: built once, the compiled
kernels launched directly, the split partials in a workspace reused per stream) unless
``flags.set_direct_launch(False)`` asks for the per-call path (same bits; for A/B measurements).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from . import flags
from .branches import branch_head_ranges
from .checks import branch_lists, check_bool, check_head_assignment, check_qkv, resolve_scale
from .kernels import torch_decode
from .kernels.direct_launch import cache_classes
from .kernels.select import MAX_DECODE_ROWS, backend_reason, pick_decode_impl

_INT32_MAX = 2**31 - 1


_TRITON_DECODE = []  # the module, once imported (an import statement per call costs ~1 us)


def _triton_decode():
    # imported at the first Triton decode call, not with the package: ``triton.jit`` picks the
    # interpreter or the compiler when the kernels are defined, and test modules set
    # TRITON_INTERPRET after the package may have been imported by another module
    if _TRITON_DECODE:
        return _TRITON_DECODE[0]
    from .kernels import triton_decode

    triton_decode.on_plans_cleared(_FAST.clear)  # clearing the plans clears the fast path's entries (both keys)
    _TRITON_DECODE.append(triton_decode)
    return triton_decode


def triton_unavailable_reason(q: torch.Tensor) -> str | None:
    """Why the Triton decode kernel cannot run on inputs like ``q`` (None if it can): the one
    answer of :func:`.kernels.select.backend_reason`, cached per (device type, dtype, headdim)."""
    return backend_reason("triton_decode", q.device.type, q.dtype, q.shape[-1])


def _branch_rows(nheads: int, seg, dil, head_assignment: str) -> list[int]:
    """Flat (w, r, head start, head stop) of the branches that have at least one head."""
    ranges = branch_head_ranges(nheads, len(seg), head_assignment)
    flat = []
    for w, r, (hs, he) in zip(seg, dil, ranges, strict=True):
        if he > hs:
            flat += [w, r, hs, he]
    return flat


_PLANS: dict[tuple, tuple[list[int], tuple[tuple[int, int, int, int], ...]]] = {}


def _plan(nheads: int, seg: tuple, dil: tuple, head_assignment: str):
    """(flat branch rows for the custom op, the same as 4-tuples for a direct call), once per
    configuration."""
    key = (nheads, seg, dil, head_assignment)
    plan = _PLANS.get(key)
    if plan is None:
        flat = _branch_rows(nheads, seg, dil, head_assignment)
        rows = tuple(tuple(flat[i : i + 4]) for i in range(0, len(flat), 4))
        plan = (flat, rows)
        if not torch.compiler.is_compiling():
            if len(_PLANS) > 256:  # a bound for processes that sweep configurations
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _run(q, k_cache, v_cache, cache_seqlens, cache_leftpad, rows, causal, scale, impl, need_lse=True, reuse=True,
         record=None):  # fmt: skip
    if impl == "triton":
        td = _triton_decode()
        if flags.direct_launch_enabled():  # the plan of this configuration (kernels/triton_decode.py)
            return td.decode_triton(
                q, k_cache, v_cache, cache_seqlens, cache_leftpad, rows, causal, scale,
                need_lse=need_lse, reuse_workspace=reuse, record=record,
            )  # fmt: skip
        return td.decode_triton_jit(q, k_cache, v_cache, cache_seqlens, cache_leftpad, rows, causal, scale)
    if cache_seqlens is None:
        cache_seqlens = _full_seqlens(q, k_cache)
    return torch_decode.decode_torch(q, k_cache, v_cache, cache_seqlens, cache_leftpad, rows, causal, scale)


def _full_seqlens(q, k_cache) -> torch.Tensor:
    return torch.full((q.shape[0],), k_cache.shape[1], dtype=torch.int32, device=q.device)


@torch.library.custom_op("dilated_attention::decode", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor | None,
    branches: list[int],
    causal: bool,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = tuple(tuple(branches[i : i + 4]) for i in range(0, len(branches), 4))
    # a fresh workspace per call: under torch.compile(mode="reduce-overhead") this may run in a
    # CUDA graph's warm-up, whose allocations belong to the graph's pool
    return _run(q, k_cache, v_cache, cache_seqlens, cache_leftpad, rows, causal, scale, impl, reuse=False)


@_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_leftpad, branches, causal, scale, impl):
    b, nq, h, d = q.shape
    return q.new_empty((b, nq, h, d)), q.new_empty((b, h, nq), dtype=torch.float32)


def decode_core(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    seg: tuple[int, ...],
    dil: tuple[int, ...],
    *,
    causal: bool,
    scale: float,
    head_assignment: str,
    impl: str,
    need_lse: bool = True,
    record: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode computation on validated inputs (the checks of
    :func:`dilated_attention_with_kvcache`; ``seg``/``dil`` normalised tuples, ``cache_seqlens``
    an int32 (batch,) tensor, or None: every row's valid slots are the whole cache) with an
    already chosen ``impl`` ("torch" or "triton"). No checks. Returns (out, lse); lse may be None
    when ``need_lse`` is False. ``record``: a list that gets the Triton plan that ran, when the
    call ran one on the caller's own tensors (no copy made here; see :func:`fast_lookup`)."""
    if impl == "triton":  # the kernel reads rows with unit stride in the last dim
        if q.stride(-1) != 1:
            q, record = q.contiguous(), None
        if k_cache.stride(-1) != 1:
            k_cache, record = k_cache.contiguous(), None
        if v_cache.stride(-1) != 1:
            v_cache, record = v_cache.contiguous(), None
    flat, rows = _plan(q.shape[2], seg, dil, head_assignment)
    if torch.compiler.is_compiling():  # the custom op: traceable, with a fake implementation
        if cache_seqlens is None:
            cache_seqlens = _full_seqlens(q, k_cache)
        return _decode_op(q, k_cache, v_cache, cache_seqlens, cache_leftpad, flat, causal, scale, impl)
    return _run(q, k_cache, v_cache, cache_seqlens, cache_leftpad, rows, causal, scale, impl, need_lse, record=record)


# ------------------------------------------------------------------ the fast path of a repeated call
#
# A decode step repeats one configuration: the same shapes, strides, dtypes, devices, branch
# lists and options on every call, only the data (and the position in cache_seqlens) change.
# Everything both front doors derive from those (every check, the impl, the branch rows, the
# plan key) is then the same as on the last call, so the first call that ran a Triton plan on the
# caller's own tensors leaves that plan here, under a key of everything the checks and decisions
# read, and the next call with an equal key runs the plan at once (fast_call; DecodePlan.launch
# still checks the pointers' alignment, the current device and the launch hooks per call).
#
# Two keys per entry. The exact key (fast_key) holds the caches' shapes and strides as they are:
# a steady call builds it from a few attribute reads and one tuple hash, and its hit hands the
# strides and the length it read to the plan. A caller whose cache grows (a view k[:, :filled],
# a fresh torch.cat per step, whose batch stride grows too) misses it on every step and finds the
# class key (_class_key): the cache length and the caches' strides by their Triton specialisation
# classes (the plan passes the values per call), so that the same entry serves every step.
# Exact first: the class key costs a Python call and a few integer operations (a steady call cost
# 0.8-1.0 us more on the CPU box when it was the only key: benchmarks/NOTES_triton.md); a
# growing cache pays it after the exact miss, a steady call never.
#
# What can change between calls with equal keys is checked on every call (fast_lookup; autocast
# for the dilated_attention route): gradient mode and requires_grad, the direct launch switch,
# the element types of the branch lists (8.0 == 8 and True == 1 hash alike). Anything unusual (a
# subclass of Tensor, a numpy int, a strided index tensor, an int cache_seqlens) gets no key: the
# full path, as before. Never under torch.compile (fast_key asks first).

_MAX_FAST = 256
_Tensor = torch.Tensor
_SEQ = (list, tuple)
_FAST_CLASS: dict = {}  # the class keys (growing caches), beside the exact keys of _FAST


class _FastTable(dict):
    """The entries by exact key; ``clear`` also clears those by class key (:data:`_FAST_CLASS`)."""

    def clear(self) -> None:
        super().clear()
        _FAST_CLASS.clear()


_FAST: _FastTable = _FastTable()


def fast_key(tag, q, k, v, seg, dil, causal, softmax_scale, head_assignment, impl, extra=None):
    """The exact key of a call for :data:`_FAST`, or None where the fast path never applies
    (under torch.compile; other argument types than the common ones; for ``tag`` "da" a call
    that is not decode-shaped). Shape and strides of k and v, of q, dtypes and devices, the
    branch lists as tuples, the options, ``extra`` (the index tensors). No check of the values:
    an entry is stored only for a call that passed every check, so an equal key passes them too.
    The first four elements are k's shape and strides and v's shape and strides
    (:func:`_class_key` and :func:`fast_call` read them there)."""
    if (
        torch.compiler.is_compiling()
        or type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor
        or type(seg) not in _SEQ or type(dil) not in _SEQ or type(causal) is not bool
        or type(impl) is not str or type(head_assignment) is not str
        or (softmax_scale is not None and type(softmax_scale) is not float)
    ):  # fmt: skip
        return None
    qs, ks = q.shape, k.shape
    if tag == "da" and not (len(qs) == 4 and len(ks) == 4 and qs[1] < ks[1] and qs[1] <= MAX_DECODE_ROWS):
        # not decode-shaped (select.decode_shaped, inlined: a frame less on the decode hot
        # path): a training or prefill call builds no key
        return None
    return (
        ks, k.stride(), v.shape, v.stride(), tag, qs, q.stride(), q.dtype, q.device, k.dtype, k.device,
        v.dtype, v.device, tuple(seg), tuple(dil), causal, softmax_scale, head_assignment, impl, extra,
    )  # fmt: skip


def _class_key(key):
    """The class key of an exact key (None where it has none): the caches' batch, head and
    headdim sizes and :func:`.kernels.direct_launch.cache_classes` of their length and strides
    in place of their shapes and strides. Every check and decision of the full path reads the
    cache length and the caches' strides only through these classes (the length: >= 1, and
    > seqlen_q for "da", which fast_key required; the last stride: == 1, or decode_core
    copies); k and v must have one shape (their lengths are not in the class key)."""
    ks, kst, vs, vst = key[0], key[1], key[2], key[3]
    if len(ks) != 4 or vs != ks or ks[1] < 1:
        return None  # the full path checks these and names what is wrong
    return (ks[0], ks[2], ks[3], cache_classes(ks[1], kst, vst)) + key[4:]


class _Fast:
    __slots__ = ("plan", "seg", "dil", "device_type")

    def __init__(self, plan, seg, dil, device_type):
        self.plan, self.seg, self.dil, self.device_type = plan, seg, dil, device_type


def fast_lookup(key, q, k, v, seg, dil):
    """The entry stored for ``key`` (by exact key, else by class key) if this call may run its
    plan directly, else None. Checked per call: no gradient needed, the direct launch on, and
    the branch lists' elements plain ints (the same tuple objects as when stored, or checked
    again: 8.0 == 8 and True == 1 hash alike)."""
    try:
        hit = _FAST.get(key)
    except TypeError:  # an unhashable element in a branch list: the full path names it
        return None
    if hit is None:
        ck = _class_key(key)
        hit = None if ck is None else _FAST_CLASS.get(ck)
        if hit is None:
            return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None  # (a decode loop runs under no_grad: one C call, no tensor attribute read)
    if not flags.direct_launch_enabled():
        return None
    if not (seg is hit.seg and dil is hit.dil) and {*map(type, seg), *map(type, dil)} != _INT_ONLY:
        return None
    return hit


def fast_call(tag, q, k, v, cache_seqlens, cache_leftpad, seg, dil, causal, softmax_scale, head_assignment, impl,
              return_lse):  # fmt: skip
    """A front door's repeated call: ``(result, None)`` when a stored plan ran it (``result``
    as the front door returns it: out, or (out, lse) with ``return_lse``), else ``(None,
    key)``: the full path runs, and stores its plan under ``key`` (:func:`fast_store`) unless
    ``key`` is None. ``tag``: "kv" (:func:`dilated_attention_with_kvcache`: the index tensors
    given) or "da" (``dilated_attention(q_one_row, k, v)``: the whole cache, ``cache_seqlens``
    and ``cache_leftpad`` None; its full path follows autocast, so an active autocast takes it)."""
    if tag == "kv":  # the index tensors: plain contiguous tensors only (the full path checks or copies others)
        if type(cache_seqlens) is not _Tensor or not cache_seqlens.is_contiguous():
            return None, None
        if cache_leftpad is None:
            lk = None
        elif type(cache_leftpad) is _Tensor and cache_leftpad.is_contiguous():
            lk = (cache_leftpad.shape, cache_leftpad.dtype, cache_leftpad.device)
        else:
            return None, None
        extra = ((cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device), lk)
    else:
        extra = None
    key = fast_key(tag, q, k, v, seg, dil, causal, softmax_scale, head_assignment, impl, extra)
    if key is None:
        return None, None
    hit = fast_lookup(key, q, k, v, seg, dil)
    if hit is None or (tag == "da" and torch.is_autocast_enabled(hit.device_type)):
        return None, key
    out, lse = hit.plan.launch(q, k, v, cache_seqlens, cache_leftpad, return_lse, key[0][1], key[1], key[3])
    return ((out, lse) if return_lse else out), None


def fast_store(key, plan, seg, dil, device_type: str) -> None:
    """Keep ``plan`` for ``key`` (a call that passed every check and ran it), under its exact
    key and its class key."""
    if {*map(type, seg), *map(type, dil)} != _INT_ONLY:
        return  # e.g. numpy ints: accepted, but the next call's check could not tell them apart
    if len(_FAST) >= _MAX_FAST or len(_FAST_CLASS) >= _MAX_FAST:  # a bound for processes that sweep configurations
        _FAST.clear()
    # tuples are immutable: the same objects next time need no element check
    entry = _Fast(plan, seg if type(seg) is tuple else None, dil if type(dil) is tuple else None, device_type)
    _FAST[key] = entry
    ck = _class_key(key)
    if ck is not None:
        _FAST_CLASS[ck] = entry


_INT_ONLY = {int}  # the element types of branch lists a stored plan's key may hold


def _check(q, k_cache, v_cache) -> None:
    """The tensors of a ``dilated_attention_with_kvcache`` call: the rules every entry point
    shares (:func:`checks.check_qkv`, cache names; a cache's length is not its valid length, so
    no seqlen_q <= seqlen_k), then the decode path's own (a non-empty cache, 1..64 new rows)."""
    name = "dilated_attention_with_kvcache"
    check_qkv(q, k_cache, v_cache, name, kv_names=("k_cache", "v_cache"), seqlen_rule=False)
    if k_cache.shape[1] == 0:
        raise ValueError(
            f"{name}: the cache is empty (cache_len 0, k_cache {tuple(k_cache.shape)}); allocate at "
            "least the positions the new rows are written to"
        )
    nq = q.shape[1]
    if not 1 <= nq <= MAX_DECODE_ROWS:
        raise ValueError(
            f"{name}: seqlen_q = {nq}; the decode path takes 1..{MAX_DECODE_ROWS} new rows, "
            "prefill longer chunks with dilated_attention(q, k, v, ...)"
        )


def _index_tensor(name: str, t, q: torch.Tensor) -> torch.Tensor:
    b = q.shape[0]
    if t.shape != (b,) or t.dtype != torch.int32:
        raise ValueError(
            f"dilated_attention_with_kvcache: {name} must be an int32 tensor of shape (batch,) = ({b},), "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.device != q.device:
        raise ValueError(f"dilated_attention_with_kvcache: {name} is on {t.device}, q on {q.device}; move it to q's device")
    # the Triton kernel loads entry b with unit stride: a strided view (e.g. a column of a
    # (batch, 2) table) is copied, never read as its storage's first entries (no-op otherwise)
    return t.contiguous()


def _cache_seqlens(cache_seqlens, q: torch.Tensor) -> torch.Tensor:
    """An int32 (batch,) tensor on q's device. A host int is checked here (>= seqlen_q, fits in
    int32); a device tensor is not read (no host sync): docs/spec.md gives its contract."""
    if isinstance(cache_seqlens, torch.Tensor):
        return _index_tensor("cache_seqlens", cache_seqlens, q)
    if isinstance(cache_seqlens, torch.SymInt):  # a traced length (torch.compile, dynamic shapes)
        return torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        n = int(cache_seqlens)
        nq = q.shape[1]
        if not nq <= n <= _INT32_MAX:
            raise ValueError(
                f"dilated_attention_with_kvcache: cache_seqlens = {n} must count the valid positions, the "
                f"{nq} new rows included, so {nq} <= cache_seqlens <= {_INT32_MAX}"
            )
        return torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
    raise TypeError(
        "dilated_attention_with_kvcache: cache_seqlens must be an int (one length for every batch "
        "entry) or an int32 torch.Tensor of shape (batch,) on q's device, got "
        f"{type(cache_seqlens).__name__}; for per-row lengths pass "
        "torch.tensor(lengths, dtype=torch.int32, device=q.device)"
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
    cache_leftpad: torch.Tensor | None = None,
):
    """Dilated attention of a few new query rows against a KV cache (inference only).

    Args:
        q: (batch, seqlen_q, nheads, headdim), ``1 <= seqlen_q <= 64``.
        k_cache, v_cache: (batch, cache_len, nheads_kv, headdim), ``cache_len >= 1``,
            ``nheads % nheads_kv == 0``; the new rows' own keys/values must already be written.
            Position p of row b is slot ``(cache_leftpad[b] + p) % cache_len``.
        cache_seqlens: (batch,) int32 device tensor, or an int (incl. numpy integer scalars) for
            every batch entry: the end of each row's valid slots, the new rows included. Query
            row t of batch b is position ``cache_seqlens[b] - cache_leftpad[b] - seqlen_q + t``;
            a row at a negative position attends to nothing (out 0, lse -inf). An int must be
            ``>= seqlen_q``; a tensor is not read on the host (docs/spec.md).
        segment_lengths, dilation_rates, causal, softmax_scale, head_assignment: as in
            :func:`dilated_attention.dilated_attention`.
        return_lse: also return lse (batch, nheads, seqlen_q) float32.
        impl: ``"auto"`` (the Triton kernel on CUDA where it can run, else the torch path),
            ``"triton"`` or ``"torch"``.
        cache_leftpad: optional (batch,) int32 device tensor (flash-attn's ``cache_leftpad``):
            row b's sequence starts at slot ``cache_leftpad[b]``; slots before it are ignored and
            positions, segments and residues count from it, so a left-padded batch decodes
            exactly like each row alone. Negative entries count as 0.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, or ``(out, lse)``. A row that no
        branch selects (no head of its residue) gets out = 0 and lse = -inf.
    """
    res, key = fast_call("kv", q, k_cache, v_cache, cache_seqlens, cache_leftpad, segment_lengths, dilation_rates,
                         causal, softmax_scale, head_assignment, impl, return_lse)  # fmt: skip
    if res is not None:  # a repeated call: the stored plan ran it
        return res
    _check(q, k_cache, v_cache)
    seqlens = _cache_seqlens(cache_seqlens, q)
    if cache_leftpad is not None:
        if not isinstance(cache_leftpad, torch.Tensor):
            raise TypeError(
                "dilated_attention_with_kvcache: cache_leftpad must be None or an int32 torch.Tensor of "
                f"shape (batch,) on q's device, got {type(cache_leftpad).__name__}"
            )
        cache_leftpad = _index_tensor("cache_leftpad", cache_leftpad, q)
    seg, dil = branch_lists(segment_lengths, dilation_rates)
    check_head_assignment(head_assignment)
    causal = check_bool("causal", causal)
    check_bool("return_lse", return_lse)  # "no" would otherwise mean True
    chosen = pick_decode_impl(impl, q)  # checks impl (the one decode rule, kernels/select.py)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        raise ValueError(
            "dilated_attention_with_kvcache is inference only (no autograd); call it under "
            "torch.no_grad() or use dilated_attention for training"
        )
    scale = resolve_scale(softmax_scale, q.shape[-1])
    record = [] if key is not None else None
    out, lse = decode_core(
        q, k_cache, v_cache, seqlens, cache_leftpad, seg, dil,
        causal=causal, scale=scale, head_assignment=head_assignment, impl=chosen, need_lse=return_lse,
        record=record,
    )  # fmt: skip
    if record:
        fast_store(key, record[0], segment_lengths, dilation_rates, q.device.type)
    return (out, lse) if return_lse else out


