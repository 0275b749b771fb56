"""Sequence parallelism and ring attention over a packed stream (varlen) on real gloo groups.

One packed stream of documents (global offsets ``cu_seqlens``, the same on every rank) is sharded
over P = 2, 3, 4 ranks ("contiguous" and "zigzag"); documents cross rank boundaries (one spans
three ranks or more), and there is a one-token document, an empty one, documents shorter than the
smallest segment and lengths that are no multiple of any w; no document is padded. Each rank
runs ``dilated_attention_varlen(shard, group=...)`` / ``ring_attention(shard, cu_seqlens=...)``
and compares its shard of the output, LSE and dq/dk/dv (float64) with
``dilated_attention_varlen(impl="reference")`` on the whole stream. One spawn per world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from helpers import check_close

from dilated_attention import dilated_attention_varlen, ring_attention
from dilated_attention.distributed import sequence_parallel as sp
from dilated_attention.distributed.layout import shard_local

ATOL = 1e-10  # float64: the distributed result differs from the reference only by rounding

# document lengths of one stream per world size: N is a multiple of 2P (both layouts); the long
# document crosses every contiguous shard boundary it meets (3..30 of 36 spans ranks 0, 1, 2)
STREAMS = {
    2: [1, 3, 14, 0, 5, 1],  # N = 24
    3: [2, 1, 27, 3, 3],  # N = 36
    4: [7, 1, 25, 2, 5],  # N = 40
}
SEG, DIL = (3, 8, 20), (1, 2, 4)  # no document length is a multiple of any w


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _case(world, rank, lengths, *, layout, causal, kind="varlen", seg=SEG, dil=DIL, h=4, hkv=2,
          d=4, head_assignment="all", mode="auto", seed=0, offsets="tensor"):
    cu = _cu(lengths)
    n = cu[-1]
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    cut = torch.tensor(cu, dtype=torch.int32)
    mx = max(lengths)
    if kind == "ring":  # dense attention inside each document: one branch longer than any
        seg, dil, head_assignment = (max(n, 1),), (1,), "all"
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dilated_attention_varlen(
        qg, kg, vg, cut, cut, mx, mx, seg, dil, causal=causal, head_assignment=head_assignment,
        impl="reference", return_lse=True,
    )
    ref_grads = torch.autograd.grad(ref_out, (qg, kg, vg), do)

    def shard(x, dim=0):
        return shard_local(x, world, rank, layout, dim)

    ql, kl, vl = (shard(x).clone().requires_grad_() for x in (q, k, v))
    cu_arg = {"tensor": cut, "list": cu, "int64": cut.long()}[offsets]
    with sp.exchange_mode(mode) as calls:
        if kind == "ring":
            stats = {}
            out, lse = ring_attention(ql[None], kl[None], vl[None], group=dist.group.WORLD,
                                      causal=causal, layout=layout, return_lse=True,
                                      cu_seqlens=cu_arg, stats=stats)
            out, lse = out[0], lse[0]
        else:
            out, lse = dilated_attention_varlen(
                ql, kl, vl, cu_arg, cu_arg, mx, mx, seg, dil, causal=causal,
                head_assignment=head_assignment, return_lse=True, group=dist.group.WORLD,
                layout=layout, impl="torch",
            )
            stats = calls.stats
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(do))
    name = (f"P={world} rank={rank} {kind} {layout} causal={causal} h={h}/{hkv} "
            f"{head_assignment} mode={mode} docs={lengths}")
    assert out.shape == ql.shape and out.dtype == torch.float64 and lse.dtype == torch.float32
    check_close(f"{name} out", out, shard(ref_out), ATOL)
    want_lse = shard(ref_lse, 1)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), fin), f"{name}: lse -inf pattern differs"
    check_close(f"{name} lse", lse[fin], want_lse[fin], 1e-5)  # the LSE travels in float32
    for gname, got, want in zip("qkv", grads, ref_grads, strict=True):
        check_close(f"{name} d{gname}", got, shard(want), ATOL)
    return stats


def _exact_worker(rank, world):
    lengths = STREAMS[world]
    seed = 0
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            seed += 1
            st = _case(world, rank, lengths, layout=layout, causal=causal, seed=seed)
            assert st["fwd_bytes_sent"] > 0 or rank > 0, st  # documents cross rank 0's end
            # GQA with kv heads shared unevenly by the offsets of r = 4, one head per group
            _case(world, rank, lengths, layout=layout, causal=causal, h=6, hkv=2, seed=seed + 10,
                  head_assignment="split" if causal else "all", offsets="list")
            _case(world, rank, lengths, layout=layout, causal=causal, kind="ring", h=4, hkv=1,
                  seed=seed + 20, offsets="int64")
    # both exchange schedules on the causal zigzag stream (ring: one peer distance per round)
    for mode in ("allgather", "ring"):
        _case(world, rank, lengths, layout="zigzag", causal=True, mode=mode, seed=40)
        _case(world, rank, lengths, layout="contiguous", causal=False, kind="ring", mode=mode, seed=41)
    # documents that end on the shard boundaries: nothing to exchange
    L = sum(lengths) // world
    for kind in ("varlen", "ring"):
        st = _case(world, rank, [L - 1, 1] * world, layout="contiguous", causal=True, kind=kind,
                   seed=50)
        assert st["fwd_bytes_sent"] == 0 and st["bwd_bytes_sent"] == 0, st


def _errors_worker(rank, world):
    group = dist.group.WORLD
    q = torch.randn(6, 2, 4, dtype=torch.float64)  # N = 12 over 2 ranks

    def call(cu, *, mx=12, **kw):
        kw.setdefault("group", group)
        return dilated_attention_varlen(q, q, q, cu, cu, mx, mx, (4,), (1,), **kw)

    bad = [
        ([1, 5, 12], "cu_seqlens_q must start at 0"),
        ([0, 7, 5, 12], "must be non-decreasing"),
        ([0, 5, 6], r"last entry of cu_seqlens_q \(6\) must equal the number of packed tokens "
                    r"\(12, the global stream: P = 2 ranks x 6 rows"),
    ]
    for cu, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call(cu)
        with pytest.raises(ValueError, match=msg.replace("cu_seqlens_q", "cu_seqlens")):
            ring_attention(q, q, q, group=group, cu_seqlens=cu)
    with pytest.raises(ValueError, match="max_seqlen_q = 5 but document 1 has 7"):
        call([0, 5, 12], mx=5)
    with pytest.raises(ValueError, match="cu_seqlens_q must equal cu_seqlens_k"):
        dilated_attention_varlen(q, q, q, [0, 5, 12], [0, 6, 12], 7, 7, (4,), (1,), group=group)
    with pytest.raises(ValueError, match="differ across ranks"):
        call([0, 5 + rank, 12])
    q5 = torch.randn(5, 2, 4, dtype=torch.float64)  # N = 10: not a multiple of 2P = 4
    with pytest.raises(ValueError, match="multiple of 4"):
        dilated_attention_varlen(q5, q5, q5, [0, 10], [0, 10], 10, 10, (4,), (1,), group=group,
                                 layout="zigzag")
    with pytest.raises(ValueError, match="multiple of 4"):
        ring_attention(q5, q5, q5, group=group, cu_seqlens=[0, 10], layout="zigzag")
    with pytest.raises(ValueError, match="dropout_p"):
        call([0, 12], dropout_p=0.1)
    for impl in ("reference", "triton"):
        with pytest.raises(ValueError, match=f"impl='{impl}' is not available with group="):
            call([0, 12], impl=impl)
    with pytest.raises(ValueError, match="layout must be one of"):
        call([0, 12], layout="striped")
    # an argument error of one rank only (offsets' type/shape, q's dims: checks made before the
    # cross-rank comparison) raises on every rank; the others used to wait in the collective
    good = torch.tensor([0, 5, 12], dtype=torch.int32)
    one_bad = [
        (good.float(), q, TypeError, "integer tensor"),
        (good[None], q, ValueError, "must be 1-D"),
        ([0, 5.0, 12], q, TypeError, "integer tensor of document offsets"),
        (good, q[None], ValueError, "q must have 3 dims"),
    ]
    for cu, qq, exc, msg in one_bad:
        ring_too = qq is q  # (the same on both ranks)
        if rank == 1:
            cu, qq = good, q
        want = (exc, msg) if rank == 0 else (ValueError, r"invalid inputs on rank\(s\) \[0\]")
        with pytest.raises(want[0], match=want[1]):
            dilated_attention_varlen(qq, qq, qq, cu, cu, 12, 12, (4,), (1,), group=group)
        if ring_too:
            with pytest.raises(want[0], match=want[1].replace("cu_seqlens_q", "cu_seqlens")):
                ring_attention(q, q, q, group=group, cu_seqlens=cu)
    # the module with a process group takes the offsets as a list of ints, as the function does,
    # and computes max_seqlen from it (it used to pass 0 and fail on the longest document)
    from dilated_attention import DilatedAttention

    mod = DilatedAttention((4,), (1,), impl="torch", process_group=group)
    want = mod(q, q, q, is_causal=True, cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32))
    check_close("module, list offsets", mod(q, q, q, is_causal=True, cu_seqlens=[0, 5, 12]), want, 0)
    # still healthy after the errors
    _case(world, rank, [5, 7], layout="zigzag", causal=True, seed=3)


def _model_worker(rank, world):
    """LongNetLM (rotary positions per document) and MultiheadDilatedAttention made
    sequence-parallel over one packed stream: this rank's logits, the global loss and the
    all-reduced parameter gradients equal the single-device model on the whole stream."""
    import copy

    from dilated_attention import MultiheadDilatedAttention
    from dilated_attention.models import LongNetConfig, LongNetLM, parallelize

    group = dist.group.WORLD
    lengths = STREAMS[world]
    cu = torch.tensor(_cu(lengths), dtype=torch.int32)
    n = int(cu[-1])
    t = n // world
    sl = slice(rank * t, (rank + 1) * t)
    cfg = LongNetConfig(vocab_size=30, dim=16, n_layer=2, n_head=4, n_kv_head=2, ffn_dim=24,
                        segment_lengths=SEG, dilation_rates=DIL, impl="torch", dropout=0.0)
    torch.manual_seed(0)
    model = LongNetLM(cfg).double()
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, 30, (1, n), generator=g) for _ in range(2))
    logits, loss = model(idx, tgt, cu_seqlens=cu)
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    spm = parallelize(copy.deepcopy(model), group)
    spm.zero_grad()
    lg, ls = spm(idx[:, sl], tgt[:, sl], cu_seqlens=cu)
    (ls / world).backward()  # equal tokens per rank: the global mean is the mean of the means
    got = torch.cat([p.grad.flatten() for p in spm.parameters()])
    dist.all_reduce(got)
    total = ls.detach().clone()
    dist.all_reduce(total)
    name = f"P={world} rank={rank} LongNetLM"
    check_close(f"{name} logits", lg, logits[:, sl], ATOL)
    check_close(f"{name} loss", total / world, loss, ATOL)
    check_close(f"{name} grads", got, want, ATOL)
    # the module: (total, embed_dim) shards, causal, grads of the input
    torch.manual_seed(2)
    mha = MultiheadDilatedAttention(16, 4, SEG, DIL, num_kv_heads=2, impl="torch").double()
    x = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    out, _ = mha(x, x, x, is_causal=True, cu_seqlens=cu)
    gx = torch.autograd.grad(out.sum(), x)[0]
    smha = copy.deepcopy(mha)
    smha.attention.process_group = group
    xl = x.detach()[sl].clone().requires_grad_()
    outl, _ = smha(xl, xl, xl, is_causal=True, cu_seqlens=cu)
    gxl = torch.autograd.grad(outl.sum(), xl)[0]
    check_close(f"{name} MHA out", outl, out[sl], ATOL)
    check_close(f"{name} MHA dx", gxl, gx[sl], ATOL)
    with pytest.raises(ValueError, match="ONE packed stream, shape"):
        spm(idx[:, sl].expand(2, -1), cu_seqlens=cu)
    # a bad input shape of the modules on rank 0 only: every rank raises (used to hang)
    xb = x.detach()[sl].clone()
    qh = xb.view(-1, 4, 4)
    for fn, bad, good, msg in ((smha, xb.expand(2, -1, -1), xb, r"must be \(total, embed_dim"),
                               (smha.attention, qh.expand(2, -1, -1, -1), qh, "one packed row")):  # fmt: skip
        want = (ValueError, msg) if rank == 0 else (ValueError, r"invalid inputs on rank\(s\) \[0\]")
        with pytest.raises(want[0], match=want[1]):
            fn(bad if rank == 0 else good, good, good, cu_seqlens=cu)
    # bad offsets on rank 0 only: every rank raises (the others used to wait in layer 1)
    want = (TypeError, "1-D integer tensor") if rank == 0 else (ValueError, r"invalid inputs on rank\(s\) \[0\]")
    with pytest.raises(want[0], match=want[1]):
        spm(idx[:, sl], cu_seqlens=cu.float() if rank == 0 else cu)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_sp_varlen_model(world):
    run_distributed(_model_worker, world)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sp_varlen_exact(world):
    run_distributed(_exact_worker, world)


@pytest.mark.timeout(60)
def test_sp_varlen_errors():
    run_distributed(_errors_worker, 2)


def test_ring_attention_packed_single_process():
    """Without torch.distributed: dense attention inside each document (world of one)."""
    lengths = [1, 9, 0, 4]
    for causal in (False, True):
        _case(1, 0, lengths, layout="contiguous", causal=causal, kind="ring", seed=7)
