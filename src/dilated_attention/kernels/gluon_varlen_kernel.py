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
(:class:`.gluon_varlen._Scratch` sets it around each launch).

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
def gluon_fwd_varlen_kernel(Q, K, V, O, LO, LSE, ENT_P0, ENT_W, qk_scale, TOTAL, SNQ, SNK, R, H, HKV,
                            q_layout: gl.constexpr, kv_layout: gl.constexpr, BN: gl.constexpr,
                            D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            FIRST: gl.constexpr, COMP: gl.constexpr, STORE_LO: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """One program per (query tile of 128 rows, entry e, head h): the block of head h in
    entry e's segment (rows ENT_P0[e] + c + R t, c = h % R, t < L, the segment ENT_W[e]
    rows long) through the library's partitions with descriptors made here (coordinates 0
    but the row). q, out, lo: (TOTAL, H, D) rows of SNQ elements; k, v: (TOTAL, HKV, D) rows of
    SNK; lse (H, TOTAL) float32."""
    pid_m = gl.program_id(0)
    e = gl.program_id(1)
    h = gl.program_id(2)
    c = h % R
    hk = h // (H // HKV)
    p0 = gl.load(ENT_P0 + e)
    ws = gl.load(ENT_W + e)
    L = gl.maximum((ws - c + R - 1) // R, 0)
    q_row0 = pid_m * (2 * _WGM)
    if q_row0 < L:
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
        n_kv = gl.cdiv(L, BN)
        if CAUSAL:
            n_tiles = gl.minimum(n_kv, gl.cdiv(q_row0 + 2 * _WGM, BN))
            n_full = gl.minimum(q_row0 // BN, L // BN)
        else:
            n_tiles = n_kv
            n_full = L // BN
        lse_base = h.to(gl.int64) * TOTAL
        # the library's program body with the block, column and lo coordinates 0 (the
        # descriptors start at the block) and lse at pos0 + R t of row h
        F._program(q_desc, k_desc, v_desc, o_desc, lo_desc, LSE, lse_base, p0 + c, 0, 0, 0, 0, q_row0, n_tiles,
                   n_full, L, R, qk_scale, BN, D, STAGES, CAUSAL, FIRST, COMP, STORE_LO, CONSUMER_REGS,
                   LOADER_REGS)  # fmt: skip


@gluon.jit
def dkdv_varlen_kernel(Q, DO, K, V, l_desc, dl_desc, DK, DV, ENT_P0, ENT_W, qk_scale, sm_scale, NE, NNB,
                       R, H, HKV, REP, NI, LP, SNQ, SNK, q_layout: gl.constexpr, kv_layout: gl.constexpr,
                       BMQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       ADD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LOADER_REGS: gl.constexpr):  # fmt: skip
    """``gluon_bwd_kernel.dkdv_kernel`` over entries: one program per (key tile of 128 rows,
    entry e) x (kv head g, residue slot i0); its K / V descriptors start at the block's first
    row (head g), its q / dO descriptors at that row over all heads (the loader's column is
    the query head: c passed as 0); dK / dV rows p0 + c + R t (blk = p0, W = 1); lse / delta
    rows block-major [H, NE, LP] (b = 0, s = e, NSEG = NE)."""
    pid0 = gl.program_id(0)
    pid_x = gl.program_id(1)
    pid_n = pid0 % NNB
    e = pid0 // NNB
    g = pid_x // NI
    i0 = pid_x % NI
    h_start = g * REP + i0
    c = h_start % R
    nhl = ((g + 1) * REP - h_start + R - 1) // R
    p0 = gl.load(ENT_P0 + e)
    ws = gl.load(ENT_W + e)
    L = gl.maximum((ws - c + R - 1) // R, 0)
    n_lo = pid_n * (2 * _WGM)
    if n_lo < L:
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
        n_qt_all = gl.cdiv(L, BMQ)
        if CAUSAL:
            m_first = n_lo
            n_qt = n_qt_all - n_lo // BMQ
            n_diag = gl.minimum(n_qt, (2 * _WGM) // BMQ)
        else:
            m_first = n_lo * 0
            n_qt = n_qt_all
            n_diag = n_qt * 0
        # the library's program body: dK / dV stored at rows p0 + c + R t (blk = p0, W = 1); the
        # loader at block 0, residue 0 of descriptors that start at the block, column = query head
        BK._dkdv_program(q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, DK, DV, p0, 0, n_lo, 0, c, 0, g,
                         h_start, nhl, m_first, n_qt, n_diag, 0, e, L, 1, R, H, HKV, NE, LP, qk_scale,
                         sm_scale, BMQ, D, STAGES, ADD, CONSUMER_REGS, LOADER_REGS)  # fmt: skip

@gluon.jit
def dq_varlen_kernel(Q, DO, K, V, DQ, LSE2, DELTA, ENT_P0, ENT_W, qk_scale, sm_scale, NE, NMB, R, H, HKV,
                     LP, SNQ, SNK, q_layout: gl.constexpr, kv_layout: gl.constexpr, BN: gl.constexpr,
                     D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, ADD: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
    """``gluon_bwd_kernel.dq_kernel`` over entries: one program per (query tile of 128 rows,
    entry e) x head h; descriptors at the block's first row; dQ rows p0 + c + R t (blk = p0,
    W = 1); lse / delta rows block-major [H, NE, LP]."""
    pid0 = gl.program_id(0)
    h = gl.program_id(1)
    pid_m = pid0 % NMB
    e = pid0 // NMB
    c = h % R
    hk = h // (H // HKV)
    p0 = gl.load(ENT_P0 + e)
    ws = gl.load(ENT_W + e)
    L = gl.maximum((ws - c + R - 1) // R, 0)
    q_row0 = pid_m * (2 * _WGM)
    if q_row0 < L:
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
        n_kv = gl.cdiv(L, BN)
        if CAUSAL:
            n_tiles = gl.minimum(n_kv, gl.cdiv(q_row0 + 2 * _WGM, BN))
            n_full = gl.minimum(q_row0 // BN, n_tiles)
        else:
            n_tiles = n_kv
            n_full = n_kv
        # the library's program body: dQ rows p0 + c + R t (blk = p0, W = 1), the loader at block
        # 0 and columns 0 of descriptors that start at the block
        BK._dq_program(q_desc, do_desc, k_desc, v_desc, DQ, LSE2, DELTA, lrow, p0, 0, q_row0, 0, 0, c, h, n_tiles,
                       n_full, L, 1, R, H, qk_scale, sm_scale, BN, D, STAGES, ADD, CONSUMER_REGS,
                       LOADER_REGS)  # fmt: skip
