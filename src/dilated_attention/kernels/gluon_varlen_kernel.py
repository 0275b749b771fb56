"""The Gluon (Triton 3.6) kernels of one dilated branch over packed documents on Hopper (issue 22
item 2b): the forward, and the backward's dK/dV and dQ. Imported only by :mod:`.gluon_varlen`
(lazily, like :mod:`.gluon_fwd_kernel` and :mod:`.gluon_bwd_kernel`, whose program bodies they
run unchanged).

:func:`gluon_fwd_varlen_kernel`: one program per (query tile of 128 rows, entry e, head h). An
entry is one (document, segment) of the branch: its first row ``ENT_P0[e]`` in the packed stream
and its length ``ENT_W[e]`` (w, or less for a document's last segment; 0 for an unused slot).
Head h reads the block of rows ``p0 + c + R t`` (c = h % R, t < L = ceil((w_e - c) / R)). The
program builds that block's TMA descriptors on the device (``tma.make_tensor_descriptor``):
base at row p0 + c, shape [1, L, 1, D], row stride R x the stream's. The loader, the two
consumer warpgroups and the (hi, lo) merge epilogue of ``gluon_fwd_kernel`` then run with block
and column coordinates 0. TMA zero-fills rows past L and drops stores past it, exactly as the
host descriptors do at a launch's L. So short last segments, documents shorter than w and
w % R != 0 need no masks and no length classes. Programs past their block's rows return at once.

The descriptors live in a global scratch of 640 bytes a program (five descriptors), which Triton
asks of the allocator in ``triton.runtime._allocation._allocator`` at launch
(:class:`.gluon_varlen._Scratch` sets it around each launch). Making them costs ~3 us a program
(0.66 us each, results/tma_desc_cost_h200_2026-11-29.md), so a branch whose r divides the stream's
rows launches the ``*_hd_kernel``s at the end of this file instead: the same programs over
descriptors made once on the host (see the comment there).

:func:`dkdv_varlen_kernel` and :func:`dq_varlen_kernel` are ``gluon_bwd_kernel``'s dK/dV and dQ
programs over the same entries, with descriptors made the same way (q / dO over all query heads
for dK/dV, whose loader's column is the query head). Their lse / delta rows come block-major per
entry, [H, entry slots, LP] (``gluon_varlen.block_rows``); unused slots have no rows.

Every int argument may arrive as a constexpr: Triton passes an int equal to 1 that way (r = 1,
one kv head), so no method is called on one (``SNQ.to(gl.int64) * R``, not ``R.to(...)``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from . import gluon_bwd_kernel as BK
from . import gluon_fwd_kernel as F

PROGRAM_ROWS = F.BM  # query rows a program covers (two 64-row consumer warpgroups)
SCRATCH_PER_PROGRAM = 640  # five 128-byte descriptors (checked against the compiled kernel)
_WGM = gl.constexpr(F.WG_M)


@gluon.jit
def _block(ENT_P0, ENT_W, e, c, R):
    # entry e's first row p0 and the rows L of its block of offset c
    p0 = gl.load(ENT_P0 + e)
    ws = gl.load(ENT_W + e)
    return p0, gl.maximum((ws - c + R - 1) // R, 0)


@gluon.jit
def _kv_slot(pid_x, NI, REP, R):
    # a dK/dV program's kv head g, first query head h_start (slot pid_x % NI of g's), its residue c
    # and the count of g's query heads with that residue
    g = pid_x // NI
    h_start = g * REP + pid_x % NI
    c = h_start % R
    return g, h_start, c, ((g + 1) * REP - h_start + R - 1) // R


# The kernels below take a program's tile counts from the one-sequence kernels' helpers
# (``gluon_fwd_kernel.key_tiles``, ``gluon_bwd_kernel.dq_key_tiles`` / ``query_tiles``): once for the
# last row the program reads (``reach``, :func:`_runs`) and again where the program body needs them;
# the compiler folds the two (the same SASS, byte for byte, as the inline form they replaced).


@gluon.jit
def _runs(has_rows, LIMIT, pos0, R, reach, PART: gl.constexpr):
    # whether this program runs: it has rows and, PART 1 / 2, the last stream row it reads (block
    # row ``reach``: pos0 + R reach) lies below / at or past *LIMIT (int32: gluon_varlen.limit_row)
    if PART == 1:
        has_rows = has_rows & (pos0.to(gl.int64) + R * reach < gl.load(LIMIT))
    if PART == 2:
        has_rows = has_rows & (pos0.to(gl.int64) + R * reach >= gl.load(LIMIT))
    return has_rows


@gluon.jit
def _query_block(ENT_P0, ENT_W, e, h, pid_m, R, H, HKV):
    # a forward / dQ program's residue c, kv head hk, entry's first row p0, block rows L and first
    # query row
    c = h % R
    p0, L = _block(ENT_P0, ENT_W, e, c, R)
    return c, h // (H // HKV), p0, L, pid_m * (2 * _WGM)


@gluon.jit
def _kv_program(ENT_P0, ENT_W, LIMIT, NNB, NI, REP, R, BMQ: gl.constexpr, PART: gl.constexpr):
    # a dK/dV program's entry e, key tile, kv slot (:func:`_kv_slot`), block and whether it runs
    pid0 = gl.program_id(0)
    pid_n = pid0 % NNB
    e = pid0 // NNB
    g, h_start, c, nhl = _kv_slot(gl.program_id(1), NI, REP, R)
    p0, L = _block(ENT_P0, ENT_W, e, c, R)
    n_lo = pid_n * (2 * _WGM)
    reach = gl.maximum(n_lo + 2 * _WGM, gl.cdiv(L, BMQ) * BMQ) - 1
    return e, g, h_start, c, nhl, p0, L, n_lo, _runs(n_lo < L, LIMIT, p0 + c, R, reach, PART)


@gluon.jit
def gluon_fwd_varlen_kernel(Q, K, V, O, LO, LSE, ENT_P0, ENT_W, LIMIT, qk_scale, TOTAL, SNQ, SNK, R, H, HKV,
                            q_layout: gl.constexpr, kv_layout: gl.constexpr, BN: gl.constexpr,
                            D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            FIRST: gl.constexpr, COMP: gl.constexpr, STORE_LO: gl.constexpr,
                            PART: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """One program per (query tile of 128 rows, entry e, head h): the block of head h in
    entry e's segment (rows ENT_P0[e] + c + R t, c = h % R, t < L, the segment ENT_W[e]
    rows long) through the library's partitions with descriptors made here (coordinates 0
    but the row). q, out, lo: (TOTAL, H, D) rows of SNQ elements; k, v: (TOTAL, HKV, D) rows of
    SNK; lse (H, TOTAL) float32."""
    pid_m = gl.program_id(0)
    e = gl.program_id(1)
    h = gl.program_id(2)
    c, hk, p0, L, q_row0 = _query_block(ENT_P0, ENT_W, e, h, pid_m, R, H, HKV)
    reach = gl.maximum(q_row0 + 2 * _WGM, F.key_tiles(L, q_row0, BN, CAUSAL)[0] * BN) - 1
    if _runs(q_row0 < L, LIMIT, p0 + c, R, reach, PART):
        row = (p0 + c).to(gl.int64)
        rq = SNQ.to(gl.int64) * R  # R == 1 arrives as a constexpr int
        rk = SNK.to(gl.int64) * R
        q_desc = tma.make_tensor_descriptor(Q + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                            [1, _WGM, 1, D], q_layout)  # fmt: skip
        k_desc = tma.make_tensor_descriptor(K + row * SNK + hk * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                            [1, BN, 1, D], kv_layout)  # fmt: skip
        v_desc = tma.make_tensor_descriptor(V + row * SNK + hk * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                            [1, BN, 1, D], kv_layout)  # fmt: skip
        o_desc = tma.make_tensor_descriptor(O + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                            [1, _WGM, 1, D], q_layout)  # fmt: skip
        lo_desc = tma.make_tensor_descriptor(LO + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                             [1, _WGM, 1, D], q_layout)  # fmt: skip
        n_tiles, n_full = F.key_tiles(L, q_row0, BN, CAUSAL)
        lse_base = h.to(gl.int64) * TOTAL
        # the library's program body with the block, column and lo coordinates 0 (the
        # descriptors start at the block) and lse at pos0 + R t of row h
        F._program(q_desc, k_desc, v_desc, o_desc, lo_desc, LSE, lse_base, p0 + c, 0, 0, 0, 0, q_row0, n_tiles,
                   n_full, L, R, qk_scale, 0, LSE, LSE, 0, BN, D, STAGES, CAUSAL, FIRST, COMP, STORE_LO, False,
                   CONSUMER_REGS, LOADER_REGS)  # fmt: skip


@gluon.jit
def dkdv_varlen_kernel(Q, DO, K, V, l_desc, dl_desc, DK, DV, ENT_P0, ENT_W, LIMIT, qk_scale, sm_scale, NE, NNB,
                       R, H, HKV, REP, NI, LP, SNQ, SNK, q_layout: gl.constexpr, kv_layout: gl.constexpr,
                       BMQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       ADD: gl.constexpr, PART: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LOADER_REGS: gl.constexpr):  # fmt: skip
    """``gluon_bwd_kernel.dkdv_kernel`` over entries: one program per (key tile of 128 rows,
    entry e) x (kv head g, residue slot i0); its K / V descriptors start at the block's first
    row (head g), its q / dO descriptors at that row over all heads (the loader's column is
    the query head: c passed as 0); dK / dV rows p0 + c + R t (blk = p0, W = 1); lse / delta
    rows block-major [H, NE, LP] (b = 0, s = e, NSEG = NE)."""
    e, g, h_start, c, nhl, p0, L, n_lo, runs = _kv_program(ENT_P0, ENT_W, LIMIT, NNB, NI, REP, R, BMQ, PART)
    if runs:
        row = (p0 + c).to(gl.int64)
        rq = SNQ.to(gl.int64) * R  # R == 1 arrives as a constexpr int
        rk = SNK.to(gl.int64) * R
        q_desc = tma.make_tensor_descriptor(Q + row * SNQ, [1, L, H, D], [rq * L, rq, D, 1], [1, BMQ, 1, D],
                                            q_layout)  # fmt: skip
        do_desc = tma.make_tensor_descriptor(DO + row * SNQ, [1, L, H, D], [rq * L, rq, D, 1], [1, BMQ, 1, D],
                                             q_layout)  # fmt: skip
        k_desc = tma.make_tensor_descriptor(K + row * SNK + g * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                            [1, _WGM, 1, D], kv_layout)  # fmt: skip
        v_desc = tma.make_tensor_descriptor(V + row * SNK + g * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                            [1, _WGM, 1, D], kv_layout)  # fmt: skip
        m_first, n_qt, n_diag = BK.query_tiles(L, n_lo, BMQ, CAUSAL)
        # the library's program body: dK / dV stored at rows p0 + c + R t (blk = p0, W = 1); the
        # loader at block 0, residue 0 of descriptors that start at the block, column = query head
        BK._dkdv_program(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, p0, 0, n_lo, 0, c, 0, g,
                         h_start, nhl, m_first, n_qt, n_diag, 0, e, L, 1, R, H, HKV, NE, LP, qk_scale,
                         sm_scale, 0, BMQ, D, STAGES, ADD, CONSUMER_REGS, LOADER_REGS)  # fmt: skip

@gluon.jit
def dq_varlen_kernel(Q, DO, K, V, DQ, LSE2, DELTA, ENT_P0, ENT_W, LIMIT, qk_scale, sm_scale, NE, NMB, R, H, HKV,
                     LP, SNQ, SNK, q_layout: gl.constexpr, kv_layout: gl.constexpr, BN: gl.constexpr,
                     D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr,
                     PART: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """``gluon_bwd_kernel.dq_kernel`` over entries: one program per (query tile of 128 rows,
    entry e) x head h; descriptors at the block's first row; dQ rows p0 + c + R t (blk = p0,
    W = 1); lse / delta rows block-major [H, NE, LP]."""
    pid0 = gl.program_id(0)
    h = gl.program_id(1)
    e = pid0 // NMB
    c, hk, p0, L, q_row0 = _query_block(ENT_P0, ENT_W, e, h, pid0 % NMB, R, H, HKV)
    reach = gl.maximum(q_row0 + 2 * _WGM, BK.dq_key_tiles(L, q_row0, BN, CAUSAL, False)[0] * BN) - 1
    if _runs(q_row0 < L, LIMIT, p0 + c, R, reach, PART):
        row = (p0 + c).to(gl.int64)
        rq = SNQ.to(gl.int64) * R  # R == 1 arrives as a constexpr int
        rk = SNK.to(gl.int64) * R
        q_desc = tma.make_tensor_descriptor(Q + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                            [1, _WGM, 1, D], q_layout)  # fmt: skip
        do_desc = tma.make_tensor_descriptor(DO + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                             [1, _WGM, 1, D], q_layout)  # fmt: skip
        k_desc = tma.make_tensor_descriptor(K + row * SNK + hk * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                            [1, BN, 1, D], kv_layout)  # fmt: skip
        v_desc = tma.make_tensor_descriptor(V + row * SNK + hk * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                            [1, BN, 1, D], kv_layout)  # fmt: skip
        lrow = (h.to(gl.int64) * NE + e) * LP
        n_tiles, n_full = BK.dq_key_tiles(L, q_row0, BN, CAUSAL, False)
        # the library's program body: dQ rows p0 + c + R t (blk = p0, W = 1), the loader at block
        # 0 and columns 0 of descriptors that start at the block
        BK._dq_program(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, lrow, p0, 0, q_row0, 0, 0, c, h, n_tiles,
                       n_full, L, 1, R, H, qk_scale, sm_scale, 0, BN, D, STAGES, CAUSAL, ADD, CONSUMER_REGS,
                       LOADER_REGS)  # fmt: skip


# ----------------------------------------------------------------- over host descriptors
# The same three kernels with descriptors made on the host over the whole stream
# (``gluon_fwd.block_desc(x, total, r, ...)``: the view [1, total / r, r * heads, D], where index
# (0, t, b * heads + h, d) is row b + r t, head h; the host asks total % r == 0, so that every row
# is inside that view). Block row t of entry e (stream row p0 + c + r t) is then the view's row
# a0 + t in column b * heads + h, with p0 + c = r a0 + b: no descriptor is made per program.
# The box does not end at the block, so rows past it are read from the stream (the next entries'
# rows, or zeros past the stream's end): keys t >= L are masked in the scores (the forward's and
# dQ's tiles from n_full on), queries t >= L have lse +inf in the backward's block-major rows
# (P = 0: they add nothing to dK / dV), and the forward's last tile of a block is stored through
# masked pointers (``TAIL_PTR``), dK / dV / dQ through masked pointers as always.


@gluon.jit
def gluon_fwd_varlen_hd_kernel(q_desc, k_desc, v_desc, o_desc, lo_desc, O, LO, LSE, ENT_P0, ENT_W, LIMIT, qk_scale,
                               TOTAL, SNQ, R, H, HKV, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                               CAUSAL: gl.constexpr, FIRST: gl.constexpr, COMP: gl.constexpr,
                               STORE_LO: gl.constexpr, PART: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               LOADER_REGS: gl.constexpr):  # fmt: skip
    """:func:`gluon_fwd_varlen_kernel` over host descriptors (see above): q / out / lo descriptors
    of box [1, 64, 1, D], k / v of [1, BN, 1, D]; O and LO the tensors behind out's and lo's for
    the pointer stores of a block's last tile."""
    pid_m = gl.program_id(0)
    e = gl.program_id(1)
    h = gl.program_id(2)
    c, hk, p0, L, q_row0 = _query_block(ENT_P0, ENT_W, e, h, pid_m, R, H, HKV)
    reach = gl.maximum(q_row0 + 2 * _WGM, F.key_tiles(L, q_row0, BN, CAUSAL)[0] * BN) - 1
    if _runs(q_row0 < L, LIMIT, p0 + c, R, reach, PART):
        pos0 = p0 + c
        b = pos0 % R
        n_tiles, n_full = F.key_tiles(L, q_row0, BN, CAUSAL)
        lse_base = h.to(gl.int64) * TOTAL
        F._program(q_desc, k_desc, v_desc, o_desc, lo_desc, LSE, lse_base, pos0, 0, 0, b * H + h, b * HKV + hk,
                   q_row0, n_tiles, n_full, L, R, qk_scale, pos0 // R, O + h * D, LO + h * D, SNQ, BN, D, STAGES,
                   CAUSAL, FIRST, COMP, STORE_LO, True, CONSUMER_REGS, LOADER_REGS)  # fmt: skip


