"""Property-based tests of the packed-documents path: random varlen configurations
(tests/varlen_cases.py) through ``dilated_attention_varlen``, every fast impl equal to the
reference run on each document alone in float64, forward, LSE and all gradients.

Bounded for CI (a few seconds on 2 cores, the Triton interpreter included): the torch path on
fresh hypothesis examples, the fused kernel (seconds per case in the interpreter) on a few
generator seeds; run ``scripts/fuzz.py --varlen`` for long runs that count mismatches.
"""

from __future__ import annotations

import random

import pytest

hypothesis = pytest.importorskip("hypothesis")
from helpers import DEV, HAS_TRITON  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from varlen_cases import check_varlen, random_varlen_case, varlen_case_strategy  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(varlen_case_strategy(d=4))
def test_varlen_torch_matches_reference(case):
    bad = check_varlen(case, "torch")
    assert not bad, f"{case}: {bad}"


# generator seeds of cheap cases: 8: float16, three branches, causal, split heads, a strided
# headdim, the per-call path; 29: fewer queries than keys, causal, split, slices of a packed qkv, the folded
# forward forced; 30: documents with keys but no queries; 31: an empty document, folded, split
TRITON_SEEDS = [8, 29, 30, 31]


@pytest.mark.skipif(not HAS_TRITON, reason="triton unavailable")
@pytest.mark.parametrize("gen_seed", TRITON_SEEDS)
def test_varlen_triton_matches_reference(gen_seed):
    case = random_varlen_case(random.Random(gen_seed), d=16)
    bad = check_varlen(case, "triton", DEV)
    assert not bad, f"{case}: {bad}"
