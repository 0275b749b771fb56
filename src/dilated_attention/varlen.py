"""Packed documents (varlen): :func:`dilated_attention_varlen`, flash-attn's varlen front door.

Several documents of different lengths are concatenated along one token dimension (no padding):
q ``(total_q, nheads, headdim)``, k/v ``(total_k, nheads_kv, headdim)``, and document i holds the
query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and the key rows
``cu_seqlens_k[i]:cu_seqlens_k[i+1]``. Each document is its own sequence (docs/spec.md,
"Packed documents (varlen)"): the result on its rows equals :func:`dilated_attention` run on that
document alone, its segments start at its first token, its queries are bottom-right aligned
within it when it has fewer queries than keys, and nothing crosses a document boundary.

Host synchronisation (the rule): the offsets' *shapes and dtypes* are always checked (free). Their
*values* are checked whenever they are on the host anyway: when the caller passes CPU tensors, and
on the ``"reference"`` and ``"torch"`` paths, which plan their calls per document (or per
bucket of equal padded length, :func:`_per_document`) and so read the offsets to the host once
(one sync per call). The fused ``"triton"`` path takes device offsets
without reading them (no sync); pass ``check_offsets=True`` there to validate them at the cost
of one sync, or pass the offsets on the CPU (checked on the host, then copied to the device
without a sync). Checked offsets also spare the fused path its zero-fills: every row is then
known to belong to a document (``triton_launch.Docs.checked``); unchecked device offsets keep
them, so rows past the last document read as zeros.

With ``group=`` the tensors are this rank's shard of one packed stream and the offsets are the
stream's global ones: :func:`..distributed.sequence_parallel.dilated_attention_sp_varlen` plans
the exchange from their host values (read once).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .autograd_rules import autocast_inputs, connected_empty
from .checks import (
    branch_lists,
    check_bool,
    check_cu_seqlens_meta,
    check_cu_seqlens_values,
    check_dropout,
    check_head_assignment,
    check_qkv,
    resolve_scale,
)
from .kernels.select import check_impl, decode_shaped, pick_decode_impl, pick_varlen_impl

__all__ = ["dilated_attention_varlen", "check_cu_seqlens_values"]

_NAME = "dilated_attention_varlen"


def _check_tensors(q, k, v) -> None:
    for n, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_NAME}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{_NAME}: {n} must have 3 dims (total_tokens, nheads, headdim), the documents "
                f"concatenated along dim 0, got shape {tuple(t.shape)}; for a padded (batch, "
                "seqlen, nheads, headdim) tensor use dilated_attention"
            )
    if q.shape[0] > k.shape[0]:
        raise ValueError(
            f"{_NAME}: total_q ({q.shape[0]}) > total_k ({k.shape[0]}): some document would have "
            "more queries than keys (check cu_seqlens_q and cu_seqlens_k)"
        )
    check_qkv(q[None], k[None], v[None], _NAME)
    if q.shape[-1] == 0:
        raise ValueError(f"{_NAME}: headdim is 0; q, k, v need at least one feature")


def _check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_NAME}: {name} must be a Python int (the longest document), got {value!r}")
    if value < 0:
        raise ValueError(f"{_NAME}: {name} must be >= 0, got {value}")
    return int(value)


def _host_list(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


def dilated_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    head_assignment: str = "all",
    return_lse: bool = False,
    impl: str = "auto",
    check_offsets: bool = False,
    group=None,
    layout: str = "contiguous",
):
    """Dilated attention over packed documents (flash-attn's ``flash_attn_varlen_func`` layout).

    Args:
        q: (total_q, nheads, headdim), the documents' query rows concatenated.
        k, v: (total_k, nheads_kv, headdim); ``nheads % nheads_kv == 0`` (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: (docs + 1,) integer tensors (int32 as flash-attn), on q's
            device or the CPU: document i is rows ``cu[i]:cu[i+1]``. A document may be empty;
            it may have fewer queries than keys (its query row t is its position
            ``nk_i - nq_i + t``), never more.
        max_seqlen_q, max_seqlen_k: Python ints, the longest document's query/key count.
        segment_lengths, dilation_rates, causal, softmax_scale, dropout_p, head_assignment: as
            :func:`dilated_attention.dilated_attention`; positions are per document.
        return_lse: also return lse (nheads, total_q) float32 (not differentiable).
        impl: ``"reference"`` (the oracle, one dense call per document), ``"torch"`` (one
            torch-path call per bucket of similar lengths), ``"triton"`` (one fused launch over
            all documents from device offsets) or ``"auto"`` (the fused kernel on CUDA where
            it can run and ``dropout_p == 0``, else ``"torch"``).
        check_offsets: validate device offsets on the fused path too (one host sync). Offsets
            on the CPU, and the reference/torch paths (which read them once), are always checked.
        group: a ``torch.distributed`` process group (or 1-D DeviceMesh, or ``(mesh, dim)``) for
            sequence parallelism over ONE packed stream of N tokens (docs/spec.md, "Sequence
            parallelism over a packed stream"): each rank passes its shard of the stream (``layout``) as q, k, v
            ``(N/P, heads, headdim)`` and the GLOBAL offsets (the same on every rank; a CPU
            tensor, a device tensor or a list of ints: the plan is built from host values, so
            device offsets are read once, one sync), with ``cu_seqlens_q == cu_seqlens_k`` and
            ``max_seqlen_*`` the longest document of the whole stream. Documents may cross rank
            boundaries; no document needs padding, only N must split over the ranks
            (``N % P == 0``, zigzag ``N % 2P == 0``). Returns this rank's shard of the
            single-device result (lse ``(nheads, N/P)``), with exact gradients. Not with
            ``dropout_p > 0`` or ``impl`` "reference"/"triton".
        layout: with ``group``: ``"contiguous"`` (rank r holds tokens ``[r*N/P, (r+1)*N/P)``)
            or ``"zigzag"`` (2P chunks, rank r holds chunks r and 2P-1-r), as
            :func:`dilated_attention.shard_sequence` cuts them (``dim=0``).

    Returns:
        out (total_q, nheads, headdim) in q's dtype, or ``(out, lse)``. Autocast follows
        :func:`dilated_attention` (docs/autocast.md). A query with no key gets out = 0,
        lse = -inf.
    """
    q, k, v, amp_device = autocast_inputs(q, k, v)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, segment_lengths,
            dilation_rates, causal, softmax_scale, dropout_p, head_assignment, return_lse, impl,
            check_offsets, group, layout)  # fmt: skip
    if amp_device is not None:  # the SDPA rule (docs/autocast.md): cast once, run with autocast off
        with torch.autocast(amp_device, enabled=False):
            return _varlen(*args)
    return _varlen(*args)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, segment_lengths,
            dilation_rates, causal, softmax_scale, dropout_p, head_assignment, return_lse, impl,
            check_offsets, group, layout):  # fmt: skip
    """:func:`dilated_attention_varlen` after its autocast rule: check once, pick once, run (the
    public function does not call itself again)."""
    try:
        _check_tensors(q, k, v)
        if group is not None:  # host offsets are welcome: the plan is built from host values
            cu_seqlens_q, cu_seqlens_k = _offsets_tensor(cu_seqlens_q), _offsets_tensor(cu_seqlens_k)
        check_cu_seqlens_meta(cu_seqlens_q, cu_seqlens_k, q.device, _NAME)
        max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
        max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
        seg, dil = branch_lists(segment_lengths, dilation_rates)
        check_head_assignment(head_assignment)
        p = check_dropout(dropout_p)
        scale = resolve_scale(softmax_scale, q.shape[-1])
        causal = check_bool("causal", causal)
        check_bool("return_lse", return_lse)
        check_bool("check_offsets", check_offsets)
        check_impl(impl)
    except (TypeError, ValueError) as e:
        if group is None:
            raise
        # with a group: raise on every rank, not only here (the others would wait in the
        # cross-rank check until the collective timeout)
        from .distributed.sequence_parallel import sp_varlen_arg_error

        sp_varlen_arg_error(group, e, (q, k, v, cu_seqlens_q, cu_seqlens_k), _NAME)
    if group is not None:
        out, lse = _sequence_parallel(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seg, dil, causal, scale, p,
            head_assignment, impl, group, layout,
        )  # fmt: skip
        return (out, lse) if return_lse else out

    chosen = pick_varlen_impl(impl, q, k, p, _NAME)
    on_host = cu_seqlens_q.device.type == "cpu" and cu_seqlens_k.device.type == "cpu"
    host = None
    if chosen != "triton" or on_host or check_offsets:
        host = (_host_list(cu_seqlens_q), _host_list(cu_seqlens_k))  # one sync for device offsets
        check_cu_seqlens_values(*host, q.shape[0], k.shape[0], max_q, max_k)

    if chosen == "triton":
        from .kernels.triton_ops import dilated_attention_triton_varlen as fn

        cu_q, cu_k = _device_offsets(cu_seqlens_q, cu_seqlens_k, host, q.device)
        # checked offsets cover every row: the kernels' buffers need no zero-fill
        out, lse = fn(
            q, k, v, cu_q, cu_k, max_q, max_k, seg, dil, causal=causal, scale=scale,
            head_assignment=head_assignment, offsets_checked=host is not None,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    out, lse = _per_document(
        q, k, v, *host, seg, dil, causal, scale, p, head_assignment, chosen,
        decode_impl="auto" if impl == "auto" else "torch",
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _device_offsets(cu_q, cu_k, host, device):
    """The offsets as int32 tensors on ``device`` for the fused path, one tensor for both when
    their values are equal (so that the kernels may treat them as shared: the folded forward,
    ``triton_launch.Docs.same_offsets``). CPU offsets on a GPU: the host values that were
    checked (``host``), copied without a host sync (a blocking copy waits for the stream, one
    sync per call) from a fresh pageable tensor, which the driver stages before the copy
    returns (a pinned caller's tensor would be read later, after the caller may have rewritten
    it)."""
    on_host = cu_q.device.type == "cpu" and cu_k.device.type == "cpu"
    if on_host and device.type != "cpu":
        dq = torch.tensor(host[0], dtype=torch.int32).to(device, non_blocking=True)
        if host[1] == host[0]:
            return dq, dq
        return dq, torch.tensor(host[1], dtype=torch.int32).to(device, non_blocking=True)
    dq = cu_q.to(device=device, dtype=torch.int32)
    if cu_k is cu_q or (host is not None and host[1] == host[0]):
        return dq, dq
    return dq, cu_k.to(device=device, dtype=torch.int32)


def _offsets_tensor(cu):
    """A list or tuple of ints -> an int64 CPU tensor (anything else is checked as it is)."""
    if isinstance(cu, (list, tuple)) and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu
    ):
        return torch.tensor([int(x) for x in cu], dtype=torch.int64)
    return cu


def _sequence_parallel(
    q, k, v, cu_q, cu_k, max_q, max_k, seg, dil, causal, scale, p, head_assignment, impl, group,
    layout,
):
    """``group=``: this rank's shard of one packed stream; the checks run on every rank inside
    the cross-rank validation (one error everywhere, no hang)."""
    from .distributed.comm import resolve_group, world_and_rank
    from .distributed.layout import check_layout
    from .distributed.sequence_parallel import dilated_attention_sp_varlen

    group = resolve_group(group)
    world, _ = world_and_rank(group)
    host_q, host_k = _host_list(cu_q), _host_list(cu_k)  # one sync for device offsets
    n_local = q.shape[0]
    n = world * n_local

    def checks():
        check_layout(layout)
        if p > 0:
            raise ValueError(
                f"{_NAME}: dropout_p > 0 is not supported with group= (sequence-parallel); "
                "apply dropout outside attention or run without a group"
            )
        if host_q != host_k:
            raise ValueError(
                f"{_NAME}: with group= cu_seqlens_q must equal cu_seqlens_k (self-attention over "
                f"one packed stream), got {host_q} and {host_k}"
            )
        where = f"the global stream: P = {world} ranks x {n_local} rows of this rank's shard"
        check_cu_seqlens_values(host_q, host_k, n, n, max_q, max_k, _NAME, totals=(where, where))
        if layout == "zigzag" and n_local % 2:
            raise ValueError(
                f"{_NAME}: layout='zigzag' cuts the stream into 2P = {2 * world} equal chunks, so "
                f"the stream length N = {n} must be a multiple of {2 * world} (each rank an even "
                f"shard, got {n_local}); append one filler document to the stream (with ignored "
                "targets), or use layout='contiguous' (N % P == 0)"
            )

    return dilated_attention_sp_varlen(
        q, k, v, host_q, seg, dil, causal=causal, scale=scale, head_assignment=head_assignment,
        impl=impl, group=group, layout=layout, local_checks=checks, name=_NAME,
    )  # fmt: skip


def _bucket(n: int) -> int:
    """Padded length of a document of n rows in the torch path's batched calls: n rounded up to
    a multiple of a quarter of its power of two (at most 25% padding, ~4 lengths per octave)."""
    g = max(1, (1 << (n.bit_length() - 1)) >> 2)
    return -(-n // g) * g


def _per_document(
    q, k, v, cu_q, cu_k, seg, dil, causal, scale, p, head_assignment, impl, decode_impl="torch"
):
    """The validated core per document, outputs in row order.

    ``"reference"``: one call per document with queries. ``"torch"``: documents with as many
    queries as keys are batched by padded length (:func:`_bucket`): each one is padded at its
    end, the padded keys masked by ``key_padding_mask``, which leaves its positions, and so the
    result on its rows, unchanged; padded query rows are dropped. Documents with a few queries
    (1..64) and more keys, when no gradient and no dropout is needed (decoding, e.g. the rows of
    a left-padded batch), go to the decode path in one call per query count: keys padded at the
    end, ``cache_seqlens`` = each document's key count, so the padding is never read
    (``decode_impl``: the decode path's impl, its Triton kernel on CUDA with "auto"). Other
    documents with fewer queries than keys (bottom-right aligned) run one call each.
    """
    if impl == "reference":
        from .reference import dilated_attention_reference

        def core(qi, ki, vi, kpm=None):
            return dilated_attention_reference(
                qi, ki, vi, seg, dil, causal=causal, softmax_scale=scale, key_padding_mask=kpm,
                dropout_p=p, head_assignment=head_assignment,
            )  # fmt: skip
    else:
        from .kernels.torch_dilated import dilated_attention_torch

        def core(qi, ki, vi, kpm=None):
            return dilated_attention_torch(
                qi, ki, vi, seg, dil, causal=causal, scale=scale, key_padding_mask=kpm,
                dropout_p=p, head_assignment=head_assignment,
            )  # fmt: skip

    nheads, dev = q.shape[1], q.device
    pieces = []  # (first query row, out rows (n, H, D), lse (H, n)) or (dest rows tensor, ...)
    buckets: dict[int, list[tuple[int, int, int]]] = {}
    decoding: dict[int, list[tuple[int, int, int]]] = {}
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    decode_ok = impl == "torch" and p == 0 and not needs_grad
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        if impl == "torch" and n == k1 - k0:
            buckets.setdefault(_bucket(n), []).append((q0, k0, n))
            continue
        if decode_ok and decode_shaped(n, k1 - k0):
            decoding.setdefault(n, []).append((q0, k0, k1 - k0))
            continue
        o, lse = core(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None])
        pieces.append((q0, o[0], lse[0].to(torch.float32)))
    for length, docs in buckets.items():
        if len(docs) == 1 and docs[0][2] == length:  # one document, no padding needed
            q0, k0, n = docs[0]
            o, lse = core(q[q0 : q0 + n][None], k[k0 : k0 + n][None], v[k0 : k0 + n][None])
            pieces.append((q0, o[0], lse[0].to(torch.float32)))
            continue
        t = torch.arange(length)
        qrows = torch.stack([torch.where(t < n, q0 + t, q.shape[0]) for q0, _, n in docs])  # (G, L)
        krows = torch.stack([torch.where(t < n, k0 + t, k.shape[0]) for _, k0, n in docs])
        qrows, krows = qrows.to(dev), krows.to(dev)
        qx = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # the extra row stands for padding
        kx = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
        vx = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
        o, lse = core(qx[qrows], kx[krows], vx[krows], kpm=krows == k.shape[0])  # (G, L, H, D)
        real = (qrows < q.shape[0]).flatten()
        dest = qrows.flatten()[real]
        o = o.reshape(-1, *o.shape[2:])[real]
        lse = lse.to(torch.float32).transpose(0, 1).reshape(nheads, -1)[:, real]
        pieces.append((dest, o, lse))
    if decoding:
        from .decode import decode_core

        kx = torch.cat([k, k.new_zeros(1, *k.shape[1:])])  # the extra row stands for padding
        vx = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
    for n, docs in decoding.items():
        length = max(nk for _, _, nk in docs)
        t = torch.arange(length)
        qrows = torch.stack([q0 + torch.arange(n) for q0, _, _ in docs]).to(dev)  # (G, n)
        krows = torch.stack([torch.where(t < nk, k0 + t, k.shape[0]) for _, k0, nk in docs]).to(dev)
        seqlens = torch.tensor([nk for _, _, nk in docs], dtype=torch.int32).to(dev)
        o, lse = decode_core(
            q[qrows], kx[krows], vx[krows], seqlens, None, seg, dil, causal=causal, scale=scale,
            head_assignment=head_assignment, impl=pick_decode_impl(decode_impl, q),
        )  # fmt: skip
        lse = lse.to(torch.float32).transpose(0, 1).reshape(nheads, -1)
        pieces.append((qrows.flatten(), o.reshape(-1, *o.shape[2:]), lse))
    if not pieces:  # no query anywhere: an empty output, still connected to q, k, v (as SDPA)
        out = connected_empty(q, k, v)
        return out, torch.full((nheads, q.shape[0]), float("-inf"), device=dev)
    if len(pieces) == 1 and isinstance(pieces[0][0], int):
        return pieces[0][1], pieces[0][2]
    dest = torch.cat([
        d if isinstance(d, torch.Tensor) else torch.arange(d, d + o.shape[0], device=dev)
        for d, o, _ in pieces
    ])  # fmt: skip
    order = torch.argsort(dest)  # dest covers every query row once: rows back in order
    out = torch.cat([o for _, o, _ in pieces]).index_select(0, order)
    lse = torch.cat([x for _, _, x in pieces], -1).index_select(1, order)
    return out, lse
