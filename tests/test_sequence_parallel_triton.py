"""Sequence-parallel dilated attention with ``impl="triton"`` (fused kernel for the local blocks).

Real gloo process groups of 2 and 3 ranks; the ranks run the Triton kernels in its interpreter
(``TRITON_INTERPRET=1``, set in each rank before the kernels module is first imported, which
fixes the mode for the process) at tiny sizes. Every
case compares this rank's shard of out, lse and dq/dk/dv with ``impl="reference"`` in float64 on
the global tensors (``_case`` of test_sequence_parallel.py), and checks from
the statistics of ``exchange_mode`` which branches ran fused on this rank: fully local branches, branches whose
own rows are fused while received rows take the torch path, and unaligned branches (torch only)
all occur.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from dist_utils import run_distributed
from helpers import interpreted
from test_sequence_parallel import _case

from dilated_attention import dilated_attention

# not importorskip: the ranks import this module, and triton must not be imported there before
# TRITON_INTERPRET=1 is set (its standard-library functions are built at import time)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def _fused(st):
    return [x["local_impl"] == "triton" for x in st["branches"]]


def _worker(rank, world, dtypes):
    os.environ["TRITON_INTERPRET"] = "1"  # read once, when the kernels module is first imported
    import torch.distributed as dist

    L = {2: 12, 3: 6}[world]
    n = L * world
    kw = dict(impl="triton", d=16, b=1)
    for dtype, atol in dtypes:
        kw.update(dtype=dtype, atol=atol)
        seed = 100
        for causal in (False, True):
            seed += 10
            # every branch local (L % w == 0): one fused call, no torch block, no merge
            st = _case("fused local", world, rank, L, (L, L // 2), (1, 2), causal=causal,
                       seed=seed, **kw)
            assert _fused(st) == [True, True] and st["fwd_bytes_sent"] == 0, st
            # local + spanning + unaligned branches; GQA; key padding
            seg, dil = (4, L, 2 * L, n, 5), (1, 2, 2, 4, 3)
            st = _case("fused mix", world, rank, L, seg, dil, causal=causal, h=4, hkv=2,
                       mask=True, seed=seed + 1, **kw)
            assert _fused(st) == [(rank * L) % w == 0 for w in seg], st
            # head split (global head ranges), GQA with uneven kv sharing per offset
            _case("fused split", world, rank, L, (4, 2 * L, n), (1, 2, 3), causal=causal, h=6,
                  hkv=2, head_assignment="split", seed=seed + 2, **kw)
    # what the kernel cannot do is an error on every rank, not a hang
    q = torch.randn(1, L, 2, 8)
    with pytest.raises(ValueError, match="impl='triton' cannot run here with group=.*headdim 8"):
        dilated_attention(q, q, q, (4,), (1,), impl="triton", group=dist.group.WORLD)


@interpreted
@pytest.mark.slow  # spawned ranks running the Triton interpreter
@pytest.mark.timeout(120)
def test_sp_triton_p2():
    # one dtype per world size (CI time): float32 here, float16 (the low-precision merges) at P = 3
    run_distributed(_worker, 2, [(torch.float32, 2e-5)])


@interpreted
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sp_triton_p3():
    run_distributed(_worker, 3, [(torch.float16, 4e-3)])


def test_auto_local_impl_rule(monkeypatch):
    """impl='auto' with a group: the fused kernel for causal calls and calls without gradient
    (measured faster there on 2 x H200), the torch kernels for non-causal training and wherever
    triton cannot run."""
    from dilated_attention.kernels.select import pick_sp_local_impl as _local_impl

    from dilated_attention.kernels import select, triton_launch

    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 8, 2, 16)
    # the interpreter mode is fixed per process when the kernels are imported: set it directly,
    # with an empty cache of backend answers each time (select caches them per process)
    monkeypatch.setattr(triton_launch, "INTERPRET", False)  # CPU without interpreter: no triton
    monkeypatch.setattr(select, "_REASONS", {})
    assert _local_impl("auto", q, k, causal=True) == "torch"
    monkeypatch.setattr(triton_launch, "INTERPRET", True)
    monkeypatch.setattr(select, "_REASONS", {})
    assert _local_impl("auto", q, k, causal=True) == "triton"
    assert _local_impl("auto", q, k, causal=False) == "triton"  # no gradient needed
    qg = q.clone().requires_grad_()
    assert _local_impl("auto", qg, k, causal=False) == "torch"
    assert _local_impl("auto", qg, k, causal=True) == "triton"
    with torch.no_grad():
        assert _local_impl("auto", qg, k, causal=False) == "triton"
    assert _local_impl("auto", qg, torch.randn(1, 8, 2, 24), causal=True) == "torch"  # headdim
    assert _local_impl("torch", qg, k, causal=True) == "torch"
