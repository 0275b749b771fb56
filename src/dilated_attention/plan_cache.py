"""The one cache of execution plans (a leaf module).

A plan is the pure-Python / index-tensor description of how a call's blocks are computed (which
rows, heads and groups; which peers to exchange with), a function of the shapes, options and
device only. The torch path and sequence-parallel attention build one per distinct call shape
and keep it here, so that repeated calls (training steps, layers of one model) reuse it. The
cache holds at most :data:`MAX_PLANS` plans and is emptied when full (shapes in a training run
repeat, so it refills with the ones in use).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

MAX_PLANS = 512

_T = TypeVar("_T")
_plans: dict = {}


def cached_plan(key: Hashable, build: Callable[[], _T]) -> _T:
    """The plan stored under ``key``, built by ``build()`` on the first request.

    ``key`` must hold everything the plan depends on, including the device and the name of the
    building module (so that keys of different plan kinds never collide).

    Under a fake-tensor or tracing mode (``torch.export``, ``FakeTensorMode``, ``make_fx``, shape
    inference tools) a plan built in the mode would hold fake index tensors, and every later real
    call of that shape would read them: wrong results or a crash (2026-11-30). There the plan is
    built with the modes set aside (real tensors: what an eager call builds) and stored; the call
    gets it where its mode takes real tensors (``torch.export``'s does), else a copy built in the
    mode for this call only (also on a hit). A plan that cannot be built outside the mode (a fake
    device this process does not have) is built in the mode and never stored.
    """
    plan = _plans.get(key)
    fake = _get_mode(_FAKE) if _FAKE is not None else None
    if plan is None:
        if fake is None and (_PROXY is None or _get_mode(_PROXY) is None):
            plan = _build(build)
        else:
            from torch.utils._python_dispatch import _disable_current_modes

            try:
                with _disable_current_modes():
                    plan = _build(build)
            except Exception:  # noqa: BLE001 - e.g. a fake CUDA device on a machine without one
                return _build(build)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    if fake is not None and not fake.allow_non_fake_inputs:
        return _in_mode(build, plan, fake)  # a FakeTensorMode that refuses real tensors
    return plan


def _build(build):
    """``build()`` with the CPU as the default device: builders name the device of what they
    keep, and their index arithmetic must not follow ``torch.set_default_device`` (meta: "Cannot
    copy out of meta tensor"; a GPU: index math on it for a CPU call)."""
    with torch.device("cpu"):
        return build()


def _in_mode(build, plan, fake):
    """This call's copy of ``plan`` under ``fake`` (a FakeTensorMode that refuses real tensors):
    built in the mode, or where that build needs data (a Hilbert curve's), the real plan's
    tensors made fake (``fake.from_tensor``; plans of tuples and lists)."""
    try:
        return _build(build)
    except Exception:  # noqa: BLE001 - a data-dependent build (DataDependentOutputException)
        from torch.utils._pytree import tree_map

        return tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, plan)


# the dispatch-mode slots of a fake-tensor mode and of a proxy-tracing (make_fx / export) mode
_get_mode = torch._C._get_dispatch_mode
_FAKE = getattr(torch._C._TorchDispatchModeKey, "FAKE", None)
_PROXY = getattr(torch._C._TorchDispatchModeKey, "PROXY", None)


def clear_plans() -> None:
    """Drop every cached plan."""
    _plans.clear()
