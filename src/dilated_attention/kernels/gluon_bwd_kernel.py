"""The Gluon (Triton 3.6) backward kernels of one dilated branch on Hopper (issue 24): dK/dV and
dQ in FlashAttention-3's structure. Imported only by :mod:`.gluon_bwd` (lazily): importing it
needs ``triton.experimental.gluon`` with its Hopper module (written against Triton 3.6.0).

Math (docs/spec.md): the exact backward of branch (w, r) with the FINAL merged out and lse:
``P = exp(S - lse)``, ``delta = rowsum(dO * out)``, ``dS = P * (dP - delta)``, ``dV = P^T dO``,
``dK = scale * dS^T Q``, ``dQ = scale * dS K``, on the dilated blocks (rows ``s*w + c + r*t``,
c = h % r, t < L = w // r; the host asks ``N % w == 0``; with ``w % r != 0`` it launches each
length class of the branch apart, CLASSES: ``gluon_fwd.length_classes``). Results are
float32 (B, N, heads, D) buffers, contiguous, that every branch adds into (``ADD``).

lse and delta come block-major (``gluon_bwd.prep_rows``): float32 ``[B, H, N/w, Lp]`` of head
h's residue (Lp = L rounded up to 128), lse times log2(e) with -inf (a row without a key) and
the padding as +inf (P = 0), delta padded with 0.

:func:`dkdv_kernel`: one program per (key tile of 128 rows of a block, segment, batch x kv head
x residue class) (``h0 = g*rep + i0``, ``c = h0 % r``); it loops over the query heads ``h0, h0 +
r, ... < (g+1)*rep`` (GQA summed in registers: no atomics, deterministic) and over the query
tiles of 64 rows (causal: from the key tile's first row on; the two that straddle the diagonal
masked). A 1-warp loader (K and V halves once, then q / dO tiles and their lse / delta rows by
TMA into a ring of STAGES), two consumer warpgroups of 64 key rows each: S^T = K Q^T and dP^T =
V dO^T (async wgmma), P^T = exp2(S^T*scale*log2e - lse2), dV += P^T dO, dS^T = P^T (dP^T -
delta), dK += dS^T Q; dK *= scale; float32 stores (or adds) of the rows t < L.

:func:`dq_kernel`: one program per (query tile of 128 rows, segment, batch x head), the
forward's structure (loader: Q and dO halves once, then K / V tiles of BN rows in a ring; two
consumer warpgroups of 64 query rows): S = Q K^T and dP = dO V^T, P, dS, dQ += dS K;
dQ *= scale. Causal: key tiles up to the program's last row, those from its first row on masked.

Rows t >= L of a partial tile are zero-filled by TMA and padded in lse (+inf) and delta (0), so
they add exactly zero: only the causal diagonal needs a mask. (The packed-documents kernels over
host descriptors, ``gluon_varlen_kernel``, read real rows past a block's end: queries there still
get P = 0 from the +inf lse, keys there are masked in dQ's last tile, ``n_full`` = L // BN.) Measured as a prototype
(benchmarks/gluon_dilated_bwd.py, results/gluon_bwd_h200_2026-11-28.md): 1.29-1.54x the Triton
backward per branch on an H200, bitwise repeatable.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_fwd_kernel import gdc_launch_dependents, gdc_wait

WG_M = 64  # rows of one consumer warpgroup (wgmma M)
BLK = 2 * WG_M  # rows of a program's stationary tile (two consumer warpgroups)
BMQ = 64  # query rows per streamed tile of the dK/dV kernel
LPAD = BLK  # block-major lse / delta rows padded to this multiple (the dQ tile: no mask)

_WGM = gl.constexpr(WG_M)

# -------------------------------------------------------------------------- dK / dV

@gluon.jit
def _kv_loader(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, k_bufs, v_bufs, q_bufs,
               do_bufs, l_bufs, dl_bufs, kv_bar, q_ready, do_ready, q_empty, do_empty,
               blk, n_lo, kv_col, c, h_start, nhl, m_first, n_qt, b, s, H, R, NSEG, LP, row_off,
               BMQ: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    # the stationary K and V halves (one per consumer) on one barrier; the block's row t is the
    # descriptors' row row_off + t (0 but in the packed kernels over host descriptors)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(
            k_desc, [blk, row_off + n_lo + i * _WGM, kv_col, 0], kv_bar, k_bufs.index(i)
        )
        tma.async_copy_global_to_shared(
            v_desc, [blk, row_off + n_lo + i * _WGM, kv_col, 0], kv_bar, v_bufs.index(i)
        )
    cnt = 0
    for hi in range(nhl):
        h = h_start + hi * R
        q_col = c * H + h
        lrow = ((b * H + h) * NSEG + s) * LP
        for j in range(n_qt):
            m = m_first + j * BMQ
            st = cnt % STAGES
            ph = (cnt // STAGES) & 1
            # a fresh barrier counts as having completed the phase before phase 0
            mbarrier.wait(q_empty.index(st), ph ^ 1)
            mbarrier.expect(q_ready.index(st),
                            q_desc.block_type.nbytes + l_desc.block_type.nbytes)  # fmt: skip
            tma.async_copy_global_to_shared(
                q_desc, [blk, row_off + m, q_col, 0], q_ready.index(st), q_bufs.index(st)
            )
            tma.async_copy_global_to_shared(
                l_desc, [lrow + m], q_ready.index(st), l_bufs.index(st)
            )
            mbarrier.wait(do_empty.index(st), ph ^ 1)
            mbarrier.expect(do_ready.index(st),
                            do_desc.block_type.nbytes + dl_desc.block_type.nbytes)  # fmt: skip
            tma.async_copy_global_to_shared(
                do_desc, [blk, row_off + m, q_col, 0], do_ready.index(st), do_bufs.index(st)
            )
            tma.async_copy_global_to_shared(
                dl_desc, [lrow + m], do_ready.index(st), dl_bufs.index(st)
            )
            cnt += 1

@gluon.jit
def _kv_step(cnt, m, key0, k_tile, v_tile, q_bufs, do_bufs, l_bufs, dl_bufs, q_ready,
             do_ready, q_empty, do_empty, dk, dv, s_zero, qk_scale, BMQ: gl.constexpr,
             D: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
             s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    # one streamed query tile of 64 rows (first row m) against this warpgroup's 64 keys
    dtype: gl.constexpr = k_tile.dtype
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                  k_width=2)  # fmt: skip
    st = cnt % STAGES
    ph = (cnt // STAGES) & 1
    mbarrier.wait(q_ready.index(st), ph)
    q_s = q_bufs.index(st).reshape([BMQ, D])
    s_tok = warpgroup_mma(k_tile, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(st), ph)
    do_s = do_bufs.index(st).reshape([BMQ, D])
    dp_tok = warpgroup_mma(v_tile, do_s.permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
    st_acc = warpgroup_mma_wait(1, deps=(s_tok,))
    lse2 = l_bufs.index(st).load(gl.SliceLayout(0, s_layout))
    pt = gl.exp2(st_acc * qk_scale - gl.expand_dims(lse2, 0))
    if MASKED:
        keys = key0 + gl.arange(0, _WGM, layout=gl.SliceLayout(1, s_layout))
        qrows = m + gl.arange(0, BMQ, layout=gl.SliceLayout(0, s_layout))
        pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(qrows, 0), pt, 0.0)
    pt_op = gl.convert_layout(pt.to(dtype), op_layout)
    dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=(dp_tok,))
    dlt = dl_bufs.index(st).load(gl.SliceLayout(0, s_layout))
    dst = pt * (dpt - gl.expand_dims(dlt, 0))
    ds_op = gl.convert_layout(dst.to(dtype), op_layout)
    dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
    dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pt_op, ds_op))
    mbarrier.arrive(q_empty.index(st))
    mbarrier.arrive(do_empty.index(st))
    return dk, dv

@gluon.jit
def _kv_consumer(wg: gl.constexpr, k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar,
                 q_ready, do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c, g, nhl,
                 m_first, n_qt, n_diag, L, W, R, HKV, qk_scale, sm_scale,
                 BMQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 ADD: gl.constexpr):  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BMQ, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    key0 = n_lo + wg * _WGM
    k_tile = k_bufs.index(wg).reshape([_WGM, D])
    v_tile = v_bufs.index(wg).reshape([_WGM, D])
    dk = gl.zeros([_WGM, D], gl.float32, layout=o_layout)
    dv = gl.zeros([_WGM, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([_WGM, BMQ], gl.float32, layout=s_layout)
    mbarrier.wait(kv_bar, 0)
    cnt = 0
    for _hi in range(nhl):
        # the tiles [0, n_diag) straddle the causal diagonal: masked; the rest not
        for j in range(n_diag):
            dk, dv = _kv_step(cnt, m_first + j * BMQ, key0, k_tile, v_tile, q_bufs,
                              do_bufs, l_bufs, dl_bufs, q_ready, do_ready, q_empty,
                              do_empty, dk, dv, s_zero, qk_scale, BMQ, D, STAGES, True,
                              s_layout, o_layout)  # fmt: skip
            cnt += 1
        for j in range(n_diag, n_qt):
            dk, dv = _kv_step(cnt, m_first + j * BMQ, key0, k_tile, v_tile, q_bufs,
                              do_bufs, l_bufs, dl_bufs, q_ready, do_ready, q_empty,
                              do_empty, dk, dv, s_zero, qk_scale, BMQ, D, STAGES, False,
                              s_layout, o_layout)  # fmt: skip
            cnt += 1
    dk = dk * sm_scale
    # float32 results (B, N, Hkv, D): key row t of the block is position blk*W + c + R*t
    t = key0 + gl.arange(0, _WGM, layout=gl.SliceLayout(1, o_layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    pos = blk.to(gl.int64) * W + c + R * t
    off = gl.expand_dims((pos * HKV + g) * D, 1) + gl.expand_dims(d, 0)
    mask = gl.expand_dims(t < L, 1) & gl.expand_dims(d < D, 0)
    # the previous launch's dK / dV rows complete (a no-op without PDL: gluon_fwd_kernel.gdc_wait)
    gdc_wait()
    if ADD:
        dk = dk + gl.load(DK + off, mask=mask, other=0.0)
        dv = dv + gl.load(DV + off, mask=mask, other=0.0)
    gl.store(DK + off, dk, mask=mask)
    gl.store(DV + off, dv, mask=mask)

@gluon.jit
def _kv_consumer_wg0(k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar, q_ready,
                     do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c, g, nhl, m_first,
                     n_qt, n_diag, L, W, R, HKV, qk_scale, sm_scale, BMQ: gl.constexpr,
                     D: gl.constexpr, STAGES: gl.constexpr, ADD: gl.constexpr):  # fmt: skip
    _kv_consumer(0, k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar, q_ready,
                 do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c, g, nhl, m_first, n_qt,
                 n_diag, L, W, R, HKV, qk_scale, sm_scale, BMQ, D, STAGES, ADD)  # fmt: skip

@gluon.jit
def _kv_consumer_wg1(k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar, q_ready,
                     do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c, g, nhl, m_first,
                     n_qt, n_diag, L, W, R, HKV, qk_scale, sm_scale, BMQ: gl.constexpr,
                     D: gl.constexpr, STAGES: gl.constexpr, ADD: gl.constexpr):  # fmt: skip
    _kv_consumer(1, k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar, q_ready,
                 do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c, g, nhl, m_first, n_qt,
                 n_diag, L, W, R, HKV, qk_scale, sm_scale, BMQ, D, STAGES, ADD)  # fmt: skip

@gluon.jit
def dkdv_kernel(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, qk_scale,
                 sm_scale, L, W, NSEG, NNB, R, H, HKV, REP, NI, LP, C0, CW, BMQ: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 ADD: gl.constexpr, CLASSES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 LOADER_REGS: gl.constexpr):  # fmt: skip
    gdc_launch_dependents()
    pid0 = gl.program_id(0)
    pid_x = gl.program_id(1)
    pid_n = pid0 % NNB
    s = pid0 // NNB
    if CLASSES:
        # one length class of a branch with W % R != 0 (offsets [C0, C0 + CW), L rows each):
        # programs per (batch, kv head g, offset c); the query heads of g with offset c start
        # at g*REP + i0, i0 = (c - g*REP) mod R; none when i0 >= REP (nhl = 0: dK, dV += 0)
        b = pid_x // (HKV * CW)
        g = (pid_x // CW) % HKV
        c_cls = C0 + pid_x % CW
        i0 = ((c_cls - g * REP) % R + R) % R
    else:
        b = pid_x // (HKV * NI)
        g = (pid_x // NI) % HKV
        i0 = pid_x % NI
    h_start = g * REP + i0
    c = h_start % R
    # query heads of kv head g with residue c: h_start, h_start + R, ... < (g + 1) * REP
    nhl = ((g + 1) * REP - h_start + R - 1) // R
    n_lo = pid_n * (2 * _WGM)
    blk = b * NSEG + s
    kv_col = c * HKV + g
    m_first, n_qt, n_diag = query_tiles(L, n_lo, BMQ, CAUSAL)

    _dkdv_program(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, blk, blk, n_lo, kv_col, c, c, g,
                  h_start, nhl, m_first, n_qt, n_diag, b, s, L, W, R, H, HKV, NSEG, LP, qk_scale, sm_scale, 0,
                  BMQ, D, STAGES, ADD, CONSUMER_REGS, LOADER_REGS)  # fmt: skip

@gluon.jit
def query_tiles(L, n_lo, BMQ: gl.constexpr, CAUSAL: gl.constexpr):
    """(m_first, n_qt, n_diag) of a dK/dV program from key row n_lo of a block of L rows: its
    query tiles of BMQ rows from m_first (causal: the key tile's first row), n_qt of them, the
    first n_diag straddling the causal diagonal (masked)."""
    n_qt_all = gl.cdiv(L, BMQ)
    if CAUSAL:
        m_first = n_lo
        n_qt = n_qt_all - n_lo // BMQ
        n_diag = gl.minimum(n_qt, (2 * _WGM) // BMQ)
    else:
        m_first = n_lo * 0
        n_qt = n_qt_all
        n_diag = n_qt * 0
    return m_first, n_qt, n_diag


@gluon.jit
def _dkdv_program(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, blk, ld_blk, n_lo, kv_col, c,
                  ld_c, g, h_start, nhl, m_first, n_qt, n_diag, b, s, L, W, R, H, HKV, NSEG, LP, qk_scale,
                  sm_scale, row_off, BMQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                  ADD: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """One dK/dV program once its key tile is known: the shared buffers and barriers, then the
    loader and the two consumer warpgroups (:func:`dkdv_kernel`). ``blk`` / ``c``: the block
    and residue of the dK / dV rows the consumers store; ``ld_blk`` / ``ld_c``: those the loader
    addresses in the descriptors (the block's row t at the descriptors' row ``row_off + t``). They
    are the same here; the packed-documents kernels (``gluon_varlen_kernel``) pass descriptors that
    start at their block (0 for the loader) or host descriptors over the whole stream (``ld_c``:
    the block's residue, ``row_off``: its first row there)."""
    dtype: gl.constexpr = q_desc.dtype
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape,
                                       q_desc.layout)  # fmt: skip
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)  # fmt: skip
    l_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + l_desc.block_type.shape,
                                       l_desc.layout)  # fmt: skip
    dl_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + dl_desc.block_type.shape,
                                        dl_desc.layout)  # fmt: skip
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        # one arrival per consumer warpgroup
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)

    gl.warp_specialize(
        [
            (_kv_consumer_wg0, (k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar,
                                q_ready, do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c,
                                g, nhl, m_first, n_qt, n_diag, L, W, R, HKV, qk_scale,
                                sm_scale, BMQ, D, STAGES, ADD)),
            (_kv_consumer_wg1, (k_bufs, v_bufs, q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar,
                                q_ready, do_ready, q_empty, do_empty, DK, DV, blk, n_lo, c,
                                g, nhl, m_first, n_qt, n_diag, L, W, R, HKV, qk_scale,
                                sm_scale, BMQ, D, STAGES, ADD)),
            (_kv_loader, (q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, k_bufs, v_bufs,
                          q_bufs, do_bufs, l_bufs, dl_bufs, kv_bar, q_ready, do_ready,
                          q_empty, do_empty, ld_blk, n_lo, kv_col, ld_c, h_start, nhl, m_first,
                          n_qt, b, s, H, R, NSEG, LP, row_off, BMQ, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip

# -------------------------------------------------------------------------- dQ

@gluon.jit
def _q_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_bar,
              k_ready, v_ready, k_empty, v_empty, blk, q_row0, q_col, kv_col, n_tiles, row_off,
              BN: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    # the stationary Q and dO halves (one per consumer) on one barrier
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(
            q_desc, [blk, row_off + q_row0 + i * _WGM, q_col, 0], q_bar, q_bufs.index(i)
        )
        tma.async_copy_global_to_shared(
            do_desc, [blk, row_off + q_row0 + i * _WGM, q_col, 0], q_bar, do_bufs.index(i)
        )
    for j in range(n_tiles):
        st = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [blk, row_off + j * BN, kv_col, 0], k_ready.index(st), k_bufs.index(st)
        )
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [blk, row_off + j * BN, kv_col, 0], v_ready.index(st), v_bufs.index(st)
        )

@gluon.jit
def _q_step(j, row0, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
            dq, lse2, dlt, s_zero, qk_scale, L, BN: gl.constexpr, D: gl.constexpr,
            STAGES: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
            o_layout: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = q_tile.dtype
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                  k_width=2)  # fmt: skip
    st = j % STAGES
    ph = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(st), ph)
    k_s = k_bufs.index(st).reshape([BN, D])
    s_tok = warpgroup_mma(q_tile, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(st), ph)
    v_s = v_bufs.index(st).reshape([BN, D])
    dp_tok = warpgroup_mma(do_tile, v_s.permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:
        cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:
            # keys above the diagonal (and so keys t >= L of every query row t < L)
            rows = row0 + gl.arange(0, _WGM, layout=gl.SliceLayout(1, s_layout))
            p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), p, 0.0)
        else:
            # keys t >= L, read past a block's end by host descriptors (the packed kernels': the
            # other kernels have no masked tile when not causal, TMA zero-fills their keys t >= L)
            p = gl.where(gl.expand_dims(cols < L, 0), p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp_tok,))
    mbarrier.arrive(v_empty.index(st))
    ds = p * (dp - gl.expand_dims(dlt, 1))
    ds_op = gl.convert_layout(ds.to(dtype), op_layout)
    dq_tok = warpgroup_mma(ds_op, k_s, dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
    mbarrier.arrive(k_empty.index(st))
    return dq

@gluon.jit
def _q_consumer(wg: gl.constexpr, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready,
                k_empty, v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h, n_tiles, n_full,
                L, W, R, H, qk_scale, sm_scale, BN: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr):  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    row0 = q_row0 + wg * _WGM
    q_tile = q_bufs.index(wg).reshape([_WGM, D])
    do_tile = do_bufs.index(wg).reshape([_WGM, D])
    # block-major lse2 / delta: padded to a multiple of 64 rows, no mask
    rows_s = row0 + gl.arange(0, _WGM, layout=gl.SliceLayout(1, s_layout))
    lse2 = gl.load(LSE2 + lrow + rows_s)
    dlt = gl.load(DELTA + lrow + rows_s)
    dq = gl.zeros([_WGM, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([_WGM, BN], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_full):
        dq = _q_step(j, row0, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                     v_empty, dq, lse2, dlt, s_zero, qk_scale, L, BN, D, STAGES, False, CAUSAL,
                     s_layout, o_layout)  # fmt: skip
    for j in range(n_full, n_tiles):
        dq = _q_step(j, row0, q_tile, do_tile, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                     v_empty, dq, lse2, dlt, s_zero, qk_scale, L, BN, D, STAGES, True, CAUSAL,
                     s_layout, o_layout)  # fmt: skip
    dq = dq * sm_scale
    t = row0 + gl.arange(0, _WGM, layout=gl.SliceLayout(1, o_layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    pos = blk.to(gl.int64) * W + c + R * t
    off = gl.expand_dims((pos * H + h) * D, 1) + gl.expand_dims(d, 0)
    mask = gl.expand_dims(t < L, 1) & gl.expand_dims(d < D, 0)
    gdc_wait()  # the previous launch's dQ rows complete (a no-op without PDL)
    if ADD:
        dq = dq + gl.load(DQ + off, mask=mask, other=0.0)
    gl.store(DQ + off, dq, mask=mask)

@gluon.jit
def _q_consumer_wg0(q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty,
                    v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h, n_tiles, n_full, L, W,
                    R, H, qk_scale, sm_scale, BN: gl.constexpr, D: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr):  # fmt: skip
    _q_consumer(0, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty,
                v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h, n_tiles, n_full, L, W, R,
                H, qk_scale, sm_scale, BN, D, STAGES, CAUSAL, ADD)  # fmt: skip

@gluon.jit
def _q_consumer_wg1(q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty,
                    v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h, n_tiles, n_full, L, W,
                    R, H, qk_scale, sm_scale, BN: gl.constexpr, D: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr):  # fmt: skip
    _q_consumer(1, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty,
                v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h, n_tiles, n_full, L, W, R,
                H, qk_scale, sm_scale, BN, D, STAGES, CAUSAL, ADD)  # fmt: skip

@gluon.jit
def dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, qk_scale, sm_scale, L, W,
               NSEG, NMB, R, H, HKV, LP, NHB, C0, CW, BN: gl.constexpr, D: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr,
               CLASSES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               LOADER_REGS: gl.constexpr):  # fmt: skip
    gdc_launch_dependents()
    pid0 = gl.program_id(0)
    bh = gl.program_id(1)
    pid_m = pid0 % NMB
    s = pid0 // NMB
    if CLASSES:
        # one length class: the NHB heads whose offset lies in [C0, C0 + CW) (all heads)
        b = bh // NHB
        i = bh % NHB
        h = (i // CW) * R + C0 + i % CW
    else:
        b = bh // H
        h = bh % H
    c = h % R
    hk = h // (H // HKV)
    q_row0 = pid_m * (2 * _WGM)
    blk = b * NSEG + s
    q_col = c * H + h
    kv_col = c * HKV + hk
    lrow = ((b * H + h) * NSEG + s).to(gl.int64) * LP
    n_tiles, n_full = dq_key_tiles(L, q_row0, BN, CAUSAL, False)

    _dq_program(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, lrow, blk, blk, q_row0, q_col, kv_col, c, h,
                n_tiles, n_full, L, W, R, H, qk_scale, sm_scale, 0, BN, D, STAGES, CAUSAL, ADD, CONSUMER_REGS,
                LOADER_REGS)  # fmt: skip

@gluon.jit
def dq_key_tiles(L, q_row0, BN: gl.constexpr, CAUSAL: gl.constexpr, MASK_TAIL: gl.constexpr):
    """(n_tiles, n_full) of a dQ program from query row q_row0 of a block of L rows: its key tiles
    of BN rows (causal: up to its last row); those from n_full on are masked (causal: from its
    first row on; else, ``MASK_TAIL``, the last when it has keys t >= L, which host descriptors
    read from the stream; without it TMA zero-fills them and no tile is masked)."""
    n_kv = gl.cdiv(L, BN)
    if CAUSAL:
        n_tiles = gl.minimum(n_kv, gl.cdiv(q_row0 + 2 * _WGM, BN))
        n_full = gl.minimum(q_row0 // BN, n_tiles)
    else:
        n_tiles = n_kv
        if MASK_TAIL:
            n_full = L // BN
        else:
            n_full = n_kv
    return n_tiles, n_full


@gluon.jit
def _dq_program(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, lrow, blk, ld_blk, q_row0, q_col, kv_col, c,
                h, n_tiles, n_full, L, W, R, H, qk_scale, sm_scale, row_off, BN: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                LOADER_REGS: gl.constexpr):  # fmt: skip
    """One dQ program once its query tile is known: the shared buffers and barriers, then the
    loader and the two consumer warpgroups (:func:`dq_kernel`). ``blk``: the block of the dQ
    rows the consumers store; ``ld_blk``: the block the loader addresses, the block's row t at the
    descriptors' row ``row_off + t`` (the same block and 0 here; the packed-documents kernels pass
    0 and 0 for descriptors that start at their block, or 0 and the block's first row for host
    descriptors over the whole stream). Tiles from ``n_full`` on are masked: ``CAUSAL``, the keys
    above the diagonal; else keys t >= L."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape,
                                        do_desc.layout)  # fmt: skip
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)  # fmt: skip
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)  # fmt: skip
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize(
        [
            (_q_consumer_wg0, (q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready,
                               k_empty, v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h,
                               n_tiles, n_full, L, W, R, H, qk_scale, sm_scale, BN, D,
                               STAGES, CAUSAL, ADD)),
            (_q_consumer_wg1, (q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready,
                               k_empty, v_empty, DQ, LSE2, DELTA, lrow, blk, q_row0, c, h,
                               n_tiles, n_full, L, W, R, H, qk_scale, sm_scale, BN, D,
                               STAGES, CAUSAL, ADD)),
            (_q_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                         q_bar, k_ready, v_ready, k_empty, v_empty, ld_blk, q_row0, q_col,
                         kv_col, n_tiles, row_off, BN, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip
