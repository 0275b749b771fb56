"""``impl="triton"``: the fused Triton kernels as torch custom ops, with autograd.

Layers, as flash-attention's interface: ``triton_kernels.py`` (the ``@triton.jit`` kernels) ->
``triton_launch.py`` (configs, grids, buffers) -> this module: the custom ops
``dilated_attention::triton_fwd`` and ``dilated_attention::triton_bwd`` (fake implementations
for ``torch.compile``, ``register_autograd`` on the forward; eager calls skip them through
:class:`_EagerFused`) -> :func:`triton_forward` / :func:`triton_backward` (the one entry point
into the kernels for other layers, e.g. sequence-parallel's fused local blocks),
:data:`fused_apply` with a :class:`FusedCall` (``api.py``'s fused route, kept by the front
door's fast path) and :func:`dilated_attention_triton` (benchmarks).

This module imports without triton; :func:`unavailable_reason` then says why it cannot run. On
the CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is first imported; the mode is fixed for the process from then on).

LSE contract: float32, natural log, ``(batch, nheads, seqlen_q)``; a query with no key gets
``out = 0`` and ``lse = -inf`` and zero gradients (never NaN). Math: docs/spec.md.
"""

from __future__ import annotations

import math

import torch

from .. import flags
from ..autograd_rules import backward_context, no_double_backward
from ..branches import branch_head_ranges
from .triton_import import device_reason, interpreter_bf16_reason

try:  # triton is an optional dependency: this module must import without it
    from . import triton_launch as _launch

    _TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the environment
    _launch = None
    _TRITON_IMPORT_ERROR = str(e)

SUPPORTED_HEADDIMS = (16, 32, 64, 128)


def unavailable_reason(q: torch.Tensor, k: torch.Tensor | None = None) -> str | None:
    """Why the Triton kernel cannot run on these inputs, or None if it can."""
    if _TRITON_IMPORT_ERROR is not None:
        return f"the triton package is not importable ({_TRITON_IMPORT_ERROR}); pip install 'dilated-attention[triton]'"
    # triton_launch.INTERPRET is triton_import.INTERPRET (the one check), read here at call time
    reason = device_reason(q, _launch.INTERPRET)
    if reason is not None:
        return reason
    d = q.shape[-1]
    if d not in SUPPORTED_HEADDIMS:
        return f"headdim {d} is not supported by the triton kernel (supported: {SUPPORTED_HEADDIMS}); use impl='torch'"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the triton kernel (fp16, bf16, fp32); use impl='torch' or 'reference'"
    reason = interpreter_bf16_reason(q, _launch.INTERPRET, "triton kernel")
    if reason is not None:
        return reason
    if k is not None and k.shape[-1] != d:
        return f"k headdim {k.shape[-1]} differs from q headdim {d}"
    return None


# ---------------------------------------------------------------------------------- torch ops
def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # the kernels address rows and heads by stride but assume unit stride along headdim
    return x if x.stride(-1) == 1 else x.contiguous()


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _fwd_impl(q, k, v, key_padding_mask, segment_lengths, dilation_rates, head_ranges, causal,
              scale):
    # the custom op's forward (torch.compile); eager calls: _fused_forward
    return _launch.forward(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
        key_padding_mask, segment_lengths, dilation_rates, causal, scale, _pairs(head_ranges),
    )


def _bwd_impl(dout, q, k, v, key_padding_mask, out, lse, segment_lengths, dilation_rates,
              head_ranges, causal, scale):
    # the custom op's backward and triton_backward's (the plan looked up)
    return _launch.backward(
        dout, _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
        key_padding_mask, out, lse.contiguous(), segment_lengths, dilation_rates, causal, scale,
        _pairs(head_ranges),
    )


@torch.library.custom_op("dilated_attention::triton_fwd", mutates_args=())
def _triton_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    head_ranges: list[int],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, key_padding_mask, segment_lengths, dilation_rates, head_ranges,
                     causal, scale)


