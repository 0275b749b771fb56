"""The functional API: validation, semantics and dispatch to an implementation.

Call path (decide once, then run):

0. a repeated call: a dense call whose key equals an earlier successful call's runs the route
   that call took (``call_cache.py``; :func:`_route`), a decode-shaped one the decode plan of an
   equal earlier call (``decode.fast_call``), with steps 1 and 2 already taken;
1. front door, :func:`dilated_attention`: applies the autocast rule and validates every argument
   once, into one call description (:func:`checks.describe_call` -> :class:`checks.Call`);
2. select (``kernels/select.py``): picks the implementation once (:func:`select.pick_impl`; a
   short query against a longer cache goes to the decode path, :func:`select.decode_applies` and
   :func:`select.pick_decode_impl`), with backend availability cached per (device type, dtype,
   head dim);
3. core: a validated core (``reference.py``, ``kernels/torch_dilated.py``, the fused Triton op,
   the decode op through :func:`_run_decode`, ``distributed/sequence_parallel.py``) that checks
   nothing again.

No public function calls another public function: autocast and head dim 0 are handled by the
private :func:`_run` / :func:`_core`.
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

from .autograd_rules import autocast_inputs, connected_empty, zero_features
from .branches import branch_head_ranges
from .call_cache import train_key, train_lookup, train_store
from .checks import Call, describe_call
from .decode import decode_core, fast_call, fast_store
from .kernels.select import (
    IMPLS,
    MAX_DECODE_ROWS,
    available_impls,
    decode_applies,
    pick_decode_impl,
    pick_impl,
    triton_unavailable_reason,
)

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
    key = tkey = None
    if group is None and type(dropout_p) is float and dropout_p == 0.0 and type(return_lse) is bool:
        try:  # decode-shaped: select.decode_shaped inlined (a frame less on the decode hot path)
            nq = q.shape[1]
            shaped = k.shape[1] > nq and nq <= MAX_DECODE_ROWS
        except (AttributeError, IndexError, TypeError):  # no tensors of that rank: the full path says why
            shaped = True
        if not shaped:
            # a repeated training (or prefill) call: the route the last identical call took,
            # with no checks or decisions re-derived (call_cache.py says what is compared)
            tkey = train_key(q, k, v, segment_lengths, dilation_rates, causal, softmax_scale, key_padding_mask,
                             head_assignment, return_lse, impl)  # fmt: skip
            if tkey is not None:
                entry = train_lookup(tkey, segment_lengths, dilation_rates)
                if entry is not None:
                    out, lse = entry.value(q, k, v, key_padding_mask)  # the stored route
                    return (out, lse) if return_lse else out
        elif key_padding_mask is None:
            # a repeated decode call (q_one_row against a cache): the plan the last identical call
            # ran, with no checks or decisions re-derived (decode.fast_call says what is compared)
            res, key = fast_call("da", q, k, v, None, None, segment_lengths, dilation_rates, causal,
                                 softmax_scale, head_assignment, impl, return_lse)  # fmt: skip
            if res is not None:
                return res
    q, k, v, amp_device = autocast_inputs(q, k, v)
    try:
        call = describe_call(
            q, k, v, segment_lengths, dilation_rates, causal=causal, softmax_scale=softmax_scale,
            key_padding_mask=key_padding_mask, dropout_p=dropout_p, head_assignment=head_assignment,
            return_lse=return_lse, impl=impl,
        )
    except (TypeError, ValueError) as e:
        if group is None:
            raise
        # with a group: raise on every rank, not only here (the others would wait in the
        # cross-rank check until the collective timeout)
        from .distributed.sequence_parallel import sp_arg_error

        sp_arg_error(group, e, (q, k, v))
    if amp_device is None:
        if key is not None:
            record: list = []  # the decode plan this call runs, if any (kept for the next call)
            res = _run(q, k, v, key_padding_mask, call, group, record)
            if record:
                fast_store(key, record[0], segment_lengths, dilation_rates, q.device.type)
            return res
        if tkey is not None:
            routes: list = []  # the dense route this call runs, if any (kept for the next call)
            res = _run(q, k, v, key_padding_mask, call, group, routes=routes)
            if routes:
                train_store(tkey, routes[0], segment_lengths, dilation_rates, q.device.type)
            return res
        return _run(q, k, v, key_padding_mask, call, group)
    # the SDPA rule (docs/autocast.md): cast once (above), run with autocast off
    with torch.autocast(amp_device, enabled=False):
        return _run(q, k, v, key_padding_mask, call, group)


def _run(q, k, v, key_padding_mask, call: Call, group, record: list | None = None,
         routes: list | None = None):  # fmt: skip
    """The validated call: sequence-parallel, the empty and headdim-0 edge cases, or the core.
    ``record`` gets the decode plan the core ran (see :func:`_run_decode`), ``routes`` its dense
    route (:func:`_route`); the edge cases record nothing."""
    if group is not None:
        from .distributed import sequence_parallel

        return sequence_parallel.dilated_attention_sp(
            q, k, v, call.segment_lengths, call.dilation_rates, causal=call.causal, scale=call.scale,
            key_padding_mask=key_padding_mask, dropout_p=call.dropout_p,
            head_assignment=call.head_assignment, return_lse=call.return_lse, impl=call.impl,
            group=group,
        )
    if q.shape[0] == 0 or q.shape[1] == 0:  # nothing to attend (batch 0 or no query)
        out = connected_empty(q, k, v)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        return (out, lse) if call.return_lse else out
    if q.shape[3] == 0:
        # headdim 0: every logit is 0, so out is empty and lse = log(number of keys): the chosen
        # impl on zero features (the same multiplicities)
        zq, zk = zero_features(q, k)
        _, lse = _core(zq, zk, zk, key_padding_mask, call._replace(scale=1.0, dropout_p=0.0))
        out = connected_empty(q, k, v)
        return (out, lse) if call.return_lse else out
    out, lse = _core(q, k, v, key_padding_mask, call, need_lse=call.return_lse, record=record, routes=routes)
    return (out, lse) if call.return_lse else out


def _core(q, k, v, key_padding_mask, call: Call, need_lse: bool = True, record: list | None = None,
          routes: list | None = None):  # fmt: skip
    """Pick the implementation once and run it: (out, lse float32). ``need_lse`` False lets the
    decode path skip the LSE output (lse may then be None); ``record`` gets the decode plan,
    ``routes`` the dense route (:func:`_route`)."""
    seg, dil = call.segment_lengths, call.dilation_rates
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    decode = call.impl != "reference" and decode_applies(
        q.shape[1], k.shape[1], key_padding_mask is not None, call.dropout_p, needs_grad
    )  # a few rows against a longer cache
    if decode:
        # the decode route's own rule (select.pick_decode_impl: the Triton decode kernel on
        # CUDA for "auto"; "triton" asks the decode kernel's availability), not the dense rule:
        # the dense rule measured on training-shaped calls may say "torch" (it sent a 4K decode
        # call to the torch decode path), and the fused kernel's limits (head dims) are not the
        # decode kernel's
        return _run_decode(q, k, v, call, call.impl, need_lse, record)
    chosen = pick_impl(
        call.impl, q, k, call.dropout_p, causal=call.causal, segment_lengths=seg,
        dilation_rates=dil, requires_grad=needs_grad,
    )
    route = _route(chosen, call, q.shape[2])
    if routes is not None:
        routes.append(route)
    return route(q, k, v, key_padding_mask)


def _route(chosen: str, call: Call, nheads: int):
    """The dense computation of a validated call once its impl is chosen: a function of
    (q, k, v, key_padding_mask) -> (out, lse float32) that checks and decides nothing, so that
    the fast path of a repeated call (``call_cache.py``) runs it again as it is. Built per call
    of the full path: each stored route serves one key (the fused route's ``FusedCall`` keeps the
    launch plan of its tensor layout)."""
    seg, dil, causal, scale = call.segment_lengths, call.dilation_rates, call.causal, call.scale
    p, ha = call.dropout_p, call.head_assignment
    if chosen == "torch":
        from .kernels import torch_dilated

        # inside torch.compile: the Dynamo-disabled entry (one graph break); eager: the plain one
        fn = torch_dilated.dilated_attention_torch if torch.compiler.is_compiling() else torch_dilated.dilated_attention_torch_eager

        def torch_route(q, k, v, kpm):
            return fn(q, k, v, seg, dil, causal=causal, scale=scale, key_padding_mask=kpm, dropout_p=p,
                      head_assignment=ha)  # fmt: skip

        return torch_route
    if chosen == "reference":
        from .reference import dilated_attention_reference

        def reference_route(q, k, v, kpm):
            out, lse = dilated_attention_reference(
                q, k, v, seg, dil, causal=causal, softmax_scale=scale, key_padding_mask=kpm,
                dropout_p=p, head_assignment=ha,
            )  # fmt: skip
            return out, lse.to(torch.float32)

        return reference_route
    from .kernels import triton_ops

    ranges = _head_ranges(nheads, len(seg), ha)
    if torch.compiler.is_compiling():  # the custom op (never stored: no key under compilation)

        def compiled_route(q, k, v, kpm):
            return triton_ops.triton_forward(q, k, v, seg, dil, ranges, causal=causal, scale=scale,
                                             key_padding_mask=kpm)  # fmt: skip

        return compiled_route
    fc, apply = triton_ops.FusedCall(seg, dil, ranges, causal, scale), triton_ops.fused_apply

    def fused_route(q, k, v, kpm):
        return apply(q, k, v, kpm, fc)

    return fused_route


_RANGES: dict = {}


def _head_ranges(nheads: int, nbranches: int, head_assignment: str):
    key = (nheads, nbranches, head_assignment)
    r = _RANGES.get(key)
    if r is None:
        r = _RANGES[key] = branch_head_ranges(nheads, nbranches, head_assignment)
    return r


def _run_decode(q, k, v, call: Call, chosen: str, need_lse: bool, record: list | None = None):
    """The decode path for a short query against a longer cache (validated inputs; the whole
    cache is valid: ``cache_seqlens`` None, so the Triton kernel reads no index tensor and no
    tensor is built per call). The one place ``dilated_attention`` reaches the decode kernels:
    the decode module's validated core (and its per-configuration plan), no second round of
    checks."""
    return decode_core(
        q, k, v, None, None, call.segment_lengths, call.dilation_rates,
        causal=call.causal, scale=call.scale, head_assignment=call.head_assignment,
        impl=pick_decode_impl(chosen, q), need_lse=need_lse, record=record,
    )  # fmt: skip
