"""The fast path of a repeated dense call of ``dilated_attention`` (training and prefill shapes).

A training loop calls the attention with one configuration step after step, and every layer
of a model with the same one: the same shapes, strides, dtypes, devices, branch lists and
options; only the data change. Everything the front door derives from those (every check of
``checks.describe_call``, the autocast rule's answer, the implementation ``select.pick_impl``
picks, the heads of each branch, and for the fused kernel its launch plan) is then what it was
on the last such call. ``api.dilated_attention`` keeps, under a key of everything the checks and
decisions read (:func:`train_key`), the *route* the first call took after passing every check
(a function of (q, k, v, key_padding_mask) that checks and decides nothing: ``api._route``), and
an equal key on a later call runs that route at once (:func:`train_lookup`). A call that raises
is never stored (the route is stored after it returned), and an input the full path would
refuse has a key of its own (a new shape, dtype, ...), so it takes the full path and raises
there, as without this module.

What a key cannot hold is checked on every hit: autocast for the inputs' device type (the full
path then casts), the element types of the branch lists (``8.0 == 8`` and ``True == 1`` hash
alike; the same tuple object as when stored skips it). No key: under ``torch.compile``, under
functorch transforms, for Tensor subclasses and non-Tensor arguments, other types than the
common ones (a bool ``causal``, a float or None ``softmax_scale``, ``str`` options), decode-shaped
calls (``decode.fast_key`` has those), and whatever the caller excludes (``api.py``: a process
group, dropout). The flags of ``flags.py`` and the launch switches are read by the route itself
at every call (the torch path's cuDNN switch per block, the fused path's plan switches and
direct launch in ``kernels/triton_ops.py`` / ``triton_launch.py``), as on the full path.

Entries are bounded (:data:`MAX_ENTRIES`, all dropped when full, as the decode fast path).
"""

from __future__ import annotations

import torch

from .autograd_rules import autocast_dtype

MAX_ENTRIES = 256

_Tensor = torch.Tensor
_SEQ = (list, tuple)
_INT_ONLY = {int}
# functorch's "is a transform (vmap, grad, ...) active" (private; a torch without it: assume one
# is, so that no call gets a key)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


class Entry:
    """What a repeated call reuses (``value``: here a route, ``api._route``) and what its hits
    check: the branch lists it was stored with (tuples only: the same objects need no element
    check) and the inputs' device type."""

    __slots__ = ("value", "seg", "dil", "device_type")

    def __init__(self, value, seg, dil, device_type: str):
        self.value, self.seg, self.dil, self.device_type = value, seg, dil, device_type


def _plain_ints(seg, dil) -> bool:
    # 8.0 == 8 and True == 1 hash alike, but the full path refuses them; numpy ints it accepts
    return {*map(type, seg), *map(type, dil)} == _INT_ONLY


class RepeatTable:
    """A bounded table of what repeated calls reuse, keyed by everything their checks and
    decisions read (the caller's key), with the one check a key of branch lists cannot make:
    their elements' types. The shape fits the decode fast path too (``decode.fast_lookup`` /
    ``fast_store`` keep the same logic of their own for now). Full: every entry dropped (a
    process that sweeps configurations refills it with those in use)."""

    __slots__ = ("entries", "max_entries")

    def __init__(self, max_entries: int):
        self.entries: dict = {}
        self.max_entries = max_entries

    def get(self, key, seg, dil) -> Entry | None:
        """The entry of ``key`` if its branch lists are plain ints (or the tuples it was stored
        with), else None."""
        try:
            hit = self.entries.get(key)
        except TypeError:  # an unhashable element in a branch list: the full path names it
            return None
        if hit is None or not (seg is hit.seg and dil is hit.dil or _plain_ints(seg, dil)):
            return None
        return hit

    def put(self, key, value, seg, dil, device_type: str) -> None:
        """Keep ``value`` for ``key`` (a call that passed every check and returned)."""
        if not _plain_ints(seg, dil):
            return  # e.g. numpy ints: accepted, but a later call's check could not tell them apart
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        self.entries[key] = Entry(value, seg if type(seg) is tuple else None, dil if type(dil) is tuple else None,
                                  device_type)  # fmt: skip

    def clear(self) -> None:
        self.entries.clear()


_ROUTES = RepeatTable(MAX_ENTRIES)


def train_key(q, k, v, seg, dil, causal, softmax_scale, key_padding_mask, head_assignment, return_lse, impl):
    """The key of a dense call, or None where the fast path never applies (see the module
    docstring). Holds shape, strides, dtype, device and ``requires_grad`` of q, k, v, the grad
    mode (``pick_impl``'s rule reads whether a gradient is needed), shape, strides, dtype and
    device of the padding mask, the branch lists as tuples and the options as given."""
    if (
        torch.compiler.is_compiling()
        or type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor
        or type(seg) not in _SEQ or type(dil) not in _SEQ or type(causal) is not bool
        or type(impl) is not str or type(head_assignment) is not str
        or (softmax_scale is not None and type(softmax_scale) is not float)
        or _transforms_active()
    ):  # fmt: skip
        return None
    try:
        if key_padding_mask is None:
            mask = None
        elif type(key_padding_mask) is _Tensor:
            mask = (key_padding_mask.shape, key_padding_mask.stride(), key_padding_mask.dtype, key_padding_mask.device)
        else:
            return None
        return (
            q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device, mask, torch.is_grad_enabled(), q.requires_grad,
            k.requires_grad, v.requires_grad, tuple(seg), tuple(dil), causal, softmax_scale,
            head_assignment, return_lse, impl,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - e.g. a sparse or nested tensor (no strides): the full path says what is wrong
        return None


def train_lookup(key, seg, dil) -> Entry | None:
    """The entry stored for ``key`` if this call may run its route (``entry.value``), else None."""
    hit = _ROUTES.get(key, seg, dil)
    if hit is None or autocast_dtype(hit.device_type) is not None:
        return None
    return hit


def train_store(key, route, seg, dil, device_type: str) -> None:
    """Keep ``route`` for ``key`` (a call that passed every check and returned)."""
    _ROUTES.put(key, route, seg, dil, device_type)


def clear() -> None:
    """Drop every stored route (the next call of each configuration takes the full path)."""
    _ROUTES.clear()
