"""Cross-entropy of one chunk of logits and its gradient in one Triton kernel (in place).

What this module owns: :func:`ce_loss_grad_`, the inner step of the fused LM loss
(``models/linear_ce.py``, ``_LinearCrossEntropy.forward``) on CUDA. Given one chunk's logits
(rows, V) in the head matmul's dtype (bf16 / fp16 under autocast, else fp32), the targets
(rows,) and ``ignore_index``, one launch computes, per row r with target t:

    loss[r]       = lse(x_r) - x_r[t]                    (0 where t == ignore_index)
    logits[r, :]  = softmax(x_r) - onehot(t)             (0 where t == ignore_index)

the gradient written over the logits (in place), so the chunk never has a float32 (rows, V)
copy: the torch path it replaces materialises one and makes about six passes over it
(cast, logsumexp, gather, sub_, exp_, scatter_add_, mul_, cast back). One program per row,
two passes over the row inside the kernel, each blocked over V in ``BLOCK_V`` columns:

1. online max / sum-exp: per block ``m' = max(m, max(x))``, ``s = s * exp(m - m') +
   sum(exp(x - m'))``; then ``lse = m + log(s)``, and ``x[t]`` is read (before pass 2
   overwrites it);
2. ``p = exp(x - lse)``, minus 1 at column t, stored in the logits' dtype.

Numerics contract: every value is read in the logits' dtype and widened to float32; the max,
the sum of exponentials, lse, the loss and the softmax are float32 (no rounding between them;
``exp`` is the GPU's fast float32 exponential, so a last-bit difference from torch's
``logsumexp`` is possible); the loss (rows,) is stored in float32; the gradient is rounded once,
from float32 to the logits' dtype, at the store -- exactly where the torch path rounds it
(``g.to(cdtype)`` of a float32 ``g``). Since the logits reaching the torch path are those same
dtype values widened, both paths compute the same float32 formula on the same inputs. (Triton's
interpreter, used by the CPU tests, rounds float32 to bfloat16 by truncation rather than to
nearest: one bf16 ulp there.)

Targets: a target outside [0, V) that is not ``ignore_index`` gives a NaN loss for its row (the
torch path raises; a kernel cannot, and never reads outside the row) and the row's gradient is
its softmax. Float64 is not supported (the torch path runs).

Under ``torch.compile`` it runs inside the custom op ``dilated_attention::linear_ce``
(``models/linear_ce.py``), opaque to the tracer. The module imports without
triton; :func:`unavailable_reason` then says why it cannot run, and ``kernels/select.py`` asks it
once per (device type, dtype) (``backend_reason("triton_ce", ...)``). On the CPU the kernel runs
only in Triton's interpreter (``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import torch

from . import direct_launch
from .triton_import import device_reason, tl, triton  # triton, tl: None without triton

# Columns per block: 4096 float32 values over 8 warps is 16 per thread (a few registers each for
# x, the exponentials and the mask); a 50304-word vocabulary is 13 blocks per pass.
MAX_BLOCK_V = 4096
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if triton is not None:

    @triton.jit
    def _ce_loss_grad_kernel(
        X, T, LOSS, V, stride_x, ignore_index,
        BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
    ):  # fmt: skip
        """One row per program: LOSS[row] (float32) and, with WRITE_GRAD, the row's gradient
        over X (in X's dtype)."""
        row = tl.program_id(0)
        x_row = X + row.to(tl.int64) * stride_x  # int64: rows * V passes 2^31 at ~43K rows
        t = tl.load(T + row)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        cols = tl.arange(0, BLOCK_V)
        # pass 1: the row's max m and sum of exp(x - m), block by block
        m = -float("inf")
        s = 0.0
        for start in range(0, V, BLOCK_V):
            c = start + cols
            x = tl.load(x_row + c, mask=c < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        picked = tl.load(x_row + tl.where(in_range, t, 0)).to(tl.float32)  # read before pass 2
        loss = tl.where(in_range, lse - picked, float("nan"))
        tl.store(LOSS + row, tl.where(valid, loss, 0.0))
        if WRITE_GRAD:
            # pass 2: softmax - onehot(t) over the logits, 0 for an ignored row
            for start in range(0, V, BLOCK_V):
                c = start + cols
                cmask = c < V
                x = tl.load(x_row + c, mask=cmask, other=0.0).to(tl.float32)
                p = tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)
                p = tl.where(valid, p, 0.0)
                tl.store(x_row + c, p.to(X.dtype.element_ty), mask=cmask)

    # one launch per loss chunk with the same arguments from step to step: after the first call
    # of a shape, the compiled kernel's launcher directly (no JITFunction.run)
    _CE = direct_launch.DirectKernel(_ce_loss_grad_kernel, 3)


def unavailable_reason(x: torch.Tensor, interpret: bool) -> str | None:
    """Why the cross-entropy kernel cannot run on logits like ``x`` (None if it can)."""
    reason = device_reason(x, interpret)
    if reason is not None:
        return reason
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not supported by the cross-entropy kernel (fp16, bf16, fp32); the torch path runs"
    return None


def ce_loss_grad_(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, *, write_grad: bool = True,
    block_v: int | None = None,
) -> torch.Tensor:
    """Per-row cross-entropy of ``logits`` (rows, V) against ``targets`` (rows,) int: the loss
    (rows,) float32 (0 for ignored rows), and, with ``write_grad``, ``softmax - onehot`` written
    over ``logits`` in place (module docstring). ``logits`` needs unit stride along V (a
    matmul's output has it). ``block_v``: the columns per block (a power of two; default
    ``min(MAX_BLOCK_V, next_power_of_2(V))``; tests pick small ones)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"ce_loss_grad_: logits (rows, V) and targets (rows,), got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"ce_loss_grad_: the logits need unit stride along V, got strides {logits.stride()}")
    if targets.device != logits.device:
        raise ValueError(
            f"ce_loss_grad_: logits and targets must be on one device, got {logits.device} and {targets.device}"
        )
    dev = direct_launch.tensor_device(logits)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return ce_loss_grad_(logits, targets, ignore_index, write_grad=write_grad, block_v=block_v)
    rows, v = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss
    if v == 0:
        raise ValueError("ce_loss_grad_: an empty vocabulary (V = 0)")
    block = block_v or min(MAX_BLOCK_V, direct_launch.next_power_of_2(v))
    _CE[(rows,)](
        logits, targets.contiguous(), loss, v, logits.stride(0), ignore_index,
        BLOCK_V=block, WRITE_GRAD=write_grad, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return loss