@_triton_fwd_op.register_fake
def _(q, k, v, key_padding_mask, segment_lengths, dilation_rates, head_ranges, causal, scale):
    b, nq, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, nq), dtype=torch.float32)


@torch.library.custom_op("dilated_attention::triton_bwd", mutates_args=())
def _triton_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    head_ranges: list[int],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(dout, q, k, v, key_padding_mask, out, lse, segment_lengths, dilation_rates,
                     head_ranges, causal, scale)


@_triton_bwd_op.register_fake
def _(dout, q, k, v, key_padding_mask, out, lse, segment_lengths, dilation_rates, head_ranges,
      causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kpm, seg, dil, hr, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, kpm, out, lse)
    ctx.args = (seg, dil, hr, causal, scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    if dout is None:  # no gradient reached out (grads not materialized): none for the inputs
        return (None,) * 9
    q, k, v, kpm, out, lse = ctx.saved_tensors
    seg, dil, hr, causal, scale = ctx.args
    with backward_context(q.device.type):
        grads = _triton_bwd_op(dout, q, k, v, kpm, out, lse, seg, dil, hr, causal, scale)
    dq, dk, dv = no_double_backward("impl='triton'", tuple(grads), (dout, q, k, v))
    return dq, dk, dv, None, None, None, None, None, None


_triton_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class FusedCall:
    """The static part of one eager fused call, as :class:`_EagerFused` takes it: the branches,
    the head range of each, causal and scale in one object (one argument of ``Function.apply``
    instead of five), and the launch plan of the first call that ran with it (a memo: the
    object serves one tensor layout, so that plan is its plan while the plan switches are as
    they were; see :func:`_fused_forward`). ``triton_forward`` builds one per call; the front
    door's fast path (``call_cache.py``) keeps one per call configuration.

    ``head_ranges``: [(head start, head stop)] per branch (global head indices, may be empty)."""

    __slots__ = ("seg", "dil", "pairs", "causal", "scale", "plan", "plan_table", "plan_knobs")

    def __init__(self, segment_lengths, dilation_rates, head_ranges, causal: bool, scale: float):
        self.seg = tuple(int(w) for w in segment_lengths)
        self.dil = tuple(int(r) for r in dilation_rates)
        self.pairs = tuple((int(hs), int(he)) for hs, he in head_ranges)
        self.causal, self.scale = bool(causal), float(scale)
        self.plan = None  # the memo (None: look the plan up)
        self.plan_table = self.plan_knobs = None  # see _plan_knobs


def _plan_knobs() -> tuple:
    # what decides whether a call gets a plan, and which, beyond the call's own arguments: the
    # switch, the lo-range knobs and the short-block configs (plan_key holds them); the memo
    # also remembers the plan table it came from (a test or a tool that swaps a fresh table in
    # gets its plans built); the Gluon forward's switch: a memo taken while it was off must not
    # outlive turning it on
    return (_launch.USE_PLANS, _launch.LO_CHUNKS, _launch.LO_MIN_BYTES, _launch.SHORT_D64,
            flags.gluon_forward_enabled())  # fmt: skip


def _fused_forward(q, k, v, kpm, fc: FusedCall):
    """(out, lse, plan) of an eager call: the plan memo of ``fc`` while the plan table and
    knobs are those it was taken under, else ``triton_launch.forward`` (the plan lookup, or the
    per-call path), whose plan becomes the memo. Both run ``plan.forward`` on the same tensors:
    the same bits."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    plan = fc.plan
    if plan is not None and fc.plan_table is _launch._PLANS and fc.plan_knobs == _plan_knobs():
        out, lse = plan.forward(q, k, v, kpm)
        return out, lse, plan
    sink: list = []
    out, lse = _launch.forward(q, k, v, kpm, fc.seg, fc.dil, fc.causal, fc.scale, fc.pairs,
                               plan_sink=sink)  # fmt: skip
    fc.plan, fc.plan_table, fc.plan_knobs = sink[0], _launch._PLANS, _plan_knobs()
    return out, lse, sink[0]


class _EagerFused(torch.autograd.Function):
    """The same forward and backward as the custom op, called directly in eager mode: a
    ``torch.library.custom_op`` call costs tens of microseconds of Python dispatch per call
    (issue 23: ~1.1 ms per training step), an autograd.Function a few. Under ``torch.compile``
    the custom op is used (it has the fake implementation the tracer needs).

    Lean on purpose (issue 23 item 3, the host cost of a training call): five arguments (the
    static ones in one :class:`FusedCall`), five gradient slots, the forward's plan kept in ctx
    so the backward launches without a lookup or a re-derivation. Called through
    :data:`fused_apply`."""

    @staticmethod
    def forward(ctx, q, k, v, kpm, fc):
        out, lse, plan = _fused_forward(q, k, v, kpm, fc)
        ctx.save_for_backward(q, k, v, kpm, out, lse)
        ctx.fc, ctx.plan = fc, plan
        ctx.mark_non_differentiable(lse)
        # lse's gradient is never used: without this autograd would allocate zeros for it
        # at every backward (one float32 per query row and head)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached out (grads not materialized): none for the inputs
            return None, None, None, None, None
        q, k, v, kpm, out, lse = ctx.saved_tensors
        plan, fc = ctx.plan, ctx.fc
        with backward_context(q.device.type):
            q2, k2, v2 = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
            if plan is not None and _launch.USE_PLANS:
                # what triton_launch.backward does with the forward's plan (its checks hold:
                # no config, lo_rows or documents here; lse is the forward's, contiguous): the
                # Gluon backward where it applies (off by default), else the plan
                grads = _launch.gluon_backward(dout, q2, k2, v2, kpm, out, lse, fc.seg, fc.dil,
                                               fc.causal, fc.scale, fc.pairs)  # fmt: skip
                if grads is None:
                    grads = plan.backward(dout, q2, k2, v2, kpm, out, lse)
            else:  # (it asks the Gluon backward first itself)
                grads = _launch.backward(dout, q2, k2, v2, kpm, out, lse, fc.seg, fc.dil, fc.causal,
                                         fc.scale, fc.pairs)  # fmt: skip
        dq, dk, dv = no_double_backward("impl='triton'", tuple(grads), (dout, q, k, v))
        return dq, dk, dv, None, None


def _direct_apply():
    """``_EagerFused.apply`` without ``Function.apply``'s Python wrapper, or None where this
    torch lacks a piece of it (then the public ``_EagerFused.apply`` is used).

    The wrapper (torch/autograd/function.py, ``Function.apply``) binds default arguments only
    for a Function that defines ``setup_context`` (this one does not: checked here), sends
    calls made under functorch transforms to ``custom_function_call``, and otherwise unwraps
    dead functorch wrappers of the tensor arguments (``unwrap_dead_wrappers``: a generator over
    every argument) before the C ``apply``. The function returned does the same for the four
    tensor arguments and goes to the public apply whenever a transform is active."""
    try:
        c_apply = super(torch.autograd.Function, _EagerFused).apply
        transforms_active = torch._C._are_functorch_transforms_active
        unwrap = torch._C._functorch.unwrap_if_dead
        plain = _EagerFused.setup_context is torch.autograd.Function.setup_context
    except AttributeError:
        return None
    if not plain:
        return None

    def apply(q, k, v, kpm, fc):
        if transforms_active():
            return _EagerFused.apply(q, k, v, kpm, fc)
        return c_apply(unwrap(q), unwrap(k), unwrap(v), None if kpm is None else unwrap(kpm), fc)

    return apply


# (q, k, v, key_padding_mask, FusedCall) -> (out, lse): the eager fused call, autograd included
fused_apply = _direct_apply() or _EagerFused.apply


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ------------------------------------------------------------------ packed documents (varlen)
def _docs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, offsets_checked):
    # int32 offsets as the kernels read them: contiguous, since the kernels load cu[i] with unit
    # stride (a no-op for the contiguous int32 tensors the API asks for; a strided view, e.g. a
    # column of a (docs + 1, 2) table, is copied instead of read as its storage's first entries)
    return _launch.Docs(
        cu_seqlens_q.to(torch.int32).contiguous(), cu_seqlens_k.to(torch.int32).contiguous(),
        int(max_seqlen_q), int(max_seqlen_k), bool(offsets_checked),
    )


@torch.library.custom_op("dilated_attention::triton_varlen_fwd", mutates_args=())
def _triton_varlen_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    segment_lengths: list[int],
    dilation_rates: list[int],
    head_ranges: list[int],
    causal: bool,
    scale: float,
    offsets_checked: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            segment_lengths, dilation_rates, head_ranges, causal, scale,
                            offsets_checked)  # fmt: skip


def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     segment_lengths, dilation_rates, head_ranges, causal, scale,
                     offsets_checked):  # fmt: skip
    # (total, H, D) -> (1, total, H, D): the batch kernels with the document offsets as input
    out, lse = _launch.forward(
        _last_dim_contiguous(q)[None], _last_dim_contiguous(k)[None],
        _last_dim_contiguous(v)[None], None, segment_lengths, dilation_rates, causal, scale,
        _pairs(head_ranges),
        docs=_docs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, offsets_checked),
    )
    return out[0], lse[0]


def _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, segment_lengths, dilation_rates, head_ranges, causal, scale,
                     offsets_checked):  # fmt: skip
    dq, dk, dv = _launch.backward(
        dout[None], _last_dim_contiguous(q)[None], _last_dim_contiguous(k)[None],
        _last_dim_contiguous(v)[None], None, out[None], lse.contiguous()[None], segment_lengths,
        dilation_rates, causal, scale, _pairs(head_ranges),
        docs=_docs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, offsets_checked),
    )
    return dq[0], dk[0], dv[0]


@_triton_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, segment_lengths,
      dilation_rates, head_ranges, causal, scale, offsets_checked):
    total, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((h, total), dtype=torch.float32)


@torch.library.custom_op("dilated_attention::triton_varlen_bwd", mutates_args=())
def _triton_varlen_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    segment_lengths: list[int],
    dilation_rates: list[int],
    head_ranges: list[int],
    causal: bool,
    scale: float,
    offsets_checked: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, segment_lengths, dilation_rates, head_ranges, causal,
                            scale, offsets_checked)


@_triton_varlen_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      segment_lengths, dilation_rates, head_ranges, causal, scale, offsets_checked):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, seg, dil, hr, causal, scale, checked = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
    ctx.args = (max_q, max_k, seg, dil, hr, causal, scale, checked)
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, _dlse, bwd=None):
    if dout is None:  # as _backward
        return (None,) * 13
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    with backward_context(q.device.type):
        grads = (bwd or _triton_varlen_bwd_op)(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    dq, dk, dv = no_double_backward("impl='triton'", tuple(grads), (dout, q, k, v))
    return dq, dk, dv, *([None] * 10)


_triton_varlen_fwd_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class _EagerVarlen(torch.autograd.Function):
    """:class:`_EagerFused` for packed documents."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _varlen_fwd_impl(*inputs)
        _varlen_setup_context(ctx, inputs, (out, lse))
        ctx.set_materialize_grads(False)  # as _EagerFused
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _varlen_backward(ctx, dout, dlse, bwd=_varlen_bwd_impl)


def dilated_attention_triton_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    segment_lengths,
    dilation_rates,
    *,
    causal: bool,
    scale: float,
    head_assignment: str,
    offsets_checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents through the fused kernels (validated inputs only: see varlen.py).

    q: (total_q, H, D); k, v: (total_k, Hkv, D); cu_seqlens_q / cu_seqlens_k: int32 device
    tensors (docs + 1) of document offsets (0 first, total last, non-decreasing, no document
    with more queries than keys); max_seqlen_q / max_seqlen_k: Python ints >= every document's
    length (they size the blocks per segment; the offsets are never read on the host).
    Document i is its own sequence: its segments start at its first key row, its queries are
    bottom-right aligned in it, causal is within it, nothing crosses a document boundary.

    Returns out (total_q, H, D) in q's dtype and lse (H, total_q) float32 (not
    differentiable); out is differentiable in q, k, v. One launch per branch and kernel, never
    one per document: the grid is flat, total_k // u + docs slots per branch (u: a block's
    r * block key rows, or a segment's w), each program finding its document in the offsets
    (triton_kernels.py, "Packed documents").

    ``offsets_checked``: True only where the caller has checked these offsets' values on the
    host (``checks.check_cu_seqlens_values`` against q's and k's rows and the max lengths, as
    the front door does for CPU offsets and ``check_offsets=True``): then every row belongs to
    a document and the results are allocated without zero-fills where the first branch stores
    them all (``triton_launch.Docs.checked``). False (unchecked device offsets): rows past the
    last document read as zeros (out 0, lse -inf, zero gradients), at the cost of the fills.
    """
    ranges = branch_head_ranges(q.shape[1], len(segment_lengths), head_assignment)
    op = _triton_varlen_fwd_op if _compiling() else _EagerVarlen.apply
    return op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
        [int(w) for w in segment_lengths], [int(r) for r in dilation_rates], _flat(ranges),
        bool(causal), float(scale), bool(offsets_checked),
    )


# ------------------------------------------------------------------------ entry points
def _flat(head_ranges) -> list[int]:
    return [int(x) for hr in head_ranges for x in hr]


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths,
    dilation_rates,
    head_ranges,
    *,
    causal: bool,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.dilated_attention.triton_fwd`` over the branches given (validated inputs).

    q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool, True = pad;
    head_ranges: [(head start, head stop)] per branch (global head indices, may be empty).
    Returns out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) float32 of those branches only;
    differentiable in q, k, v through the registered autograd. Eager calls skip the custom
    op's dispatch (:class:`_EagerFused`: same functions); torch.compile traces the custom op.
    """
    if _compiling():
        return _triton_fwd_op(
            q, k, v, key_padding_mask, [int(w) for w in segment_lengths],
            [int(r) for r in dilation_rates], _flat(head_ranges), bool(causal), float(scale),
        )
    return fused_apply(q, k, v, key_padding_mask,
                       FusedCall(segment_lengths, dilation_rates, head_ranges, causal, scale))  # fmt: skip


def triton_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segment_lengths,
    dilation_rates,
    head_ranges,
    *,
    causal: bool,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.dilated_attention.triton_bwd``: dq, dk, dv (input dtypes) of the branches
    given, from the FINAL out (B, Nq, H, D) and lse (B, H, Nq) float32, which may include
    branches not given here (every branch's share of the gradient is independent)."""
    op = _triton_bwd_op if _compiling() else _bwd_impl
    return op(
        dout, q, k, v, key_padding_mask, out, lse, [int(w) for w in segment_lengths],
        [int(r) for r in dilation_rates], _flat(head_ranges), bool(causal), float(scale),
    )


def dilated_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    *,
    causal: bool,
    scale: float,
    key_padding_mask: torch.Tensor | None,
    head_assignment: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs only (see api.py).

    q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool, True = pad.
    Returns out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) float32 (not differentiable).
    """
    reason = unavailable_reason(q, k)
    if reason is not None:
        raise ValueError(f"impl='triton' cannot run here: {reason}")
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    ranges = branch_head_ranges(q.shape[2], len(segment_lengths), head_assignment)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    return triton_forward(
        q, k, v, segment_lengths, dilation_rates, ranges, causal=causal, scale=scale,
        key_padding_mask=key_padding_mask,
    )
