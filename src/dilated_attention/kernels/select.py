"""Which implementation runs a call: the names, their availability, and every ``auto`` rule.

The one place that knows the implementation names (:data:`IMPLS`), validates an ``impl``
argument (:func:`check_impl`), answers whether a backend can run (:func:`backend_reason`: one
answer per backend, device type, dtype and head dim, with its reason, computed once per process)
and picks the implementation of a call: dense single-device calls (:func:`pick_impl`), the
decode path (:func:`pick_decode_impl`, and :func:`decode_applies` for the short queries that
``dilated_attention`` routes to it), packed documents (:func:`pick_varlen_impl`) and the local
blocks of sequence-parallel attention (:func:`pick_sp_local_impl`). Whether Triton runs in its
interpreter is asked once (:func:`interpreting`). An explicitly requested ``impl`` never
silently falls back: it runs or raises an error that gives the reason.
"""

from __future__ import annotations

import torch

IMPLS = ("auto", "reference", "torch", "triton")
DECODE_IMPLS = ("auto", "torch", "triton")
MAX_DECODE_ROWS = 64  # the decode kernel walks the query rows one by one: a few new tokens

def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``; the CPU, for
    tests) in this process: the one interpreter check of the package. Answered once, at the
    first question (not at import: test modules set the variable before their first call), by
    Triton itself (``kernels.triton_import.INTERPRET``: what ``triton.jit`` makes), so it reads
    the variable as Triton does and agrees with the kernels that are defined. False without
    triton."""
    from .triton_import import INTERPRET  # fixed there, at its import

    return INTERPRET


def check_impl(impl) -> str:
    """``impl`` if it is one of :data:`IMPLS`, else a ``ValueError`` listing them."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


# (backend, device type, dtype, headdim) -> None (it can run) or the reason it cannot
_REASONS: dict[tuple, str | None] = {}


def _compute_reason(backend: str, device_type: str, dtype: torch.dtype, headdim: int) -> str | None:
    probe = torch.empty(0, 0, 0, headdim, dtype=dtype, device=device_type)
    # each module imported when asked (plain import statements, which torch.compile can trace),
    # so that importing the package never needs triton
    try:
        if backend == "triton":
            from . import triton_ops as kernel
        elif backend == "triton_decode":
            from . import triton_decode as kernel
        elif backend == "triton_rotary":
            from . import triton_rotary as kernel
        elif backend == "triton_ce":
            from . import triton_ce as kernel
        elif backend == "triton_layernorm":  # headdim: the normalized dim
            from . import triton_layernorm as kernel
        else:
            raise ValueError(f"unknown backend {backend!r}")
    except ImportError as e:  # triton not installed
        return f"the triton package is not importable ({e}); pip install 'dilated-attention[triton]'"
    if backend == "triton":
        return kernel.unavailable_reason(probe)
    return kernel.unavailable_reason(probe, interpreting())


def backend_reason(backend: str, device_type: str, dtype: torch.dtype, headdim: int) -> str | None:
    """Why ``backend`` (``"triton"``: the fused kernel; ``"triton_decode"``: the decode kernel;
    ``"triton_rotary"``: the rotary kernel of the models; ``"triton_ce"``: the cross-entropy
    kernel of the fused LM loss, head dim 0; ``"triton_layernorm"``: the LayerNorm kernels of the
    models, ``headdim`` then the normalized dim) cannot run on inputs of this device type, dtype
    and head dim (None if it can). Decided once per process for each key."""
    key = (backend, device_type, dtype, headdim)
    if key in _REASONS:
        return _REASONS[key]
    reason = _compute_reason(backend, device_type, dtype, headdim)
    _REASONS[key] = reason
    return reason


def triton_unavailable_reason(q: torch.Tensor, k: torch.Tensor | None = None) -> str | None:
    """Why impl='triton' cannot run for these inputs (None if it can)."""
    if k is not None and k.shape[-1] != q.shape[-1]:
        return f"k headdim {k.shape[-1]} differs from q headdim {q.shape[-1]}"
    return backend_reason("triton", q.device.type, q.dtype, q.shape[-1])


