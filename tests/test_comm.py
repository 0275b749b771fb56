"""Single-process behaviour of the shared distributed helpers (the multi-rank paths are covered by
the gloo tests of test_ring.py and test_sequence_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.distributed.comm import float_bits, resolve_group, validate_across_ranks


def test_resolve_group_without_a_mesh():
    assert resolve_group(None) is None
    pg = object()  # stands for a ProcessGroup: returned as it is
    assert resolve_group(pg) is pg
    with pytest.raises(ValueError, match="only meaningful with a DeviceMesh"):
        resolve_group(pg, "sp")


def test_validate_across_ranks_one_rank():
    calls = []

    def bad():
        raise ValueError("bad input x")

    with pytest.raises(ValueError, match="bad input x"):  # raised as it is, nothing exchanged
        validate_across_ranks(None, "f", bad, lambda: calls.append(1) or [], ["a"], torch.empty(0))
    validate_across_ranks(None, "f", lambda: None, lambda: calls.append(1) or [], ["a"], torch.empty(0))
    assert calls == []  # the descriptor is only built when there are other ranks


def test_float_bits_exact():
    assert float_bits(0.125) != float_bits(0.125 + 2**-50)
    assert float_bits(1.0) == 0x3FF0000000000000
