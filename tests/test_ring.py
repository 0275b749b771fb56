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
    ring_attention,
    shard_sequence,
)
from dilated_attention.distributed import ring as ring_mod
from dilated_attention.distributed.layout import shard_local, shard_positions, unshard
from dilated_attention.merge import merge_partial_

# ----------------------------------------------------------------------------- helpers


def _inputs(seed, b, n, h, hkv, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _check_case(name, group, world, rank, layout, causal, b, n, h, hkv, d, seed, dtype=torch.float64,
                atol=1e-10) -> dict:
    """Compare with dense attention; returns the call's communication stats (ring_attention's
    ``stats=``)."""
    q, k, v, do = _inputs(seed, b, n, h, hkv, d)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qg, kg, vg, causal)
    ref_grads = torch.autograd.grad(ref_out, (qg, kg, vg), do)

    def shard(x):
        return shard_local(x, world, rank, layout, 1)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    stats = {}
    out, lse = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout, return_lse=True,
                              stats=stats)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == ql.shape
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(do).to(dtype))
    check_close(f"{name} out", out, shard(ref_out), atol)
    check_close(f"{name} lse", lse, shard_local(ref_lse, world, rank, layout, 2), max(atol, 1e-5))
    for gname, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == dtype, f"{name}: d{gname} dtype {got.dtype}"
        check_close(f"{name} d{gname}", got, shard(want), atol)
    return stats


def fp32_accumulated_ring(q, k, v, do, world, layout, causal):
    """The schedule with float32 accumulators everywhere, simulated in one process (a reference
    computation for the tests, not a library mode): per rank, the output merged step by step into
    an fp32 accumulator; dq accumulated in fp32 in step order; the fp32 dK/dV accumulator of each
    block starting with its owner's partial and adding the partial of step t (computed by rank
    owner + t) in step order, as when it travelled round a second ring. Global (B, N, H, D)
    inputs in the compute dtype; returns per-rank lists out, lse, dq, dk, dv.
    """
    t = ring_mod._t
    sh = [[shard_local(x, world, r, layout, 1) for r in range(world)] for x in (q, k, v, do)]
    qs_, ks_, vs_, dos = sh
    nl = qs_[0].shape[1]
    scale = q.shape[-1] ** -0.5
    adt = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for r in range(world):
        acc = torch.empty(qs_[r].shape, dtype=adt)
        acc_lse = None
        for step in range(world):
            src = (r - step) % world
            plan = ring_mod._step_plan(r, src, causal, layout, nl)
            if plan is None:
                continue
            qr, kr, c = plan
            o, lse = ring_mod.attn_fwd(t(qs_[r])[:, :, qr], t(ks_[src])[:, :, kr], t(vs_[src])[:, :, kr],
                                       scale, c)
            if step == 0:
                t(acc).copy_(o)
                acc_lse = lse.to(adt).clone()
            else:
                merge_partial_(t(acc)[:, :, qr], acc_lse[:, :, qr], o, lse)
        outs.append(acc.to(q.dtype))
        lses.append(acc_lse)
    dq = [torch.zeros(x.shape, dtype=adt) for x in qs_]
    dk = [torch.zeros(x.shape, dtype=adt) for x in ks_]
    dv = [torch.zeros(x.shape, dtype=adt) for x in vs_]
    for step in range(world):  # step order: the order every accumulator adds its partials in
        for r in range(world):
            src = (r - step) % world
            plan = ring_mod._step_plan(r, src, causal, layout, nl)
            if plan is None:
                continue
            qr, kr, c = plan
            gq, gk, gv = ring_mod.attn_bwd(
                t(dos[r])[:, :, qr], t(qs_[r])[:, :, qr], t(ks_[src])[:, :, kr], t(vs_[src])[:, :, kr],
                t(outs[r])[:, :, qr], lses[r][:, :, qr], scale, c,
            )
            t(dq[r])[:, :, qr] += gq
            t(dk[src])[:, :, kr] += gk
            t(dv[src])[:, :, kr] += gv
    cast = [[x.to(q.dtype) for x in xs] for xs in (dq, dk, dv)]
    return outs, [x.to(torch.float32) for x in lses], *cast