def available_impls(q: torch.Tensor | None = None) -> list[str]:
    """The implementations that can run for inputs like ``q`` (default: a CUDA bf16 probe if any)."""
    out = ["reference", "torch"]
    if q is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        q = torch.empty(1, 1, 1, 64, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    if triton_unavailable_reason(q) is None:
        out.append("triton")
    return out


# CallShape -> "torch" / "triton": the measured rule, evaluated once per distinct call shape
_AUTO_CHOICES: dict = {}


def pick_impl(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    dropout_p: float,
    *,
    causal: bool = False,
    segment_lengths=None,
    dilation_rates=None,
    requires_grad: bool | None = None,
) -> str:
    """The implementation of a single-device call: ``"reference"``, ``"torch"`` or ``"triton"``.

    ``"auto"``: the torch path with dropout (the kernel has none), off CUDA, or where the kernel
    cannot run; otherwise :func:`auto_rule.choose_impl`, the rule measured by
    benchmarks/sweep.py (the impl that was fastest on the nearest measured configuration, judged
    by forward time for calls without gradients and forward+backward time for training calls),
    evaluated once per distinct call shape. Without the branches (``segment_lengths`` /
    ``dilation_rates`` None) and inside ``torch.compile`` (shapes may be symbolic) the kernel is
    chosen. ``"triton"`` raises ``ValueError`` with the reason when the kernel cannot run or
    ``dropout_p > 0``.
    """
    if impl == "reference" or impl == "torch":
        return impl
    if impl == "triton":
        reason = triton_unavailable_reason(q, k)
        if reason is None and dropout_p > 0:
            reason = "the triton kernel has no dropout; use impl='torch' or 'auto' for dropout_p > 0"
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run here: {reason}")
        return "triton"
    check_impl(impl)
    # auto: never the Triton interpreter (TRITON_INTERPRET=1 on the CPU): it is for tests, and far
    # slower than the torch path
    if dropout_p > 0 or not q.is_cuda or triton_unavailable_reason(q, k) is not None:
        return "torch"
    if segment_lengths is None or dilation_rates is None or torch.compiler.is_compiling():
        # under torch.compile the shapes may be symbolic: evaluating the measured rule on
        # them would specialise (recompile) per length, so the fused kernel is taken
        return "triton"
    from .auto_rule import CallShape, choose_impl, dtype_name

    if requires_grad is None:
        requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    shape = CallShape(
        q.shape[0], k.shape[1], q.shape[2], k.shape[2], q.shape[3], dtype_name(q.dtype),
        tuple(zip(segment_lengths, dilation_rates, strict=True)), bool(causal), bool(requires_grad),
    )
    choice = _AUTO_CHOICES.get(shape)
    if choice is None:
        choice = choose_impl(shape)
        if len(_AUTO_CHOICES) >= 4096:
            _AUTO_CHOICES.clear()
        _AUTO_CHOICES[shape] = choice
    return choice


def pick_varlen_impl(impl: str, q: torch.Tensor, k: torch.Tensor, dropout_p: float,
                     name: str = "dilated_attention_varlen") -> str:  # fmt: skip
    """The implementation of a packed (varlen) call, q (total_q, H, D) and k (total_k, Hkv, D):
    ``"reference"``, ``"torch"`` or ``"triton"``.

    ``"auto"``: the packed Triton kernel (one launch per branch over every document) on CUDA
    where it can run and without dropout, else the torch path (documents batched by padded
    length). Not a measured per-shape rule like :func:`pick_impl`'s: the only measurement is the
    packed kernel against padding every document to the longest (4.1-4.8x faster, H100,
    benchmarks/results/varlen_h100_2026-11-27*.md). ``"triton"`` raises ``ValueError`` with the
    reason when the kernel cannot run or ``dropout_p > 0``.
    """
    try:  # the dense rule without branches: the kernel wherever it can run
        return pick_impl(impl, q[None], k[None], dropout_p)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def decode_shaped(nq: int, nk: int) -> bool:
    """The decode path's shape rule, the one copy of it: a few query rows (at most
    :data:`MAX_DECODE_ROWS`) against more keys."""
    # nk > nq first: for self-attention under torch.compile(dynamic=True) it is decided without a
    # guard (same symbol), so nq's size never guards (no recompile at MAX_DECODE_ROWS)
    return nk > nq and nq <= MAX_DECODE_ROWS


def decode_applies(nq: int, nk: int, has_key_padding_mask: bool, dropout_p: float, needs_grad: bool) -> bool:
    """Whether ``dilated_attention(q, k, v, ...)`` takes the decode path: decode-shaped
    (:func:`decode_shaped`), no padding mask, no dropout, no gradient needed."""
    return decode_shaped(nq, nk) and not has_key_padding_mask and dropout_p == 0 and not needs_grad


def pick_decode_impl(impl: str, q: torch.Tensor) -> str:
    """The decode implementation, ``"torch"`` or ``"triton"``, for ``impl`` in :data:`DECODE_IMPLS`.

    ``"auto"``: the Triton decode kernel on CUDA where it can run (never the interpreter), else
    the torch path. ``"triton"`` raises ``ValueError`` with the reason when the kernel cannot run.
    """
    if impl == "torch":
        return "torch"
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
    reason = backend_reason("triton_decode", q.device.type, q.dtype, q.shape[-1])
    if impl == "triton":
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run here: {reason}")
        return "triton"
    return "triton" if reason is None and q.is_cuda else "torch"


def pick_sp_local_impl(impl: str, q: torch.Tensor, k: torch.Tensor, causal: bool = False) -> str:
    """The kernel for a rank's local blocks in sequence-parallel attention: "torch" or "triton".

    - ``"torch"``: every block runs :mod:`.block_attention` on gathered/strided rows.
    - ``"triton"``: the own-row blocks of the branches aligned with the rank's shard start run in
      one fused Triton call; raises ``ValueError`` naming the reason when the kernel cannot run
      (no triton, not CUDA, headdim or dtype unsupported).
    - ``"auto"``: ``"triton"`` where it can run and either ``causal`` or no gradient is needed
      (measured faster there; benchmarks/bench_sequence_parallel.py ``--impl`` and its results
      file), else ``"torch"`` (non-causal training measured faster with the torch kernels).
      Ranks that disagree (e.g. one without triton) stay exact, only slower.
    - ``"reference"``: not available with a group (``ValueError``).
    """
    check_impl(impl)
    if impl == "triton":
        reason = triton_unavailable_reason(q, k)
        if reason is not None:
            raise ValueError(
                f"impl='triton' cannot run here with group= (sequence-parallel): {reason}; "
                "use impl='torch' or 'auto' (torch kernels for the local blocks)"
            )
        return "triton"
    if impl == "auto":
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k))
        if (causal or not needs_grad) and triton_unavailable_reason(q, k) is None:
            return "triton"
        return "torch"
    if impl == "torch":
        return "torch"
    raise ValueError(
        f"impl={impl!r} is not available with group= (sequence-parallel): the local blocks run "
        "the torch attention kernels ('torch', 'auto') or the fused Triton kernel ('triton')"
    )
