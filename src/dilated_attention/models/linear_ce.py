"""The LM head and its cross-entropy in one pass, gradients included (eager training).

``linear_cross_entropy_sum(h, weight, t)`` is ``F.cross_entropy(F.linear(h, weight).float(), t,
reduction="sum")`` (float64 stays float64) computed chunk by chunk, as
``longnet.chunked_cross_entropy`` does, but with each chunk's gradients written in the same pass:
softmax minus one-hot of the chunk's logits times the weight (``dh``) and its transpose times the
chunk's rows (``dweight``, summed over chunks in float32), kept until backward, which only scales
them by the incoming gradient. Against the checkpointed chunks this saves, per chunk, the
recomputed head matmul, the weight's autocast cast (the recompute opens a new autocast context:
a cast of the whole (V, E) weight per chunk) and the scatter of the chunk's ``dh`` into a
zeroed full-size tensor plus the add of those tensors (2026-11-27, ``profile_step.py
--census``: 25 chunks at 8K x 4 with a 50304-word vocabulary).

Numerics follow autocast: under ``torch.autocast`` the matmuls run in the autocast dtype (h and
the weight cast once per call), the matmul's logits widened to float32 for the softmax and the
loss, ``dlogits`` is cast to
the autocast dtype for the two gradient matmuls as autocast's backward of ``F.linear`` does, and
the weight's gradient is accumulated over chunks in float32 (as autograd accumulates the
chunks' separate cast nodes). Without autocast everything is in h's dtype (float64 exact to the
plain formula; tested). Memory: the gradients of h (M, E) and of the weight (V, E, float32) live
from the forward to the backward, instead of one chunk's logits recomputed in backward.

The chunk's loss and gradient: on CUDA (fp16, bf16, fp32) one Triton kernel per chunk
(``kernels/triton_ce.py``): the head matmul's output in the compute dtype goes straight in, the
per-row loss comes out in float32 and ``softmax - onehot`` is written over the logits in the
compute dtype, all its math in float32 (the same formula and the same single rounding of the
gradient as the torch code; two passes over the logits in one launch instead of a float32 copy
and about six passes over it). Elsewhere (the CPU, float64, triton missing) and with
``flags.set_ce_kernel(False)`` / ``DILATED_ATTENTION_CE_KERNEL=0``, the torch code: the logits
widened to float32 (float64 stays), logsumexp, gather, the softmax in place, minus one at the
target, cast to the compute dtype. ``set_ce_kernel(True)`` also runs the kernel in Triton's
interpreter on the CPU (``TRITON_INTERPRET=1``; tests). On an H100 (2026-11-27, LongNet
``base``, 8K x 4) the step's cross-entropy kernels took 8.5 ms against 52.6 ms for the
checkpointed chunks (``benchmarks/results/profile_step_h100_2026-11-27_s14.md``).

Limits (the callers choose the plain path there): no double backward (the gradient is not
differentiable again: ``create_graph=True`` raises), and rows whose target is ``ignore_index``
contribute nothing (kept for safety; ``chunked_cross_entropy`` drops them before it calls this).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..flags import ce_kernel_mode
from ..kernels.select import backend_reason


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's for h's device if on (and h is floating
    point below float64, as autocast leaves float64 alone), else h's."""
    dev = h.device.type
    if h.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


_CE_KERNEL = []  # kernels.triton_ce.ce_loss_grad_, once imported


def _ce_kernel(hc: torch.Tensor):
    """``triton_ce.ce_loss_grad_`` if the chunks' loss runs in the Triton kernel for logits of
    ``hc``'s device and dtype (``flags.ce_kernel_mode``: "auto" on CUDA, "on" also in the
    interpreter on the CPU), else None (the torch code)."""
    mode = ce_kernel_mode()
    if mode == "off" or (mode == "auto" and not hc.is_cuda):
        return None
    if backend_reason("triton_ce", hc.device.type, hc.dtype, 0) is not None:
        return None
    if not _CE_KERNEL:
        # imported at the first use, not with the package (triton.jit picks the interpreter or
        # the compiler when the kernel is defined, and tests set TRITON_INTERPRET late)
        from ..kernels.triton_ce import ce_loss_grad_

        _CE_KERNEL.append(ce_loss_grad_)
    return _CE_KERNEL[0]


def _forward(h, weight, t, ignore_index: int, step: int, cdtype: torch.dtype, need_h: bool, need_w: bool):
    """(summed loss, dh or None, dweight or None): the chunks' loss and gradients (module
    docstring), for :class:`_LinearCrossEntropy` and :func:`linear_ce_op`."""
    acc = torch.float64 if cdtype == torch.float64 else torch.float32
    with torch.autocast(h.device.type, enabled=False):
        wc = weight.to(cdtype)  # once per call (a no-op when already cdtype)
        hc = h.to(cdtype)
        dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        kernel = _ce_kernel(hc) if acc == torch.float32 else None
        for c in range(0, h.shape[0], step):
            xc, tc = hc[c : c + step], t[c : c + step]
            if kernel is not None:
                # the logits in cdtype -> per-row loss (float32), the gradient over them
                gc = xc @ wc.T  # (rows, V)
                total += kernel(gc, tc, ignore_index, write_grad=need_h or need_w).sum()
                if need_h:
                    dh[c : c + step] = gc @ wc
                if need_w:
                    dw.add_(gc.T @ xc)
                del gc  # freed before the next chunk's logits: one chunk alive at a time
                continue
            logits = (xc @ wc.T).to(acc)  # (rows, V)
            valid = tc != ignore_index
            tcl = tc.clamp(min=0).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=1)
            picked = logits.gather(1, tcl).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if not (need_h or need_w):
                continue
            g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
            g.scatter_add_(1, tcl, torch.full_like(picked, -1.0).unsqueeze(1))
            g.mul_(valid.unsqueeze(1))  # ignored rows: no gradient
            gc = g.to(cdtype)
            if need_h:
                dh[c : c + step] = gc @ wc
            if need_w:
                dw.add_(gc.T @ xc)  # the chunk's product in cdtype, summed in float32
    return total, dh, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, t, ignore_index: int, step: int, cdtype: torch.dtype):
        total, dh, dw = _forward(h, weight, t, ignore_index, step, cdtype, ctx.needs_input_grad[0],
                                 ctx.needs_input_grad[1])  # fmt: skip
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    @once_differentiable  # the saved gradients are constants: a second derivative would be wrong
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        gh = None if dh is None else dh * grad.to(dh.dtype)
        gw = None if dw is None else (dw * grad.to(dw.dtype)).to(ctx.w_dtype)
        return gh, gw, None, None, None, None


@torch.library.custom_op("dilated_attention::linear_ce", mutates_args=())
def linear_ce_op(
    h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, ignore_index: int, step: int, cdtype: torch.dtype,
    need_h: bool, need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The compiled graphs' fused loss (``chunked_cross_entropy(fused=True)`` under
    ``torch.compile``): (summed loss, dh (h's shape and dtype; empty (0,) unless ``need_h``),
    dweight (weight's shape, float32 / float64; empty unless ``need_w``)). Its backward scales the
    saved gradients, as :class:`_LinearCrossEntropy`'s does. Rows are not dropped first (that
    needs their count on the host): ignored rows cost their matmuls and contribute nothing."""
    total, dh, dw = _forward(h, weight, t, ignore_index, step, cdtype, need_h, need_w)
    return total, h.new_empty(0) if dh is None else dh, weight.new_empty(0, dtype=total.dtype) if dw is None else dw


@linear_ce_op.register_fake
def _(h, weight, t, ignore_index, step, cdtype, need_h, need_w):
    acc = torch.float64 if cdtype == torch.float64 else torch.float32
    return (h.new_empty((), dtype=acc), h.new_empty(h.shape if need_h else (0,)),
            weight.new_empty(weight.shape if need_w else (0,), dtype=acc))  # fmt: skip


def _linear_ce_op_setup(ctx, inputs, output):
    _, weight, _, _, _, _, need_h, need_w = inputs
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.save_for_backward(dh, dw)
    ctx.w_dtype, ctx.need = weight.dtype, (need_h, need_w)


def _linear_ce_op_backward(ctx, grad, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    gh = dh * grad.to(dh.dtype) if ctx.need[0] else None
    gw = (dw * grad.to(dw.dtype)).to(ctx.w_dtype) if ctx.need[1] else None
    return gh, gw, None, None, None, None, None, None


linear_ce_op.register_autograd(_linear_ce_op_backward, setup_context=_linear_ce_op_setup)


def linear_cross_entropy_sum(
    h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, *, ignore_index: int = -100,
    chunk_rows: int,
) -> torch.Tensor:
    """Summed cross-entropy of ``h (M, E) @ weight (V, E).T`` against ``t (M,)`` in chunks of
    ``chunk_rows`` rows, gradients computed in the forward (module docstring); under
    ``torch.compile`` the same pass as the custom op :func:`linear_ce_op`."""
    if torch.compiler.is_compiling():
        return torch.ops.dilated_attention.linear_ce(h, weight, t, ignore_index, int(chunk_rows), _compute_dtype(h),
                                                     h.requires_grad, weight.requires_grad)[0]  # fmt: skip
    return _LinearCrossEntropy.apply(h, weight, t, ignore_index, int(chunk_rows), _compute_dtype(h))
