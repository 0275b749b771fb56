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

MAX_PLANS = 512

_T = TypeVar("_T")
_plans: dict = {}


def cached_plan(key: Hashable, build: Callable[[], _T]) -> _T:
    """The plan stored under ``key``, built by ``build()`` on the first request.

    ``key`` must hold everything the plan depends on, including the device and the name of the
    building module (so that keys of different plan kinds never collide).
    """
    plan = _plans.get(key)
    if plan is None:
        plan = build()
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def clear_plans() -> None:
    """Drop every cached plan."""
    _plans.clear()