@gluon.jit
def dkdv_varlen_hd_kernel(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, ENT_P0, ENT_W, LIMIT, qk_scale,
                          sm_scale, NE, NNB, R, H, HKV, REP, NI, LP, BMQ: gl.constexpr, D: gl.constexpr,
                          STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr,
                          PART: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """:func:`dkdv_varlen_kernel` over host descriptors (see above): the loader at block 0, the
    block's residue b as its column class (q / dO column b * H + h, k / v b * HKV + g) and
    first row a0; dK / dV rows p0 + c + R t as there."""
    e, g, h_start, c, nhl, p0, L, n_lo, runs = _kv_program(ENT_P0, ENT_W, LIMIT, NNB, NI, REP, R, BMQ, PART)
    if runs:
        pos0 = p0 + c
        b = pos0 % R
        m_first, n_qt, n_diag = BK.query_tiles(L, n_lo, BMQ, CAUSAL)
        BK._dkdv_program(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, p0, 0, n_lo, b * HKV + g, c, b,
                         g, h_start, nhl, m_first, n_qt, n_diag, 0, e, L, 1, R, H, HKV, NE, LP, qk_scale, sm_scale,
                         pos0 // R, BMQ, D, STAGES, ADD, CONSUMER_REGS, LOADER_REGS)  # fmt: skip


@gluon.jit
def dq_varlen_hd_kernel(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, ENT_P0, ENT_W, LIMIT, qk_scale, sm_scale, NE,
                        NMB, R, H, HKV, LP, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr, ADD: gl.constexpr, PART: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        LOADER_REGS: gl.constexpr):  # fmt: skip
    """:func:`dq_varlen_kernel` over host descriptors (see above); not causal, the last key
    tile of a block is masked (keys t >= L), as the causal diagonal is."""
    pid0 = gl.program_id(0)
    h = gl.program_id(1)
    e = pid0 // NMB
    c, hk, p0, L, q_row0 = _query_block(ENT_P0, ENT_W, e, h, pid0 % NMB, R, H, HKV)
    reach = gl.maximum(q_row0 + 2 * _WGM, BK.dq_key_tiles(L, q_row0, BN, CAUSAL, True)[0] * BN) - 1
    if _runs(q_row0 < L, LIMIT, p0 + c, R, reach, PART):
        pos0 = p0 + c
        b = pos0 % R
        lrow = (h.to(gl.int64) * NE + e) * LP
        n_tiles, n_full = BK.dq_key_tiles(L, q_row0, BN, CAUSAL, True)
        BK._dq_program(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, lrow, p0, 0, q_row0, b * H + h,
                       b * HKV + hk, c, h, n_tiles, n_full, L, 1, R, H, qk_scale, sm_scale, pos0 // R, BN, D, STAGES,
                       CAUSAL, ADD, CONSUMER_REGS, LOADER_REGS)  # fmt: skip
