"""Ring attention and sequence-parallel dilated attention on 8 real gloo ranks (CPU, float64).

The smallest size that still exercises every geometry at P = 8: N = 64 (8 tokens per rank, even
for the zigzag layout), GQA 4/2, causal. Each rank compares its shard of the output and dq/dk/dv
with the single-process reference on the global tensors. One spawn of 8 processes runs all cases.
The full sweep (P = 2..8, causal and not, bytes per rank) is ``benchmarks/check_gloo_scaling.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from helpers import check_close, dense_reference

from dilated_attention import dilated_attention
from dilated_attention.distributed import ring_attention
from dilated_attention.distributed import sequence_parallel as sp
from dilated_attention.distributed.layout import shard_local

P, L, H, HKV, D = 8, 8, 4, 2, 8
N = P * L


def _compare(name, rank, seed, ref_fn, dist_fn, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, N, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, N, H, D, generator=g, dtype=torch.float64)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    ref = ref_fn(qg, kg, vg)
    ref_grads = torch.autograd.grad(ref, (qg, kg, vg), do)

    def shard(x):
        return shard_local(x, P, rank, layout, 1)

    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    out = dist_fn(ql, kl, vl)
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(do))
    name = f"P={P} rank={rank} {name}"
    check_close(f"{name} out", out, shard(ref), 1e-10)
    for gname, got, want in zip("qkv", grads, ref_grads, strict=True):
        check_close(f"{name} d{gname}", got, shard(want), 1e-10)


def _worker(rank, world):
    assert world == P
    for i, layout in enumerate(("contiguous", "zigzag")):
        st = {}
        _compare(f"ring {layout}", rank, i, lambda q, k, v: dense_reference(q, k, v, True)[0],
                 lambda q, k, v, lay=layout: ring_attention(q, k, v, causal=True, layout=lay, stats=st), layout)
        assert st["fwd_bytes_sent"] == (P - 1) * st["kv_block_bytes"], st
        assert st["fwd_peak_ring_bytes"] == 2 * st["kv_block_bytes"], st
    cases = [
        ("local", (L,), (1,)),
        ("span 2 ranks", (2 * L,), (2,)),
        ("span all ranks", (N,), (3,)),
        ("w > N", (2 * N + 3,), (4,)),
        ("w % r != 0 + mix", (5, 2 * L + 3, N), (2, 4, 8)),
    ]
    for i, (cname, seg, dil) in enumerate(cases):
        with sp.exchange_mode() as calls:
            _compare(f"sp {cname} w={seg} r={dil}", rank, 10 + i,
                     lambda q, k, v, s=seg, r=dil: dilated_attention(q, k, v, s, r, causal=True, impl="reference"),
                     lambda q, k, v, s=seg, r=dil: dilated_attention(q, k, v, s, r, causal=True,
                                                                     group=dist.group.WORLD))
        st = calls.stats
        if cname == "local":
            assert st["fwd_bytes_sent"] == 0 and st["bwd_bytes_sent"] == 0, st


@pytest.mark.slow  # 8 spawned ranks
@pytest.mark.timeout(60)
def test_ring_and_sequence_parallel_8_ranks():
    run_distributed(_worker, P)