def _check_bitwise(name, world, rank, layout, causal, b, n, h, hkv, d, seed, dtype):
    """ring_attention equals the fp32-accumulated schedule bit for bit (out, lse, dq, dk, dv)."""
    q, k, v, do = (x.to(dtype) for x in _inputs(seed, b, n, h, hkv, d))
    ref = fp32_accumulated_ring(q, k, v, do, world, layout, causal)
    ql, kl, vl = (shard_local(x, world, rank, layout, 1).requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, causal=causal, layout=layout, return_lse=True)
    grads = torch.autograd.grad(out, (ql, kl, vl), shard_local(do, world, rank, layout, 1))
    for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                               (x[rank] for x in ref), strict=True):
        assert got.dtype == want.dtype, f"{name} {what}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), (
            f"{name} {what}: not bitwise equal to the fp32-accumulated schedule on rank {rank}, "
            f"max abs diff {(got.double() - want.double()).abs().max().item():.3g}"
        )


# ----------------------------------------------------------------------------- no dist needed


def _special_values(dtype):
    fi = torch.finfo(dtype)
    tiny_sub = fi.tiny * fi.eps  # smallest subnormal
    vals = [0.0, fi.tiny, fi.tiny * 0.5, tiny_sub, 3 * tiny_sub, fi.max, fi.max * 0.5, fi.eps, 1.0,
            1.0 + fi.eps, 2.0 ** 15, 65504.0, float("inf")]
    vals = [x for x in vals if x <= fi.max or x == float("inf")]
    return torch.tensor(vals + [-x for x in vals], dtype=torch.float64).to(dtype)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_of_two_partials_in_input_dtype_is_fp32_accumulation(dtype, device):
    """The P = 2 claim: a + b in bf16/fp16 (out of place, in place, into strided rows) is the
    float32 sum of the two widened values rounded once, i.e. fp32 accumulation then a cast."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2 ** 15), 2 ** 15, (2, 1 << 21), generator=g, dtype=torch.int16).to(device)
    a, b = bits.view(dtype)
    finite = torch.isfinite(a) & torch.isfinite(b)  # NaN inputs carry no claim; inf is kept below
    a, b = a[finite], b[finite]
    sp = _special_values(dtype).to(device)
    a = torch.cat([a, sp.repeat_interleave(len(sp)), a[:4096] * 0 + sp[3]])
    b = torch.cat([b, sp.repeat(len(sp)), b[:4096]])
    # scaled pairs: sums near overflow and sums that cancel into the subnormal range
    fi = torch.finfo(dtype)
    a = torch.cat([a, (a[:65536].float().clamp(-1, 1) * fi.max).to(dtype),
                   (a[:65536].float().clamp(-1, 1) * fi.tiny).to(dtype)])
    b = torch.cat([b, (b[:65536].float().clamp(-1, 1) * fi.max).to(dtype),
                   (-a[-65536:].float() * (1 + fi.eps)).to(dtype)])
    want = (a.float() + b.float()).to(dtype)
    variants = {"a + b": a + b, "b + a": b + a, "a.add_(b)": a.clone().add_(b)}
    rows = torch.stack([a, a]).t().contiguous()  # strided in-place add, as the ring does
    rows[:, 1] += b
    variants["x[:, i] += b"] = rows[:, 1]
    for name, got in variants.items():
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert bool(same.all()), (
            f"{dtype} {name}: {(~same).sum().item()} of {len(a)} pairs differ from the fp32 sum "
            f"rounded once, e.g. {a[~same][:3].tolist()} + {b[~same][:3].tolist()}"
        )
    assert bool((want.isinf() & torch.isfinite(a) & torch.isfinite(b)).any())  # overflow covered
    assert bool((want != 0).logical_and(want.abs() < fi.tiny).any())  # subnormal results covered


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_into_low_precision_output_is_fp32_merge(dtype, device, seed):
    """The P = 2 forward: merging the second partial into an output kept in the input dtype, an
    fp32 row chunk at a time, equals merge_partial_ into an fp32 copy then one cast, bit for bit
    (strided rows as the causal zigzag step uses, awkward lengths, rows with no key)."""
    g = torch.Generator().manual_seed(seed)
    for b, h, n, d, rows in ((2, 3, 37, 24, slice(None)), (1, 4, 64, 64, slice(32, None)),
                             (1, 2, 9, 8, slice(0, 5))):
        base = torch.randn(b, n, h, d, generator=g).to(device, dtype)  # (B, N, H, D) storage
        o_b = torch.randn(b, h, n, d, generator=g)[:, :, rows].to(device, dtype)
        lse_a = (torch.randn(b, h, n, generator=g) * 4).to(device)
        lse_b = (torch.randn(b, h, n, generator=g) * 4)[:, :, rows].to(device)
        lse_b[..., :1] = float("-inf")  # a row the second block does not reach
        want = base.float()
        want_lse = lse_a.clone()
        merge_partial_(ring_mod._t(want)[:, :, rows], want_lse[:, :, rows], o_b, lse_b)
        got = base.clone()
        got_lse = lse_a.clone()
        ring_mod._merge_second_partial_(ring_mod._t(got)[:, :, rows], got_lse[:, :, rows], o_b, lse_b)
        assert torch.equal(got, want.to(dtype)), f"{dtype} {device} rows {rows}: output differs"
        assert torch.equal(got_lse, want_lse), f"{dtype} {device} rows {rows}: lse differs"




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
    # bf16/fp16: bit for bit the float32-accumulated schedule (every P; at P = 2 the partials
    # and the running output are kept in the input dtype)
    for layout, causal, dtype in (("zigzag", True, torch.bfloat16), ("contiguous", False, torch.bfloat16),
                                  ("contiguous", True, torch.float16), ("zigzag", False, torch.float16)):
        _check_bitwise(f"P={world} {layout} causal={causal} {dtype}", world, rank, layout, causal,
                       2, 8 * world, 4, 2, 16, seed=50, dtype=dtype)
    # low precision: right dtypes, error within the dtype's usual range (fp64 reference)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        _check_case(f"P={world} {dtype}", None, world, rank, "zigzag", True, 2, 8 * world, 4, 2, 16,
                    seed=7, dtype=dtype, atol=tol * 4)


def _memory_worker(rank, world, nl):
    """Ring buffers alive at once must not grow with P at fixed N/P."""
    b, h, hkv, d = 1, 4, 2, 8
    q, k, v, do = _inputs(5, b, nl * world, h, hkv, d)
    ql, kl, vl = (shard_local(x, world, rank, "zigzag", 1).requires_grad_() for x in (q, k, v))
    st = {}
    out = ring_attention(ql, kl, vl, causal=True, layout="zigzag", stats=st)
    out.backward(shard_local(do, world, rank, "zigzag", 1))
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


def _footprint(ql, kl, vl, dol, group, causal, layout, stats=None):
    """Peak bytes of one forward+backward in the accounting of a training step: the inputs, the
    output gradient, the output (saved for the backward) and every tensor created on the way
    (:class:`_LiveBytes`; kernel workspaces are not seen). Returns (fwd peak, bwd peak, grads)."""
    nbytes = sum(x.numel() * x.element_size() for x in (ql, kl, vl))
    with _LiveBytes() as fwd:
        out = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout, validate=False,
                             stats=stats)
    resident = nbytes + dol.numel() * dol.element_size() + out.numel() * out.element_size()
    with _LiveBytes() as bwd:
        grads = torch.autograd.grad(out, (ql, kl, vl), dol)
    return nbytes + fwd.peak, resident + bwd.peak, grads


def _live_bytes_worker(rank, world):
    """Per-rank peak bytes in units of T = one local (B, N/P, H, D) float32 tensor, against the
    one-device footprint of the same call on the whole sequence (the same accounting; printed
    with ``pytest -s``). The GPU target ``ring peak <= 1.1 * one-GPU peak / P + one K/V block``
    is measured by benchmarks/bench_ring.py, where both sides also hold the kernel's fp32 dq
    workspace and the accumulated .grad.

    P = 2 (float32, MHA, so every partial is T or T/2): forward, besides q, k, v: the output (the
    running output itself), the step's partial output, the k, v in flight: 4T. Backward, besides
    q, k, v, dout, out (5T): the partner's k, v and the partials computed on them, then (k, v
    freed) the partner's dK/dV partials of our block, our dq rows and the own block's dq, dk, dv.
    P >= 3: the fp32 dq and the own block's fp32 dK/dV accumulators (2T each), two k, v pairs,
    the partials in flight both ways and the step's partials.
    """
    b, nl, h, d = 1, 64, 2, 64  # lse-sized temporaries are T / 64
    solos = [dist.new_group([x]) for x in range(world)]
    t = b * nl * h * d * 4
    slack = t // 8  # a few lse-sized temporaries
    rows = []
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        q, k, v, do = (x.to(torch.float32) for x in _inputs(8, b, nl * world, h, h, d))
        ql, kl, vl, dol = (shard_local(x, world, rank, layout, 1) for x in (q, k, v, do))
        ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))
        st = {}
        fwd, bwd, grads = _footprint(ql, kl, vl, dol, None, causal, layout, st)
        assert st["kv_block_bytes"] == 2 * t, st
        one_fwd, one_bwd, one_grads = _footprint(*(x.detach().requires_grad_() for x in (q, k, v)), do,
                                                 solos[rank], causal, layout)
        for got, want in zip(grads, one_grads, strict=True):  # the same call, sharded or not
            check_close(f"live-bytes P={world} {layout}", got, shard_local(want, world, rank, layout, 1),
                        1e-4)
        peak, one = max(fwd, bwd), max(one_fwd, one_bwd)
        bound = 1.1 * one / world + st["kv_block_bytes"]
        rows.append((layout, causal, fwd / t, bwd / t, one / t, bound / t))
        where = (f"P={world} rank {rank} {layout} causal={causal}: fwd {fwd / t:.3f}T bwd {bwd / t:.3f}T, "
                 f"one device {one / t:.3f}T, bound {bound / t:.3f}T")
        print(where, flush=True)
        if world == 2:
            assert 7 * t <= fwd <= 7 * t + slack, where  # q, k, v + 4T
            if causal:  # zigzag: rank 0 meets the partner's block with its late half (dq T/2, dK/dV
                # 2T) and gets T of partials back; rank 1 the reverse (dq T, dK/dV T, gets 2T)
                want = 5 * t + (max(2 * t + 5 * t // 2, t // 2 + t + 3 * t) if rank == 0 else
                                max(2 * t + 2 * t, t + 2 * t + 3 * t))
            else:
                want = 5 * t + max(2 * t + 3 * t, t + 2 * t + 3 * t)
            assert want <= bwd <= want + slack, where
            # here the one-device side has no kernel workspace and no gradient accumulation, so
            # the target (1.1 x share + one K/V block) is not met: the own block's dq, dk, dv
            # (3T) meet the partner's partials (up to a K/V block and a dq-sized block)
            assert peak <= one / world + st["kv_block_bytes"] + t + slack, where
            assert st["fwd_peak_ring_bytes"] == 2 * t, st  # the k, v in flight
        else:
            # O(N/P) at every P: the fp32 accumulators (6T), two k, v pairs (4T), the partials in
            # flight both ways (4T) and the step's partials (3T), besides the 5T resident
            assert bwd <= 5 * t + 17 * t + slack, where
    return rows


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
    st = _check_case("one-rank group", solos[rank], 1, 0, "zigzag", True, 1, 8, 2, 1, 8, seed=40 + rank)
    assert st["fwd_bytes_sent"] == 0 and st["bwd_bytes_sent"] == 0

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
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_ring_exact(world):
    run_distributed(_exact_worker, world)


@pytest.mark.timeout(60)
def test_ring_memory_does_not_grow_with_world():
    for world in (2, 3, 4):
        run_distributed(_memory_worker, world, 6)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_live_tensor_bytes(world):
    run_distributed(_live_bytes_worker, world)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_groups_meshes_and_errors(world):
    run_distributed(_extras_worker, world)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_ring_causal_nonpositive_scale_is_finite(scale):
    # any finite softmax_scale is legal; PyTorch's CPU flash kernel gave NaN for causal blocks
    # with scale <= 0, and ring attention's blocks ran it
    from dilated_attention import dilated_attention, ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    ref = dilated_attention(q, k, v, (300,), (1,), causal=True, softmax_scale=scale, impl="reference")
    out = ring_attention(q, k, v, causal=True, softmax_scale=scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
