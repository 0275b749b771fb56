"""When and how the training backward runs the Gluon kernels (``gluon_bwd_kernel.py``, issue 24).

:func:`problem` says why the kernels cannot run a backward (None: they can); :func:`backward`
runs every branch's dK/dV and dQ kernels, each adding into float32 accumulators (zeros, one per
result), and returns them cast to the inputs' dtype, one at a time, each freed once cast: every
row's sum is float32 in branch order (deterministic, no atomics), rounded once. With
:data:`SPLIT_PHASES` every branch's dK/dV kernels run first and dk, dv are cast and freed before
the dQ kernels' accumulator is allocated (a lower peak; the same bits). The Triton backward's
compensated (hi, lo) pairs hold about the same precision in less memory; the float32
accumulators cost 2x a result each, so a call whose three of them pass :data:`MAX_F32_BYTES`
runs the Triton backward (``triton_launch.backward``: the 2M-token calls of issue 24 among them).

delta = rowsum(dO * out) comes from the Triton backward's delta kernel; lse and delta are handed
to the kernels block-major per branch (one Triton kernel per branch, :func:`block_rows`; on the
CPU, for the emulated kernels of the tests, :func:`prep_rows`).

Restrictions, checked by :func:`problem`, beyond the forward's (``gluon_fwd.shape_problem``:
Hopper, bf16/fp16, D 64/128, w % r == 0 or ``gluon_fwd.UNEVEN_BLOCKS`` (each length class
launched apart, as the forward does), dense-head views), N % w == 0 unless
:data:`TAIL_SEGMENTS` (off; batch 1, or any batch with ``gluon_fwd.TAIL_BATCHES``, off: each
entry launched apart): every branch over all
heads (``head_assignment="all"``), no key padding mask, no packed documents, no block-config
override (the caller checks those three). dO is made contiguous when its layout is not one the
TMA views take (a broadcast dO from ``out.sum()``: one copy). The switch is
:func:`dilated_attention.flags.set_gluon_backward` (on by default since its CUDA tests passed
on an H200, 2026-11-28).
"""

from __future__ import annotations

import functools
import warnings

import torch

from . import gluon_fwd

LOG2E = 1.4426950408889634
# block-major lse / delta rows padded to this multiple: the kernels' stationary tile
# (gluon_bwd_kernel.LPAD = BLK; tests/test_gluon_bwd.py checks they agree where Gluon imports)
LPAD = 128
# the three float32 accumulators of one call (dq, dk, dv) above this: the Triton backward
MAX_F32_BYTES = 8 << 30
# N % w != 0 (batch 1, under gluon_fwd.TAIL_SEGMENTS): each branch's short last segment (N % w
# rows) as a segment of its own, over views that start at its first row, after the branch's
# full segments (:func:`backward`), as the forward does (``gluon_fwd.launch_tail``). On since
# its CUDA tests passed on an H200 (2026-11-29, results/gluon_tail_h200_2026-11-29.md) and
# fuzz.py --gluon --gluon-bwd-tail ran 4,644 cases with 0 mismatches; the two sweep rows it
# changes ran fwd+bwd 21-26% faster (the float32 accumulators raise their peak from 1.13x to
# 1.75x the q/k/v/out/grads bytes). False: those calls run the Triton backward.
TAIL_SEGMENTS = True
# the dK/dV kernels of every branch first, into two float32 accumulators that are cast to the
# results' dtype and freed before the dQ kernels' accumulator is allocated (both kernels read
# only the FINAL lse and delta, so the order is free). Peak memory of a backward, in results of
# q's size (MHA): 5 inputs kept for it + 3 float32 accumulators (6) + a cast result = 12
# (1.50x the 8 tensors of a training call, measured on an H200 2026-11-29; 1.75x = 14 before the
# one-at-a-time casts) -> 5 + 4 + 1 = 10 (measured 1.25x; 1.41x at GQA 32 / 8). The cost: each
# branch's block-major lse / delta rows are built twice (two small gathers a branch). Its CUDA
# test passed (same bits as one phase, lower peak; H200, 2026-11-29). Its time, both arms
# interleaved in one process (benchmarks/split_ab.py, 5 rounds, H200 2026-11-29): on / off
# medians 1.004, 1.005, 1.000, 0.995 on the headline, headline-causal, GQA 32/8 causal and
# N 100000 causal rows (results/split_ab_h200_2026-11-29.md): it costs nothing, so it is on.
# False: one phase, all three accumulators alive (1.50x).
SPLIT_PHASES = True
KERNELS = ("dkdv", "dq")
CONSUMER_REGS = gluon_fwd.CONSUMER_REGS
LOADER_REGS = gluon_fwd.LOADER_REGS
MAXNREG = gluon_fwd.MAXNREG

_module = None  # gluon_bwd_kernel once imported
_import_error: str | None = None
_failed: dict[tuple, str] = {}  # (dtype, headdim, causal) -> why its first launch failed
_oom_warned = False  # note_out_of_memory warned


def kernel_module():
    """The kernel module, imported once; None when Gluon or its Hopper module is missing."""
    global _module, _import_error
    if _module is None and _import_error is None:
        _module, _import_error = gluon_fwd.import_kernels("gluon_bwd_kernel")
    return _module


def kv_stages(d: int) -> int:
    """dK/dV ring depth: K + V halves (2 x 2 x 64 x D) + STAGES x (q + dO tiles of 64 x D and
    their lse / delta rows): D = 128: 64 KB + 3 x 32.5 KB; D = 64: 32 KB + 4 x 16.5 KB."""
    return 3 if d == 128 else 4


def dq_bn(d: int) -> int:
    """Key rows per dQ tile: S, dP (64 x BN float32 each) and dQ (64 x D) in a warpgroup's
    registers."""
    return 64 if d == 128 else 128


DQ_STAGES = 3  # Q + dO halves (4 x 64 x D) + 3 x (K + V tiles of BN x D): <= 160 KB


def problem(q, k, v, causal: bool, branches, nh: int) -> str | None:
    """Why the Gluon backward cannot run these validated inputs and branches ((w, r, head start,
    head stop), each with heads); None: it can. ``nh``: q's heads."""
    why = gluon_fwd.shape_problem(q, k, v, branches)
    if why is not None:
        return why
    if not TAIL_SEGMENTS and any(q.shape[1] % w for w, _, _, _ in branches):
        return ("the Gluon backward needs N % w == 0 (gluon_bwd.TAIL_SEGMENTS is off; the forward "
                "may take a short last segment)")  # fmt: skip
    if any(hs != 0 or he != nh for _, _, hs, he in branches):
        return "the Gluon backward needs every branch over all heads (head_assignment='all')"
    bsz, n, _, d = q.shape
    f32_q, f32_kv = 4 * bsz * n * d * nh, 4 * bsz * n * d * 2 * k.shape[2]
    # all three float32 accumulators, with SPLIT_PHASES too (only two phases' worth are alive
    # then): the split lowers the peak of the calls this admits and moves no call to Gluon (at
    # max(dq, dk + dv), 16 x 128 calls of ~262K-524K tokens would move from the Triton backward's
    # ~8x q to the Gluon backward's 10x: unmeasured)
    f32 = f32_q + f32_kv
    if f32 > MAX_F32_BYTES:
        return f"the Gluon backward's float32 accumulators ({f32 / 2**30:.1f} GiB) pass MAX_F32_BYTES"
    key = (q.dtype, d, bool(causal))
    if key in _failed:
        return f"the Gluon backward failed here before: {_failed[key]}"
    if kernel_module() is None:
        return f"Gluon or its Hopper module is missing: {_import_error}"
    return None


def note_failure(q: torch.Tensor, causal: bool, err: BaseException) -> None:
    """Record a failed launch (the caller then runs the Triton backward) and warn once."""
    gluon_fwd.record_failure(_failed, "backward", "Triton backward", "DILATED_ATTENTION_GLUON_BWD",
                             q, causal, err)  # fmt: skip


def note_out_of_memory(q: torch.Tensor) -> None:
    """The float32 accumulators did not fit: this call runs the Triton backward (nothing is
    recorded, a later call may fit); warn once per process."""
    global _oom_warned
    if not _oom_warned:
        _oom_warned = True
        warnings.warn(
            f"dilated_attention: the Gluon backward's float32 accumulators (up to "
            f"{3 * q.numel() * 4 / 2**30:.2f} GiB for this call) did not fit in GPU memory; calls "
            "that do not fit run the Triton backward, which needs less (set "
            "DILATED_ATTENTION_GLUON_BWD=0 to always run it)",
            RuntimeWarning,
            stacklevel=4,
        )


def prep_rows(x: torch.Tensor, w: int, r: int, pad_value: float, mult: float = 1.0) -> torch.Tensor:
    """(B, H, N) float -> block-major float32 [B, H, N/w, Lp] of head h's residue c = h % r:
    ``y[b, h, s, t] = mult * x[b, h, s*w + c + r*t]`` for t < L_c (the block's rows:
    :func:`gluon_fwd.length_classes`); -inf -> +inf; rows t >= L_c pad_value. The torch form
    (the CPU tests' emulated path; on CUDA :func:`block_rows`)."""
    bsz, nh, n = x.shape
    big, nseg = -(-w // r), n // w
    cstar = w - r * (big - 1)
    lp = -(-big // LPAD) * LPAD
    c = torch.arange(nh, device=x.device) % r
    t = torch.arange(big, device=x.device)
    rows = (torch.arange(nseg, device=x.device) * w).view(1, nseg, 1) + c.view(nh, 1, 1) + r * t
    valid = t.view(1, 1, big) < big - (c >= cstar).long().view(nh, 1, 1)
    idx = torch.where(valid, rows, 0).view(1, nh, nseg * big).expand(bsz, nh, nseg * big)
    y = x.float().gather(-1, idx).view(bsz, nh, nseg, big) * mult
    y = torch.where(y == float("-inf"), torch.full_like(y, float("inf")), y)
    y = torch.where(valid, y, torch.full_like(y, pad_value))
    out = torch.full((bsz, nh, nseg, lp), pad_value, dtype=torch.float32, device=x.device)
    out[..., :big] = y
    return out


@functools.cache
def _rows_kernel():
    """The block-major rows kernel behind its direct launcher (imported on first use)."""
    from . import direct_launch, triton_kernels

    return direct_launch.DirectKernel(triton_kernels.gluon_bwd_rows_kernel, 4, max_plans=256)


def block_rows(lse: torch.Tensor, delta: torch.Tensor, w: int, r: int):
    """(lse2, delta2): :func:`prep_rows` of ``lse`` (mult LOG2E, pad +inf) and ``delta`` (pad 0)
    for branch (w, r) in one launch of ``triton_kernels.gluon_bwd_rows_kernel`` (the same values
    bit for bit: tests/test_gluon_bwd.py), where :func:`prep_rows` takes ~16 torch kernels.
    lse, delta (B, H, N) float32; N % w == 0 (w % r need not be)."""
    bsz, nh, n = lse.shape
    big, nseg = -(-w // r), n // w
    cstar = w - r * (big - 1)
    lp = -(-big // LPAD) * LPAD
    lse2 = torch.empty((bsz, nh, nseg, lp), dtype=torch.float32, device=lse.device)
    delta2 = torch.empty_like(lse2)
    if lse2.numel():
        _rows_kernel()[(lp // LPAD, nseg, bsz * nh)](
            lse, delta, lse2, delta2, *lse.stride(), *delta.stride(), nh, w, r, big, cstar, nseg,
            lp, LOG2E, BLOCK=LPAD,
        )  # fmt: skip
    return lse2, delta2


@functools.cache
def _row_layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _row_desc(x: torch.Tensor, rows: int):
    """1-D TMA descriptor of a flat float32 block-major row vector, box [rows] (Triton's
    ``TensorDescriptor``, for ``kernel[grid](...)``; :func:`_row_view` for ``gluon_fwd.launch``)."""
    return gluon_fwd.Desc(x, [x.numel()], [1], [rows], _row_layout()).real()


def _row_view(x: torch.Tensor, rows: int):
    """:func:`_row_desc` as ``gluon_fwd.launch`` takes it (``gluon_fwd.LIGHT_DESCRIPTORS``)."""
    return gluon_fwd._descriptor(x, [x.numel()], [1], [rows], _row_layout())


def launch_branch(q, k, v, dout, lse2, delta2, dq, dk, dv, w: int, r: int, causal: bool,
                  scale: float, add: bool = True, kernels: tuple[str, ...] = KERNELS,
                  chains: dict | None = None) -> None:  # fmt: skip
    """Add branch (w, r)'s dK, dV and dQ (all heads) into the float32 accumulators dq (B, N, H,
    D), dk, dv (B, N, Hkv, D), contiguous; lse2 / delta2 block-major (:func:`prep_rows`).
    ``add`` False: store instead (the rows this branch reads; r = 1: all of them). ``kernels``:
    which of "dkdv" and "dq" to launch (the other's accumulators may be None). ``chains``: per
    kernel, the ``gluon_fwd.Chain`` of its launches in this call (None: no dependent launches):
    a dK/dV launch depends on the previous dK/dV launch, a dQ launch on the previous dQ launch,
    so each kernel's launches must follow one another on the stream (:data:`SPLIT_PHASES`)."""
    chains = chains or {}
    mod = kernel_module()
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    rep = nh // hkv
    nseg = n // w
    if nseg == 0:  # N < w: the short last segment is all (its own launch)
        return
    lp = lse2.shape[-1]
    bd = gluon_fwd.block_view
    bn = dq_bn(d)
    # one launch of each kernel per block-length class (w % r != 0: two, gluon_fwd.length_classes)
    for big_l, c0, c1 in gluon_fwd.length_classes(w, r):
        classes = (c0, c1) != (0, r)
        cw = c1 - c0
        nhb = gluon_fwd.class_heads(0, nh, r, c0, c1) if classes else nh
        if nhb == 0:  # no query head reads blocks of this length (H < r)
            continue
        nnb = -(-big_l // mod.BLK)
        ni = min(rep, r)
        if "dkdv" in kernels:
            gluon_fwd.launch(mod.dkdv_kernel, (nnb * nseg, bsz * hkv * (cw if classes else ni)), (
                bd(q, w, r, mod.BMQ, big_l), bd(dout, w, r, mod.BMQ, big_l), bd(k, w, r, mod.WG_M, big_l),
                bd(v, w, r, mod.WG_M, big_l), _row_view(lse2, mod.BMQ), _row_view(delta2, mod.BMQ), dk,
                dv, scale * LOG2E, scale, big_l, w, nseg, nnb, r, nh, hkv, rep, ni, lp, c0, cw),
                dict(BMQ=mod.BMQ, D=d, STAGES=kv_stages(d), CAUSAL=bool(causal), ADD=bool(add),
                     CLASSES=classes, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS,
                     num_warps=4, maxnreg=MAXNREG),
                _next(chains, "dkdv"),
            )  # fmt: skip
        if "dq" in kernels:
            gluon_fwd.launch(mod.dq_kernel, (nnb * nseg, bsz * nhb), (
                bd(q, w, r, mod.WG_M, big_l), bd(dout, w, r, mod.WG_M, big_l), bd(k, w, r, bn, big_l),
                bd(v, w, r, bn, big_l), dq, lse2, delta2, scale * LOG2E, scale, big_l, w, nseg, nnb, r,
                nh, hkv, lp, nhb, c0, cw), dict(BN=bn, D=d, STAGES=DQ_STAGES, CAUSAL=bool(causal),
                ADD=bool(add), CLASSES=classes, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS,
                num_warps=4, maxnreg=MAXNREG),
                _next(chains, "dq"),
            )  # fmt: skip


def _next(chains: dict, kernel: str) -> bool:
    c = chains.get(kernel)
    return c is not None and c.next()


def backward(dout, q, k, v, delta, lse, branches, causal: bool, scale: float):
    """dq, dk, dv (the inputs' dtypes) of the branches, given the FINAL lse (B, H, N) float32
    and delta = rowsum(dO * out) (B, H, N) float32 (``triton_launch._delta``); inputs as
    :func:`problem` accepts (dout: any layout). With :data:`SPLIT_PHASES`, every branch's dK/dV
    first and its dQ after, each phase's accumulators cast and freed before the next. The
    block-major lse / delta rows of every branch are built once, before the first launch: both
    phases read them, and a phase's launches follow one another with nothing between them
    (``gluon_fwd.PDL``)."""
    if gluon_fwd.view_problem("dout", dout) is not None:
        dout = dout.contiguous()
    # a first branch with r = 1 (over all heads: :func:`problem`) stores every row of the three
    # results (its blocks are whole segments, and so is its short last segment's): no fill, and
    # it stores, not adds
    store_first = branches[0][1] == 1
    jobs = _jobs(dout, q, k, v, delta, lse, branches, store_first)

    def run(dq, dk, dv, kernels):
        # a phase of one kernel (SPLIT_PHASES) is one chain; in a phase of both the kernels
        # alternate, so no launch follows one of its own chain: no dependent launches
        chains = {kernels[0]: gluon_fwd.chain(q)} if len(kernels) == 1 else None
        _launch_jobs(jobs, dq, dk, dv, kernels, causal, scale, chains)

    return accumulate(q, k, v, store_first, run)


def accumulate(q, k, v, store_first: bool, run):
    """dq, dk, dv (q's, k's and v's shapes and dtypes) from ``run(dq, dk, dv, kernels)``, which
    launches ``kernels`` ("dkdv", "dq") into float32 accumulators (None where not launched):
    zeros, or empty where ``store_first``. With :data:`SPLIT_PHASES` the dK/dV phase first, its
    accumulators cast and freed before the dQ phase's is allocated; else one phase. Shared by
    :func:`backward` and the packed documents' (``gluon_varlen.backward``)."""
    alloc = torch.empty if store_first else torch.zeros
    if not SPLIT_PHASES:
        accs = [alloc(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v)]
        run(*accs, KERNELS)
        return _cast_each(accs, (q.dtype, k.dtype, v.dtype))
    accs = [alloc(x.shape, dtype=torch.float32, device=q.device) for x in (k, v)]
    run(None, *accs, ("dkdv",))
    dk, dv = _cast_each(accs, (k.dtype, v.dtype))
    accs = [alloc(q.shape, dtype=torch.float32, device=q.device)]
    run(accs[0], None, None, ("dq",))
    (dq,) = _cast_each(accs, (q.dtype,))
    return dq, dk, dv


def _cast_each(accs: list, dtypes) -> list:
    """Each accumulator cast to its dtype, the list's reference dropped as soon as it is cast
    (``accs`` must hold the only references): one float32 accumulator and one result live
    together at a time, not all of them."""
    out = []
    for i, dt in enumerate(dtypes):
        out.append(accs[i].to(dt))
        accs[i] = None
    return out


def _jobs(dout, q, k, v, delta, lse, branches, store_first: bool) -> list[tuple]:
    """The launches of :func:`backward`, in order, each with its block-major rows built: per
    branch (and batch entry, gluon_fwd.TAIL_BATCHES), its full segments and its short last
    segment: (branch's add, batch slice or None, first row, segment length, r, q / k / v / dout
    views, lse2, delta2)."""
    n = q.shape[1]
    entries = gluon_fwd.batch_entries(q.shape[0], n, branches)
    out = []
    for bi, (w, r, _, _) in enumerate(branches):
        add = bi > 0 or not store_first
        for e, (qe, ke, ve, doe, lse_e, de) in zip(entries or [None], gluon_fwd.entry_views(
                entries, q, k, v, dout, lse, delta), strict=True):  # fmt: skip
            parts = [(0, w)] + ([(n - n % w, n % w)] if n % w else [])
            for t0, wl in parts:
                views = (qe, ke, ve, doe) if t0 == 0 else tuple(x[:, t0:] for x in (qe, ke, ve, doe))
                lse2, delta2 = _rows(views[0], lse_e[..., t0:], de[..., t0:], wl, r)
                out.append((add, e, t0, wl, r, views, lse2, delta2))
    return out


def _rows(q, lse, delta, w: int, r: int):
    """Branch (w, r)'s block-major lse and delta rows over the full segments of the views."""
    if q.is_cuda:
        return block_rows(lse, delta, w, r)
    # the CPU tests' emulated kernels (tests/test_gluon_bwd.py)
    return prep_rows(lse, w, r, float("inf"), LOG2E), prep_rows(delta, w, r, 0.0)


def _launch_jobs(jobs, dq, dk, dv, kernels, causal: bool, scale: float, chains) -> None:
    """Launch ``kernels`` of every job (:func:`_jobs`) into the accumulators (None where not
    launched), sliced as each job's views are."""
    for add, e, t0, wl, r, (qv, kv, vv, dov), lse2, delta2 in jobs:
        accs = [None if x is None else (x if e is None else x[e]) for x in (dq, dk, dv)]
        if t0:
            accs = [None if x is None else x[:, t0:] for x in accs]
        launch_branch(qv, kv, vv, dov, lse2, delta2, *accs, wl, r, causal, scale, add=add, kernels=kernels,
                      chains=chains)  # fmt: skip
