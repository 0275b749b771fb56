"""The Gluon (Triton 3.6) forward kernel of one dilated branch on Hopper: FlashAttention-3's
structure (issue 24). Imported only by :mod:`.gluon_fwd` (lazily, on the first call that can
use it): importing it needs ``triton.experimental.gluon`` with its Hopper module, whose API moves
between Triton versions (written against 3.6.0).

Math (docs/spec.md): branch (w, r) splits the positions into segments of w rows; query head h
reads the rows ``s*w + c + r*t`` (t = 0..L-1, c = h % r, L = ceil((w - c) / r): the host asks
``N % w == 0``; with ``w % r != 0`` the offsets fall in two length classes, launched apart with
their own L and descriptors) of segment s; inside such a block it is plain dense attention
(causal inside the block when causal).

:func:`gluon_fwd_kernel`, one program per (query tile of BM = 128 rows, segment, batch x head);
three partitions of ``gl.warp_specialize``:

- loader (1 warp, 24 registers): TMA loads of the two Q halves, then the K and V tiles of BN
  rows into a ring of STAGES buffers each, with mbarrier expect-tx (ready) and the consumers'
  release barriers (empty, two arrivals: one per consumer warpgroup).
- two consumer warpgroups (the default partition and one 4-warp worker, 240 registers each
  through setmaxnreg), 64 query rows each: S = Q K^T by async wgmma (Q and K from shared
  memory), online softmax in fp32 registers (exp2, scale folded), O += P V by async wgmma with
  P from registers, software pipelined as FA3's intra-warpgroup overlap (the QK^T of tile j is
  issued before the PV of tile j-1).
- epilogue per consumer (:func:`_epilogue`): the branch's (out, lse) merged into the result by
  LSE weights with the library's compensated (hi, lo) pair, as the Triton forward's epilogue
  (``triton_kernels.dilated_fwd_kernel``): ``FIRST`` stores without reading, ``COMP`` reads and
  ``STORE_LO`` writes the lo buffer.

Strided blocks through TMA: q is viewed as the 4-D tensor [B*N/w, L, r*H, D] with strides
[w*sn, r*sn, sh, 1] (sn = H*sh: heads dense in a row; index (b*nseg + s, t, c*H + h, d)); k
and v likewise with Hkv (GQA: kv head h // (H // Hkv)). A box [1, rows, 1, D] of that view is
one 2-D tile of a dilated block; the shared buffer is ``.reshape``d to the [rows, D] tile that
wgmma reads. TMA zero-fills rows t >= L; the scores of keys t >= L (and j > i when causal) are
masked to -inf, only on the tiles that need it. Causal: key tiles past the program's last row
are skipped. Design notes and measurements: benchmarks/NOTES_triton.md (Gluon forward).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = 0.6931471805599453
# consumer warpgroup rows (wgmma M per warpgroup) and the program's rows (two consumers)
WG_M = 64
BM = 2 * WG_M

# the kernels read these globals: Triton wants them as constexpr objects
_WGM = gl.constexpr(WG_M)
_LN2 = gl.constexpr(LN2)


# Programmatic dependent launch (``gluon_fwd.PDL``): every program lets the next kernel of the
# stream start (``launch_dependents``) as soon as it runs, and waits for the previous kernel to
# complete (``wait``) only before its epilogue touches what that kernel wrote (the result, lse,
# lo). A kernel launched without the PDL attribute (or after one that never triggers) finds its
# predecessor complete: both instructions are then no-ops. The host launches with the attribute
# only a branch whose predecessor on the stream is the previous launch of the same call, whose
# inputs (q, k, v) were written before that call's first launch.
@gluon.jit
def gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready,
            k_empty, v_empty, q_row0, q_blk, q_col, kv_col, n_tiles, row_off,
            BN: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    # one warp: Q of both consumers, then K_j / V_j into the ring (K first: the consumers
    # need K_j before V_{j-1}); the block's rows start at row ``row_off`` of the descriptors
    # (0 but in the packed kernel over host descriptors, gluon_varlen_kernel)
    for i in gl.static_range(2):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [q_blk, row_off + q_row0 + i * _WGM, q_col, 0], q_bars.index(i), q_bufs.index(i)
        )
    for j in range(n_tiles):
        st = j % STAGES
        ph = (j // STAGES) & 1
        # a fresh barrier counts as having completed the phase before phase 0: the first
        # round passes at once
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [q_blk, row_off + j * BN, kv_col, 0], k_ready.index(st), k_bufs.index(st)
        )
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [q_blk, row_off + j * BN, kv_col, 0], v_ready.index(st), v_bufs.index(st)
        )


@gluon.jit
def _mask_scores(s, row0, j, L, BN: gl.constexpr, CAUSAL: gl.constexpr,
                 s_layout: gl.constexpr):  # fmt: skip
    rows = row0 + gl.arange(0, _WGM, layout=gl.SliceLayout(1, s_layout))
    cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    keep = gl.expand_dims(cols < L, 0)
    if CAUSAL:
        keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, row0, j, L, BN: gl.constexpr,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                  s_layout: gl.constexpr):  # fmt: skip
    # one tile of the online softmax in base 2: returns p (unnormalised), m, l, alpha
    if MASKED:
        s = _mask_scores(s, row0, j, L, BN, CAUSAL, s_layout)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        # a row with no key so far (a causal tile above it): keep exp2 finite (no NaN)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _first_tile(q_tile, k_bufs, k_ready, k_empty, m_i, l_i, s_zero, qk_scale, row0, L,
                BN: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                MASKED: gl.constexpr, s_layout: gl.constexpr,
                p_layout: gl.constexpr):  # fmt: skip
    # S_0 = Q K_0^T and its softmax (nothing to overlap with yet)
    mbarrier.wait(k_ready.index(0), 0)
    k_t = k_bufs.index(0).reshape([BN, D]).permute((1, 0))
    s_tok = warpgroup_mma(q_tile, k_t, s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(0))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row0, 0, L, BN, CAUSAL,
                                       MASKED, s_layout)  # fmt: skip
    return gl.convert_layout(p.to(q_tile.dtype), p_layout), m_i, l_i


@gluon.jit
def _tile_step(j, q_tile, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, p_op, m_i, l_i,
               acc, s_zero, qk_scale, row0, L, BN: gl.constexpr, D: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr,
               p_layout: gl.constexpr):  # fmt: skip
    # FA3's intra-warpgroup overlap: issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; wait
    # for S_j only (the older group) and run the softmax of tile j while the PV runs
    dtype: gl.constexpr = q_tile.dtype
    st = j % STAGES
    sp = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
    k_t = k_bufs.index(st).reshape([BN, D]).permute((1, 0))
    s_tok = warpgroup_mma(q_tile, k_t, s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
    v_tile = v_bufs.index(sp).reshape([BN, D])
    acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(st))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row0, j, L, BN, CAUSAL,
                                       MASKED, s_layout)  # fmt: skip
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(sp))
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    acc = acc * gl.expand_dims(alpha_o, 1)
    # P_j into the A-operand registers only now: P_{j-1}'s PV has completed
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    return p_op, m_i, l_i, acc


@gluon.jit
def _epilogue(acc, m_i, l_i, o_desc, lo_desc, q4, e4, e_bar, LSE, lse_base, pos0, row0, o_blk,
              lo_blk, col, L, R, row_off, o_ptr, lo_ptr, SNO, D: gl.constexpr, FIRST: gl.constexpr,
              COMP: gl.constexpr, STORE_LO: gl.constexpr, TAIL_PTR: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    # this branch's (out, lse) of 64 query rows merged into the result by LSE weights (the
    # Triton forward's epilogue, triton_kernels.dilated_fwd_kernel): FIRST stores without
    # reading; COMP adds the lo residue buffer (compensated hi + lo pair); STORE_LO writes it.
    # The result's tile (and lo's) comes and goes by TMA through this warpgroup's Q buffer (its
    # last reader, the QK^T of the last tile, has completed) and its staging buffer e4.
    # TAIL_PTR (the packed kernel over host descriptors, whose box does not end at the block):
    # a tile with rows t >= L is stored by masked pointer stores instead (o_ptr / lo_ptr: the
    # head's column of row 0, rows of SNO elements at pos0 + R t), so that no row of another
    # block is written.
    dtype: gl.constexpr = o_desc.dtype
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    tile_o = q4.reshape([_WGM, D])
    tile_e = e4.reshape([_WGM, D])
    # the previous launch's result, lse and lo rows complete (a no-op without PDL)
    gdc_wait()
    if not FIRST:
        if COMP:
            mbarrier.expect(e_bar, 2 * o_desc.block_type.nbytes)
        else:
            mbarrier.expect(e_bar, o_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(o_desc, [o_blk, row_off + row0, col, 0], e_bar, q4)
        if COMP:
            tma.async_copy_global_to_shared(lo_desc, [lo_blk, row_off + row0, col, 0], e_bar, e4)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    # lse (natural log): m is in log2 units of the scaled scores
    lse_b = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * _LN2)
    out_b = acc / gl.expand_dims(gl.convert_layout(l_safe, row_l), 1)
    lse_b = gl.convert_layout(lse_b, row_l)
    rows = row0 + gl.arange(0, _WGM, layout=row_l)
    valid = rows < L
    lptrs = LSE + lse_base + (pos0 + rows * R).to(gl.int64)
    if FIRST:
        new_lse = lse_b
        new_out = out_b
    else:
        lse_a = gl.load(lptrs, mask=valid, other=float("-inf"))
        mbarrier.wait(e_bar, 0)
        out_a = tile_o.load(o_layout).to(gl.float32)
        if COMP:
            out_a += tile_e.load(o_layout).to(gl.float32)
        mx = gl.maximum(lse_a, lse_b)
        mx_safe = gl.where(mx == float("-inf"), 0.0, mx)
        wa = gl.exp(lse_a - mx_safe)
        wb = gl.exp(lse_b - mx_safe)
        tot = wa + wb
        tot_safe = gl.where(tot > 0, tot, 1.0)
        new_lse = gl.where(tot > 0, mx_safe + gl.log(tot_safe), float("-inf"))
        new_out = (out_a * gl.expand_dims(wa, 1) + out_b * gl.expand_dims(wb, 1)) / gl.expand_dims(
            tot_safe, 1
        )
    hi = new_out.to(dtype)
    if TAIL_PTR:
        if row0 + _WGM <= L:
            _store_tile(hi, new_out, o_desc, lo_desc, tile_o, tile_e, q4, e4, o_blk, lo_blk, row_off + row0,
                        col, COMP, STORE_LO)  # fmt: skip
        else:
            d_idx = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            off = gl.expand_dims((pos0 + rows * R).to(gl.int64) * SNO, 1) + gl.expand_dims(d_idx, 0)
            keep = gl.expand_dims(valid, 1) & gl.expand_dims(d_idx < D, 0)
            gl.store(o_ptr + off, hi, mask=keep)
            if COMP:
                if STORE_LO:
                    gl.store(lo_ptr + off, (new_out - hi.to(gl.float32)).to(dtype), mask=keep)
    else:
        # rows t >= L fall outside the TMA box: not written
        _store_tile(hi, new_out, o_desc, lo_desc, tile_o, tile_e, q4, e4, o_blk, lo_blk, row_off + row0, col,
                    COMP, STORE_LO)  # fmt: skip
    gl.store(lptrs, new_lse, mask=valid)
    tma.store_wait(0)


@gluon.jit
def _store_tile(hi, new_out, o_desc, lo_desc, tile_o, tile_e, q4, e4, o_blk, lo_blk, trow, col,
                COMP: gl.constexpr, STORE_LO: gl.constexpr):  # fmt: skip
    # the result's tile (and lo's) through shared memory to TMA stores at descriptor row trow
    tile_o.store(hi)
    if COMP:
        if STORE_LO:
            tile_e.store((new_out - hi.to(gl.float32)).to(hi.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [o_blk, trow, col, 0], q4)
    if COMP:
        if STORE_LO:
            tma.async_copy_shared_to_global(lo_desc, [lo_blk, trow, col, 0], e4)


@gluon.jit
def _consumer(wg: gl.constexpr, q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty,
              v_empty, o_desc, lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, o_blk, lo_blk, col,
              q_row0, n_tiles, n_full, L, R, qk_scale, row_off, o_ptr, lo_ptr, SNO, BN: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FIRST: gl.constexpr,
              COMP: gl.constexpr, STORE_LO: gl.constexpr, TAIL_PTR: gl.constexpr):  # fmt: skip
    # one warpgroup (4 warps), 64 query rows: rows q_row0 + wg*64 + [0, 64) of the block
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    row0 = q_row0 + wg * _WGM
    q4 = q_bufs.index(wg)
    # the [1, 64, 1, D] TMA box as the [64, D] tile wgmma reads (the same bytes: the
    # compiler infers the 2-D 128-byte-swizzled NVMMA layout for the reshape)
    q_tile = q4.reshape([_WGM, D])

    m_i = gl.full([_WGM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([_WGM], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([_WGM, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([_WGM, BN], gl.float32, layout=s_layout)

    mbarrier.wait(q_bars.index(wg), 0)
    # tiles [0, n_full) need no mask, [n_full, n_tiles) do: two copies of the loop body
    # (MASKED constexpr), no branch inside a loop
    if n_full > 0:
        p_op, m_i, l_i = _first_tile(q_tile, k_bufs, k_ready, k_empty, m_i, l_i, s_zero,
                                     qk_scale, row0, L, BN, D, CAUSAL, False, s_layout,
                                     p_layout)  # fmt: skip
    else:
        p_op, m_i, l_i = _first_tile(q_tile, k_bufs, k_ready, k_empty, m_i, l_i, s_zero,
                                     qk_scale, row0, L, BN, D, CAUSAL, True, s_layout,
                                     p_layout)  # fmt: skip
    for j in range(1, n_full):
        p_op, m_i, l_i, acc = _tile_step(j, q_tile, k_bufs, v_bufs, k_ready, v_ready,
                                         k_empty, v_empty, p_op, m_i, l_i, acc, s_zero,
                                         qk_scale, row0, L, BN, D, STAGES, CAUSAL, False,
                                         s_layout, o_layout, p_layout)  # fmt: skip
    for j in range(gl.maximum(n_full, 1), n_tiles):
        p_op, m_i, l_i, acc = _tile_step(j, q_tile, k_bufs, v_bufs, k_ready, v_ready,
                                         k_empty, v_empty, p_op, m_i, l_i, acc, s_zero,
                                         qk_scale, row0, L, BN, D, STAGES, CAUSAL, True,
                                         s_layout, o_layout, p_layout)  # fmt: skip

    # the last PV
    sp = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(sp), ((n_tiles - 1) // STAGES) & 1)
    v_tile = v_bufs.index(sp).reshape([BN, D])
    acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(sp))
    _epilogue(acc, m_i, l_i, o_desc, lo_desc, q4, e_bufs.index(wg), e_bars.index(wg), LSE,
              lse_base, pos0, row0, o_blk, lo_blk, col, L, R, row_off, o_ptr, lo_ptr, SNO, D, FIRST, COMP,
              STORE_LO, TAIL_PTR, s_layout, o_layout)  # fmt: skip


@gluon.jit
def _consumer_wg0(q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty, o_desc,
                  lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, o_blk, lo_blk, col, q_row0,
                  n_tiles, n_full, L, R, qk_scale, row_off, o_ptr, lo_ptr, SNO, BN: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FIRST: gl.constexpr,
                  COMP: gl.constexpr, STORE_LO: gl.constexpr, TAIL_PTR: gl.constexpr):  # fmt: skip
    _consumer(0, q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty, o_desc,
              lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, o_blk, lo_blk, col, q_row0, n_tiles,
              n_full, L, R, qk_scale, row_off, o_ptr, lo_ptr, SNO, BN, D, STAGES, CAUSAL, FIRST, COMP,
              STORE_LO, TAIL_PTR)  # fmt: skip


@gluon.jit
def _consumer_wg1(q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty, o_desc,
                  lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, o_blk, lo_blk, col, q_row0,
                  n_tiles, n_full, L, R, qk_scale, row_off, o_ptr, lo_ptr, SNO, BN: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FIRST: gl.constexpr,
                  COMP: gl.constexpr, STORE_LO: gl.constexpr, TAIL_PTR: gl.constexpr):  # fmt: skip
    _consumer(1, q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty, o_desc,
              lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, o_blk, lo_blk, col, q_row0, n_tiles,
              n_full, L, R, qk_scale, row_off, o_ptr, lo_ptr, SNO, BN, D, STAGES, CAUSAL, FIRST, COMP,
              STORE_LO, TAIL_PTR)  # fmt: skip


@gluon.jit
def gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lo_desc, LSE, qk_scale, N, L, W, NSEG, S0,
                     LO_NSEG, LO_S0, R, H, HKV, HS, NHB, C0, CW,
                     BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, FIRST: gl.constexpr, COMP: gl.constexpr,
                     STORE_LO: gl.constexpr, CLASSES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr):  # fmt: skip
    """One program per (query tile of 128 rows, segment S0 + program_id(1), batch x head of
    the launch's NHB heads: HS + i, or with CLASSES the i-th head from HS on whose offset
    h % R lies in [C0, C0 + CW), HS + (i // CW) * R + C0 + i % CW: one length class of a branch
    with W % R != 0, whose blocks are L = ceil(W / R) rows for the offsets below W - R * (L - 1)
    and L - 1 rows for the rest, HS % R == 0 (``gluon_fwd.length_classes``; without CLASSES, C0
    and CW are not read); see the module docstring."""
    gdc_launch_dependents()
    pid_m = gl.program_id(0)
    seg = S0 + gl.program_id(1)
    bh = gl.program_id(2)
    b = bh // NHB
    i = bh % NHB
    if CLASSES:
        h = HS + (i // CW) * R + C0 + i % CW
    else:
        h = HS + i
    c = h % R
    hk = h // (H // HKV)
    q_row0 = pid_m * (2 * _WGM)
    q_blk = b * NSEG + seg
    q_col = c * H + h
    kv_col = c * HKV + hk
    n_tiles, n_full = key_tiles(L, q_row0, BN, CAUSAL)
    # the lo buffer holds LO_NSEG segments per batch entry, from segment LO_S0 on
    lo_blk = b * LO_NSEG + seg - LO_S0
    lse_base = (b.to(gl.int64) * H + h) * N
    pos0 = seg * W + c

    _program(q_desc, k_desc, v_desc, o_desc, lo_desc, LSE, lse_base, pos0, q_blk, lo_blk, q_col, kv_col,
             q_row0, n_tiles, n_full, L, R, qk_scale, 0, LSE, LSE, 0, BN, D, STAGES, CAUSAL, FIRST, COMP,
             STORE_LO, False, CONSUMER_REGS, LOADER_REGS)  # fmt: skip


@gluon.jit
def key_tiles(L, q_row0, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_tiles, n_full) of a program from query row q_row0 of a block of L rows: its key tiles
    of BN rows, all of the block or (causal) up to its last row; those from n_full on need a
    mask (keys >= L or above the diagonal)."""
    n_kv = gl.cdiv(L, BN)
    if CAUSAL:
        n_tiles = gl.minimum(n_kv, gl.cdiv(q_row0 + 2 * _WGM, BN))
        n_full = gl.minimum(q_row0 // BN, L // BN)
    else:
        n_tiles = n_kv
        n_full = L // BN
    return n_tiles, n_full


@gluon.jit
def _program(q_desc, k_desc, v_desc, o_desc, lo_desc, LSE, lse_base, pos0, q_blk, lo_blk, q_col, kv_col,
             q_row0, n_tiles, n_full, L, R, qk_scale, row_off, o_ptr, lo_ptr, SNO, BN: gl.constexpr,
             D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FIRST: gl.constexpr,
             COMP: gl.constexpr, STORE_LO: gl.constexpr, TAIL_PTR: gl.constexpr,
             CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """One program's work once its block is known: the shared buffers and barriers, then the
    loader and the two consumer warpgroups over the descriptors' block ``q_blk`` / ``lo_blk``,
    columns ``q_col`` / ``kv_col``, from query row ``q_row0`` (:func:`gluon_fwd_kernel`). The
    block's row t is the descriptors' row ``row_off + t``. The packed-documents kernels
    (``gluon_varlen_kernel``) pass either device-made descriptors that start at their block (those
    coordinates 0) or host descriptors over the whole stream (``row_off``, the column of the
    block's residue, and ``TAIL_PTR``: a tile past the block's end stored through ``o_ptr`` /
    ``lo_ptr``, rows of ``SNO`` elements; see :func:`_epilogue`)."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)  # fmt: skip
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)  # fmt: skip
    # per consumer: the staging buffer of its lo tile (epilogue) and the barrier of its
    # epilogue loads
    e_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    e_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(e_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # one arrival per consumer warpgroup
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    # the argument tuples are written inline: a tuple assigned to a name first would turn
    # its constexpr entries into tensors (Triton 3.6's assignment sanitiser)
    gl.warp_specialize(
        [
            (_consumer_wg0, (q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty,
                             o_desc, lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, q_blk,
                             lo_blk, q_col, q_row0, n_tiles, n_full, L, R, qk_scale, row_off,
                             o_ptr, lo_ptr, SNO, BN, D, STAGES, CAUSAL, FIRST, COMP, STORE_LO,
                             TAIL_PTR)),
            (_consumer_wg1, (q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty,
                             o_desc, lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, q_blk,
                             lo_blk, q_col, q_row0, n_tiles, n_full, L, R, qk_scale, row_off,
                             o_ptr, lo_ptr, SNO, BN, D, STAGES, CAUSAL, FIRST, COMP, STORE_LO,
                             TAIL_PTR)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready,
                       v_ready, k_empty, v_empty, q_row0, q_blk, q_col, kv_col, n_tiles, row_off,
                       BN, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip
