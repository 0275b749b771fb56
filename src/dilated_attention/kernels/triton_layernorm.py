"""LayerNorm over the last dim as Triton kernels, forward and backward, for the models under autocast.

What this module owns: :func:`layer_norm`, the eager path of the LongNet models' LayerNorms
(``models/longnet.py``, ``AutocastLayerNorm``) under a lower-precision autocast when
``flags.set_triton_layernorm(True)``. It exists for the casts around LayerNorm: CUDA autocast
runs ``layer_norm`` in float32 (it is on autocast's float32 list), so each LayerNorm of the
model writes a float32 output that every following Linear casts back to bf16 (q, k and v each
cast the same tensor), a sub-LN on a bf16 activation first upcasts its input, and the backward
pays the mirror casts. Torch's CUDA ``layer_norm`` cannot take a bf16 input with float32
gamma/beta (it reads gamma in the input's dtype), so one kernel here reads any float input,
float32 parameters, and writes the output in the dtype asked for.

Contract (x (..., N) of fp32, bf16 or fp16; weight, bias (N,) of any float dtype, bias
optional; ``out_dtype``):

- forward: every value read is upcast exactly to float32; mean and rstd = 1 / sqrt(var + eps)
  (biased variance) of each row in float32; ``y = (x - mean) * rstd * weight + bias`` in
  float32, rounded once to ``out_dtype``. mean and rstd (float32, one per row) are saved.
- backward (float32 math, dy upcast exactly): ``dx = rstd * (w*dy - mean(w*dy) - xhat *
  mean(xhat * w*dy))`` rounded once to x's dtype; dweight = sum over rows of ``dy * xhat`` and
  dbias = sum of ``dy`` in float32: each program sums its block of rows into one row of a
  (programs, N) float32 buffer, torch sums the buffer's rows (no atomics: the same bits on
  every run on one device), and the result is rounded once to the parameter's dtype.

That is what autocast computes today (``F.layer_norm`` in float32 on the exactly upcast input,
its output rounded to bf16 by the Linear that reads it; float32 parameter gradients) up to the
order of the float32 sums (and sqrt / rsqrt to an ulp of float32). One difference where the
output feeds several consumers (the attention's q, k and v projections): autograd adds their
gradients in the output's dtype (bf16) before the backward reads them, where today's separate
float32 -> bf16 casts have their gradients added in float32, so dy carries one more bf16
rounding there.

No double backward (``once_differentiable``). Under ``torch.compile`` the same launches run as
the custom ops ``dilated_attention::layer_norm`` and ``layer_norm_backward`` (:func:`layer_norm_op`,
fake implementations for tracing), which :func:`layer_norm` calls there (``AutocastLayerNorm``
takes it under the same rule as in eager mode): Inductor's own fusion of the LayerNorm with its casts and the GELU before
it took 17.6 ms per LongNet ``base`` step against 8.8 ms for these kernels eager (2026-11-29, H200,
``results/profile_step_h200_2026-11-29_s32_before.md``; 9.5 ms compiled with the ops, ``..._s32_after.md``).
The module imports without triton;
:func:`unavailable_reason` then says why it cannot run, and ``kernels/select.py`` asks it once
per (device type, dtype, normalized dim) (``backend_reason("triton_layernorm", ...)``). On the
CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from . import direct_launch
from .triton_import import device_reason, tl, triton  # triton, tl: None without triton

# One program holds a whole row (BLOCK_N >= N) in registers. Compiled for sm_90 (Triton 3.6,
# 2026-11-27, without a GPU): no spills up to 8192 (backward 64-128 registers a thread with the
# warps of _num_warps); at 16384 the backward spills even with 16 warps, so wider rows keep
# nn.LayerNorm. The base model's widths: 768 and 3072.
MAX_N = 8192
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _layernorm_fwd_kernel(
        X, Y, W, B, MEAN, RSTD, sx, sy, N, eps,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """One row per program: y = (x - mean) * rstd * w (+ b), float32 math."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / N
        rstd = tl.math.rsqrt(var + eps)  # as torch's CUDA layer_norm (rsqrtf)
        y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _layernorm_bwd_kernel(
        X, DY, DX, W, MEAN, RSTD, DW, DB, M, N, sx, sdy, sdx, rows_per_program,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Rows [pid * rows_per_program, ...) of M, one at a time: dx of each row, and this
        program's partial sums of dw (and db) written to row pid of DW (DB), (programs, N)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        row0 = pid.to(tl.int64) * rows_per_program  # int64 offsets: M * N passes 2^31
        for row in range(row0, tl.minimum(row0 + rows_per_program, M)):
            x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            wdy = w * dy  # 0 beyond N (w and dy loaded as 0 there)
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + row * sdx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            if HAS_BIAS:
                db += dy
        tl.store(DW + pid * N + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(DB + pid * N + cols, db, mask=mask)

    @triton.jit
    def _prologue_ln_kernel(
        X, R, S, Y, W, B, sx, sr, ss, sy, N, eps,
        GELU: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """One row per program, forward only: s = x + r (stored in S's dtype, as torch's add
        rounds it) or s = gelu(x) (exact erf form, rounded to Y's dtype as torch's gelu; not
        stored), then y = LayerNorm(s) as _layernorm_fwd_kernel (float32 math on the rounded
        s)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            g = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
            v = g.to(Y.dtype.element_ty).to(tl.float32)
        else:
            r = tl.load(R + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
            sv = (x + r).to(S.dtype.element_ty)
            tl.store(S + row * ss + cols, sv, mask=mask)
            v = sv.to(tl.float32)
        mean = tl.sum(v, axis=0) / N
        vc = tl.where(mask, v - mean, 0.0)
        var = tl.sum(vc * vc, axis=0) / N
        rstd = tl.math.rsqrt(var + eps)
        y = vc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)

    # eager training calls them for every LayerNorm of every step with the same arguments: after
    # the first call of a shape, the compiled kernel's launcher directly (no JITFunction.run)
    _LN_FWD = direct_launch.DirectKernel(_layernorm_fwd_kernel, 6)
    _LN_BWD = direct_launch.DirectKernel(_layernorm_bwd_kernel, 8)
    # a decode step calls it three times per layer with the same shapes (models/longnet.py)
    _PRO_LN = direct_launch.DirectKernel(_prologue_ln_kernel, 6)


def unavailable_reason(x: torch.Tensor, interpret: bool) -> str | None:
    """Why the LayerNorm kernels cannot run on inputs like ``x`` (normalized over its last dim;
    None if they can)."""
    reason = device_reason(x, interpret)
    if reason is not None:
        return reason
    n = x.shape[-1]
    if not 1 <= n <= MAX_N:
        return f"normalized dim {n} is not supported by the LayerNorm kernel (1 to {MAX_N}); nn.LayerNorm runs"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not supported by the LayerNorm kernel (fp32, bf16, fp16); nn.LayerNorm runs"
    return None


def _num_warps(block_n: int) -> int:
    # Triton's LayerNorm tutorial: a warp per 256 elements of the row, 1 to 8 warps; 16 for 8192
    # (with 8 the backward takes 252-255 registers a thread: one program per SM)
    return 16 if block_n > 4096 else min(max(block_n // 256, 1), 8)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def backward_programs(m: int, n: int, device: torch.device) -> int:
    """Programs of the backward for ``m`` rows of ``n`` (each sums its block of rows into one row
    of the parameter-gradient buffer): on CUDA about 32 warps' worth of them per SM (a program
    walks its rows one by one, so the SM hides the loads' latency with other programs; a guess,
    not yet tuned on a GPU), keeping the buffer small (programs x N float32: 3 and 6 MiB at the
    base model's widths 768 and 3072 on an H100); 8 in the interpreter. Fixed per (m, n,
    device): the same partial sums, so the same bits, on every run."""
    if device.type == "cuda":
        return _cuda_programs(m, n, device.index)
    return max(1, min(m, 8))


@functools.lru_cache(maxsize=256)
def _cuda_programs(m: int, n: int, index: int) -> int:
    """:func:`backward_programs` on CUDA device ``index``, once per shape (the backward of a
    training step asks ~50 times)."""
    per_sm = max(1, 32 // _num_warps(direct_launch.next_power_of_2(n)))
    return max(1, min(m, per_sm * _sm_count(index)))


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t (..., n) as (rows, n) with unit stride along n (a view when it can be one)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _forward(x, weight, bias, eps: float, out_dtype: torch.dtype):
    """(y in out_dtype shaped as x, mean (M,) float32, rstd (M,) float32)."""
    dev = direct_launch.tensor_device(x)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return _forward(x, weight, bias, eps, out_dtype)
    n = x.shape[-1]
    x2 = _rows(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block_n = direct_launch.next_power_of_2(n)
        _LN_FWD[(m,)](
            x2, y, weight, weight if bias is None else bias, mean, rstd, x2.stride(0), n, n, eps,
            HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )  # fmt: skip
    return y.view(x.shape), mean, rstd


def _backward(dy, x, weight, bias, mean, rstd, programs: int | None = None):
    """(dx in x's dtype, dweight, dbias or None in the parameters' dtypes)."""
    dev = direct_launch.tensor_device(x)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return _backward(dy, x, weight, bias, mean, rstd, programs)
    n = x.shape[-1]
    x2, dy2 = _rows(x, n), _rows(dy, n)
    m = x2.shape[0]
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    g = backward_programs(m, n, x.device) if programs is None else max(1, min(m, programs))
    dw = torch.empty((g, n), dtype=torch.float32, device=x.device)
    db = None if bias is None else torch.empty((g, n), dtype=torch.float32, device=x.device)
    if m:
        block_n = direct_launch.next_power_of_2(n)
        _LN_BWD[(g,)](
            x2, dy2, dx, weight, mean, rstd, dw, dw if db is None else db, m, n,
            x2.stride(0), dy2.stride(0), n, -(-m // g),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )  # fmt: skip
    else:
        dw.zero_()
        if db is not None:
            db.zero_()
    # (no .to() call where the parameters are float32, as in the models: the backward of a
    # training step runs this ~50 times, and each op call costs host time)
    dweight = dw.sum(0) if weight.dtype == torch.float32 else dw.sum(0).to(weight.dtype)
    if db is None:
        return dx.view(x.shape), dweight, None
    dbias = db.sum(0) if bias.dtype == torch.float32 else db.sum(0).to(bias.dtype)
    return dx.view(x.shape), dweight, dbias


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        y, mean, rstd = _forward(x, weight, bias, eps, out_dtype)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy, x, weight, bias, mean, rstd)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
                db if ctx.needs_input_grad[2] else None, None, None)  # fmt: skip


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """LayerNorm of x (..., N) over its last dim with weight (N,) and optional bias (N,), the
    output in ``out_dtype`` (default x's dtype), with autograd (see the module docstring for the
    numerics). Callers ask :func:`unavailable_reason` (``select.backend_reason("triton_layernorm",
    ...)``) first; this checks only the shapes and devices."""
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"layer_norm: x (..., N) with weight (N,) and bias (N,) or None, got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
            f"{None if bias is None else tuple(bias.shape)}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(
            f"layer_norm: x, weight and bias must be on one device, got {x.device}, {weight.device} and "
            f"{None if bias is None else bias.device}"
        )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    weight = weight.contiguous()  # no-ops for a module's parameters
    bias = None if bias is None else bias.contiguous()
    if torch.compiler.is_compiling():  # opaque to the tracer, its autograd registered
        return torch.ops.dilated_attention.layer_norm(x, weight, bias, eps, out_dtype)[0]
    if not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        # nothing to record (eval, no_grad): the forward without the autograd.Function machinery
        return _forward(x, weight, bias, eps, out_dtype)[0]
    return _LayerNormFunction.apply(x, weight, bias, eps, out_dtype)


@torch.library.custom_op("dilated_attention::layer_norm", mutates_args=())
def layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The compiled graphs' LayerNorm (module docstring): (y in ``out_dtype`` shaped as x, mean,
    rstd (rows,) float32). Unchecked: :func:`layer_norm` calls it after its checks."""
    return _forward(x, weight, bias, eps, out_dtype)


@layer_norm_op.register_fake
def _(x, weight, bias, eps, out_dtype):
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32))  # fmt: skip


@torch.library.custom_op("dilated_attention::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dx (x's dtype), dweight (weight's dtype) and dbias (bias's dtype; empty (0,) without a
    bias) of :func:`layer_norm_op`."""
    dx, dw, db = _backward(dy, x, weight, bias, mean, rstd)
    return dx, dw, weight.new_empty(0) if db is None else db


@layer_norm_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            weight.new_empty(0) if bias is None else bias.new_empty(bias.shape))  # fmt: skip


def _layer_norm_op_setup(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _layer_norm_op_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward_op(dy, x, weight, bias, mean, rstd)
    return dx, dw, None if bias is None else db, None, None


layer_norm_op.register_autograd(_layer_norm_op_backward, setup_context=_layer_norm_op_setup)


def _prologue_ln(x, r, weight, bias, eps: float, gelu: bool):
    """(s, y) of :func:`add_layer_norm` (r given) or (y, y) of :func:`gelu_layer_norm` (r None),
    contiguous, shaped as x. Unchecked: the models call it with their own tensors (x, r of one
    shape, dtype and device; weight, bias contiguous (N,)); the public functions check first.
    A decode step calls it three times per layer, so it stays short (the launch is direct)."""
    dev = direct_launch.tensor_device(x)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return _prologue_ln(x, r, weight, bias, eps, gelu)
    n = x.shape[-1]
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty_like(x)
    if r is None:
        r = s = y  # R, S unused
    else:
        r = r if r.is_contiguous() else r.contiguous()
        s = torch.empty_like(x)
    m = x.numel() // n
    if m:
        block_n = direct_launch.next_power_of_2(n)
        _PRO_LN[(m,)](
            x, r, s, y, weight, weight if bias is None else bias, n, n, n, n, n, eps,
            GELU=gelu, HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )  # fmt: skip
    return s, y


def _check_inference(name, tensors, weight, bias):
    x = tensors[0]
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or any(t.shape != x.shape for t in tensors) or weight.shape != (n,) or (
        bias is not None and bias.shape != (n,)
    ):
        raise ValueError(
            f"{name}: inputs (..., N) of one shape with weight (N,) and bias (N,) or None, got "
            f"{[tuple(t.shape) for t in tensors]}, weight {tuple(weight.shape)}, bias "
            f"{None if bias is None else tuple(bias.shape)}"
        )
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors) or weight.device != x.device or (
        bias is not None and bias.device != x.device
    ):
        raise ValueError(f"{name}: inputs of one dtype and, with weight and bias, on one device")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, weight, *(() if bias is None else (bias,)))):
        raise ValueError(f"{name} is inference only (no autograd): call it under torch.no_grad()")


def add_layer_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r`` and ``LayerNorm(s)`` in one launch, inference only: x, r (..., N) of one
    dtype -> (s, y), both in that dtype. s has the bits of ``x + r``; y is ``F.layer_norm(s, ...)``
    up to the order of the float32 sums (the forward kernel's numerics). For a decode step's
    residual add and the next LayerNorm (``models/longnet.py``); callers ask
    :func:`unavailable_reason` first."""
    _check_inference("add_layer_norm", (x, r), weight, bias)
    return _prologue_ln(x, r, weight.contiguous(), None if bias is None else bias.contiguous(), eps, False)


def gelu_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``LayerNorm(gelu(x))`` in one launch, inference only (x (..., N), the output in x's
    dtype): gelu in its exact erf form rounded to x's dtype as ``F.gelu`` rounds it (to an ulp of
    float32's erf before that rounding), then the LayerNorm as :func:`add_layer_norm`'s. The
    FFN's sub-LayerNorm in a decode step."""
    _check_inference("gelu_layer_norm", (x,), weight, bias)
    return _prologue_ln(x, None, weight.contiguous(), None if bias is None else bias.contiguous(), eps, True)[1]
