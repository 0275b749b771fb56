"""Property-based tests: random configurations (tests/property_cases.py), every fast impl equal to
the float64 reference in forward, LSE and all gradients.

Bounded for CI (about a minute on 2 cores): profile "ci" (the default). Set
``HYPOTHESIS_PROFILE=long`` for more examples, or run ``scripts/fuzz.py`` for long runs that count
mismatches instead of stopping at the first.
"""

from __future__ import annotations

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from property_cases import case_strategy, check  # noqa: E402

from dilated_attention.api import triton_unavailable_reason  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = triton_unavailable_reason(torch.empty(1, 1, 1, 16, device=DEV)) is None

_COMMON = dict(deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# the Triton interpreter takes seconds per example (compile-free but slow): a fraction of the count
_TRITON_EXAMPLES = max(3, settings().max_examples // 30)


@given(case_strategy(d=4))
def test_torch_matches_reference(case):
    bad = check(case, "torch")
    assert not bad, f"{case}: {bad}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton unavailable")
@settings(max_examples=_TRITON_EXAMPLES)
@given(case_strategy(d=16))
def test_triton_matches_reference(case):
    bad = check(case, "triton", DEV)
    assert not bad, f"{case}: {bad}"
