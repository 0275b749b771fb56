"""Rules every implementation follows at the autograd and autocast boundaries (a leaf module).

Autocast (see ``docs/autocast.md``): the public entry points follow the rule of
``F.scaled_dot_product_attention``, which is on autocast's lower-precision list: under
``torch.autocast(device_type, dtype)`` for the inputs' device, q, k and v in float16, bfloat16 or
float32 are cast to ``dtype`` (float64 is left alone, as autocast does), the attention runs with
autocast off (so no path re-casts inside) and the output comes back in ``dtype``. Outside
autocast, q, k, v must share one dtype.

Second-order gradients: only ``impl="reference"`` (plain autograd) is twice differentiable. The
custom autograd Functions (torch path, Triton op, ring, sequence-parallel) compute their backward
with grad mode off and, when a graph is being built (``create_graph=True``), attach a node whose
own backward raises a clear error. First-order gradients with ``create_graph=True`` are therefore
still exact; differentiating them again raises instead of returning a wrong number.

Nothing to compute (batch 0, no query, head dim 0): the output is :func:`connected_empty`, so
that backward still gives (empty or zero) gradients of q, k and v, as SDPA does; at head dim 0
the LSE (log of the number of keys) comes from the same call on :func:`zero_features`.
"""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_CASTS = (torch.float16, torch.bfloat16, torch.float32)


# features of the head-dim-0 stand-ins: the smallest head dim every kernel takes (one feature
# made impl="triton" refuse headdim 1)
ZERO_FEATURES = 16


def connected_empty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A q-shaped output with nothing computed (zeros, or no elements), connected to q, k, v."""
    return q * 0 + (k.sum() + v.sum()) * 0


def zero_features(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for a head-dim-0 call: q and k with :data:`ZERO_FEATURES` zero features (every
    logit 0, the same multiplicities), whose LSE is the call's."""
    return q.new_zeros(*q.shape[:-1], ZERO_FEATURES), k.new_zeros(*k.shape[:-1], ZERO_FEATURES)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for ``device_type`` in this thread, or None when autocast is off
    (also for a device type autocast does not know, e.g. ``meta``)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # "unknown device type for autocast" (meta): no autocast there
        return None
    except (TypeError, AttributeError):  # torch without the device_type form of these functions
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return None


def autocast_inputs(q, k, v):
    """Apply the autocast rule to q, k, v: returns ``(q, k, v, device_type)`` where
    ``device_type`` is None when autocast is off for q's device (inputs returned unchanged)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v, None
    device_type = q.device.type
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return q, k, v, None
    q, k, v = (t.to(dtype) if t.dtype in _AUTOCAST_CASTS and t.dtype != dtype else t for t in (q, k, v))
    return q, k, v, device_type


_NOTHING_TO_CHANGE = contextlib.nullcontext()


def backward_context(device_type: str):
    """For the body of a custom Function's backward: no graph of its (first-order-only) math and
    no autocast re-casting its internal matmuls (on the CPU the backward runs in the caller's
    thread, under the caller's autocast state).

    A plain backward (no ``create_graph``) already runs with grad mode off, and usually with
    autocast off: then there is nothing to switch and this is a shared null context (entering
    ``torch.no_grad()`` and ``torch.autocast(enabled=False)`` costs ~20 us of host time per
    call, issue 23)."""
    if not torch.is_grad_enabled() and autocast_dtype(device_type) is None:
        return _NOTHING_TO_CHANGE
    return _switch_off(device_type)


@contextlib.contextmanager
def _switch_off(device_type: str):
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        yield


class _SecondOrderError(torch.autograd.Function):
    """Passes gradients through; differentiating them raises the error of :func:`no_double_backward`."""

    generate_vmap_rule = True  # forward is plain tensor code; torch.func transforms run it

    @staticmethod
    def forward(what, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.what = inputs[0]

    @staticmethod
    def backward(ctx, *_grads):
        raise RuntimeError(
            f"{ctx.what}: second-order gradients (differentiating a gradient taken with "
            "create_graph=True, e.g. a gradient penalty or gradgradcheck) are not implemented "
            "here; impl='reference' supports them (plain autograd, O(N^2) memory)"
        )


def no_double_backward(what: str, grads: tuple, anchors: tuple) -> tuple:
    """Return ``grads`` (computed under :func:`backward_context`); when a graph is being built,
    connect them to the ``anchors`` (the saved inputs and the incoming gradient) through a node
    that raises if it is ever differentiated."""
    if not torch.is_grad_enabled():
        return grads
    anchors = tuple(a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad)
    if not anchors:
        return grads
    idx = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    outs = _SecondOrderError.apply(what, len(idx), *(grads[i] for i in idx), *anchors)
    res = list(grads)
    for i, o in zip(idx, outs, strict=True):
        res[i] = o
    return tuple(res)
