"""Ring attention: layouts (pure tensor code), then real gloo process groups of 2, 3 and 4 ranks.

Every distributed case compares this rank's shard of the output, LSE and dq/dk/dv with dense
float64 attention over the global tensors computed in the same process. One spawn per world size
runs all its cases (spawning is the slow part on CPU).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from helpers import check_close, dense_reference
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dilated_attention.distributed import (
    gather_sequence,
    last_ring_stats,
    ring_attention,
    shard_sequence,
)
from dilated_attention.distributed.layout import shard_local, shard_positions, unshard

# ----------------------------------------------------------------------------- helpers


def _inputs(seed, b, n, h, hkv, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _check_case(name, group, world, rank, layout, causal, b, n, h, hkv, d, seed, dtype=torch.float64,
                atol=1e-10):
    q, k, v, do = _inputs(seed, b, n, h, hkv, d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qg, kg, vg, causal)
    ref_grads = torch.autograd.grad(ref_out, (qg, kg, vg), do)

    def shard(x):
        return shard_local(x, world, rank, layout, 1)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == ql.shape
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(do).to(dtype))
    check_close(f"{name} out", out, shard(ref_out), atol)
    check_close(f"{name} lse", lse, shard_local(ref_lse, world, rank, layout, 2), max(atol, 1e-5))
    for gname, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == dtype, f"{name}: d{gname} dtype {got.dtype}"
        check_close(f"{name} d{gname}", got, shard(want), atol)


# ----------------------------------------------------------------------------- no dist needed


def test_layout_roundtrip_and_positions():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            if 24 % (world * (2 if layout == "zigzag" else 1)):
                continue
            shards = [shard_local(x, world, r, layout, 1) for r in range(world)]
            assert torch.equal(unshard(shards, layout, 1), x)
            for r in range(world):
                assert torch.equal(shards[r][0, :, 0], x[0, shard_positions(24, world, r, layout), 0])
    assert shard_positions(16, 2, 0, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(shard_sequence(x), x)  # no dist: one rank
    assert torch.equal(gather_sequence(x), x)


def test_layout_errors():
    x = torch.zeros(1, 10, 2)
    with pytest.raises(ValueError, match="not divisible by P = 3"):
        shard_local(x, 3, 0, "contiguous")
    with pytest.raises(ValueError, match="2P"):
        shard_local(x, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_local(x, 2, 0, "striped")


@pytest.mark.parametrize("causal", [False, True])
def test_single_process_is_dense_attention(causal):
    # group=None and torch.distributed not initialised: plain attention
    _check_case("P=1", None, 1, 0, "contiguous", causal, 2, 13, 4, 2, 8, seed=3)


# ----------------------------------------------------------------------------- spawned ranks


def _exact_worker(rank, world):
    n_per = {2: (6, 10), 3: (4, 6), 4: (4, 6)}[world]  # shard lengths; zigzag needs even ones
    seed = 0
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            for h, hkv in ((4, 4), (4, 2), (6, 1)):
                for nl in n_per:
                    seed += 1
                    name = f"P={world} {layout} causal={causal} h={h}/{hkv} N={nl * world}"
                    _check_case(name, None, world, rank, layout, causal, 2, nl * world, h, hkv, 8, seed)
    # a shard length that is odd works with the contiguous layout
    _check_case(f"P={world} odd shard", None, world, rank, "contiguous", True, 1, 5 * world, 2, 1, 4, 99)
    # low precision: right dtypes, error within the dtype's usual range (fp64 reference)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        _check_case(f"P={world} {dtype}", None, world, rank, "zigzag", True, 2, 8 * world, 4, 2, 16,
                    seed=7, dtype=dtype, atol=tol * 4)


def _memory_worker(rank, world, nl):
    """Ring buffers alive at once must not grow with P at fixed N/P."""
    b, h, hkv, d = 1, 4, 2, 8
    q, k, v, do = _inputs(5, b, nl * world, h, hkv, d)
    ql, kl, vl = (shard_local(x, world, rank, "zigzag", 1).requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, causal=True, layout="zigzag")
    out.backward(shard_local(do, world, rank, "zigzag", 1))
    st = last_ring_stats()
    block = 2 * b * hkv * nl * d * 8  # one K/V block (k and v) in float64
    assert st["kv_block_bytes"] == block
    assert st["fwd_bytes_sent"] == (world - 1) * block
    # forward: the block being computed and the one in flight (one only when P = 2)
    assert st["fwd_peak_ring_bytes"] == min(world - 1, 2) * block, st
    # backward: 2 K/V blocks + 2 dK/dV accumulators (float64 here: the same size)
    assert st["bwd_peak_ring_bytes"] <= 4 * block, st


class _LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created by ops inside the mode that are still alive, and their peak.

    Storages are tracked through weak references (freed = no tensor, view or pending send/recv
    holds them any more). Allocations inside a kernel (its workspace) are not seen: this counts
    the tensors the Python code keeps, which is what the ring controls.
    """

    def __init__(self):
        super().__init__()
        self.live: set[int] = set()
        self.cur = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # views and in-place results share an input's storage: nothing new was allocated
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr() for t in ins}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self.live and key not in seen:
                    self.live.add(key)
                    self.cur += n
                    self.peak = max(self.peak, self.cur)
                    weakref.finalize(st, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self.live.discard(key)
        self.cur -= n


def _live_bytes_worker(rank, world):
    """Peak bytes of the tensors a P = 2 ring creates, in units of T = one local q-sized tensor.

    float32 and MHA: every accumulator, K or V block and partial gradient is exactly T. Forward:
    the output accumulator (it is the returned output), the step's partial output and the k, v in
    flight: 4T (no stacked K/V copy, no second output copy, no float32 copy of a partial in the
    merge). Backward (q, k, v, out, dout exist before): dq, the travelling k, v, the dK/dV being
    sent and the pair being received (7T), and the step's dq/dk/dv partials (at most 3T).
    """
    b, nl, h, d = 1, 64, 2, 64  # lse-sized temporaries are T / 64
    ql, kl, vl, dol = (shard_local(x, world, rank, "zigzag", 1).to(torch.float32)
                       for x in _inputs(8, b, nl * world, h, h, d))
    ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))
    t = ql.numel() * ql.element_size()
    slack = t // 8  # a few lse-sized temporaries
    with _LiveBytes() as fwd:
        out = ring_attention(ql, kl, vl, causal=True, layout="zigzag", validate=False)
    with _LiveBytes() as bwd:
        grads = torch.autograd.grad(out, (ql, kl, vl), dol)
    # the same numbers as without the tracker
    ref = ring_attention(ql.detach(), kl.detach(), vl.detach(), causal=True, layout="zigzag")
    check_close("live-bytes run out", out, ref, 0.0)
    assert all(g.shape == x.shape for g, x in zip(grads, (ql, kl, vl), strict=True))
    where = f"rank {rank}: fwd peak {fwd.peak / t:.3f}T, bwd peak {bwd.peak / t:.3f}T"
    assert 4 * t <= fwd.peak <= 4 * t + slack, where
    # zigzag, second step: rank 0 meets the late half of its queries with all of the block (dq/2,
    # dk, dv), rank 1 all its queries with the block's first half (dq, dk/2, dv/2)
    want = 7 * t + (5 * t // 2 if rank == 0 else 2 * t)
    assert want <= bwd.peak <= want + slack, where
    st = last_ring_stats()
    assert st["kv_block_bytes"] == 2 * t, st
    assert st["fwd_peak_ring_bytes"] == 2 * t, st  # the k, v in flight
    assert st["bwd_peak_ring_bytes"] == 6 * t, st  # k, v received; dK/dV sent; dK/dV received


def _extras_worker(rank, world):
    """Subgroups, DeviceMesh, gather_sequence autograd, cross-rank errors (no hang)."""
    # subgroups: two independent rings of 2 (world 4) — every rank calls new_group for both
    if world == 4:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        grp = groups[rank // 2]
        _check_case("subgroup", grp, 2, rank % 2, "zigzag", True, 1, 12, 4, 2, 8, seed=11 + rank // 2)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        sp_rank = mesh.get_local_rank("sp")
        _check_case("mesh dim", (mesh, 1), 2, sp_rank, "contiguous", True, 1, 10, 2, 2, 8,
                    seed=20 + mesh.get_local_rank("dp"))
        mesh1 = init_device_mesh("cpu", (4,))
        _check_case("1-D mesh", mesh1, 4, rank, "zigzag", False, 1, 16, 2, 1, 8, seed=30)

    # a one-rank group with torch.distributed initialised: plain attention, no communication
    solos = [dist.new_group([x]) for x in range(world)]
    _check_case("one-rank group", solos[rank], 1, 0, "zigzag", True, 1, 8, 2, 1, 8, seed=40 + rank)
    assert last_ring_stats()["fwd_bytes_sent"] == 0

    # gather_sequence: forward is the global tensor, backward sums the ranks' gradients
    x = torch.arange(4.0 * world, dtype=torch.float64).reshape(1, 4 * world, 1)
    for layout in ("contiguous", "zigzag"):
        xs = shard_sequence(x, layout=layout).requires_grad_()
        xg = gather_sequence(xs, layout=layout)
        assert torch.equal(xg, x)
        (xg * (rank + 1)).sum().backward()
        assert torch.equal(xs.grad, torch.full_like(xs, world * (world + 1) / 2))

    with _raises("not divisible by P"):
        shard_sequence(torch.zeros(1, 4 * world + 1, 1))

    # mismatched shapes across ranks: the same kind of error on every rank, no hang
    nl = 4 + (rank == world - 1)
    q = torch.randn(1, nl, 2, 8, dtype=torch.float64)
    with _raises("differ across ranks"):
        ring_attention(q, q, q)
    dt = torch.float32 if rank == 0 else torch.float64
    q = torch.randn(1, 4, 2, 8, dtype=dt)
    with _raises("dtype"):
        ring_attention(q, q, q)
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with _raises("differ across ranks"):
        ring_attention(q, q, q, causal=rank == 0)
    # an error found on one rank only is raised there and reported on the others
    bad = q[0] if rank == 1 else q
    with _raises("4 dims" if rank == 1 else "invalid inputs on rank"):
        ring_attention(bad, bad, bad)
    # zigzag needs an even shard: every rank raises
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    with _raises("even shard length"):
        ring_attention(q, q, q, layout="zigzag")
    # the group is still healthy after the errors
    _check_case("after errors", None, world, rank, "zigzag", True, 1, 4 * world, 2, 2, 8, seed=1)


class _raises:
    def __init__(self, match):
        self.match = match

    def __enter__(self):
        return self

    def __exit__(self, typ, val, tb):
        if typ is None:
            raise AssertionError(f"expected ValueError matching {self.match!r}, nothing raised")
        if not issubclass(typ, ValueError) or self.match not in str(val):
            return False
        return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_exact(world):
    run_distributed(_exact_worker, world)


@pytest.mark.timeout(60)
def test_ring_memory_does_not_grow_with_world():
    for world in (2, 3, 4):
        run_distributed(_memory_worker, world, 6)


@pytest.mark.timeout(60)
def test_ring_live_tensor_bytes_p2():
    run_distributed(_live_bytes_worker, 2)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_groups_meshes_and_errors(world):
    run_distributed(_extras_worker, world)
