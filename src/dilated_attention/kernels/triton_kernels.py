"""The Triton kernels of ``impl="triton"``: module-level ``@triton.jit`` functions only.

Grids, block configs and buffers live in ``triton_launch.py``; the torch custom ops in
``triton_ops.py``. This module imports triton unconditionally (callers import it only when
triton is installed). Whether the kernels run compiled or in Triton's interpreter
(``TRITON_INTERPRET=1``) is fixed when this module is imported: ``triton.jit`` decides it then.

Geometry. For branch (w, r) the positions split into blocks, one per (segment s, offset o),
holding the rows ``s*w + o + r*t`` (t = 0..L-1, L = ceil((seglen - o) / r)); query head h
reads the block of offset ``h % r`` (:func:`_block_geometry`). Inside a block it is plain dense
attention (causal inside the block: positions grow with t). The kernels read those rows in
place with pointer arithmetic: no strided copy of q, k or v is made, and K/V are read at kv
head ``h // (H // Hkv)`` (GQA/MQA without repeating K/V).

Forward (:func:`dilated_fwd_kernel`, one launch per branch): grid (query block x segment,
batch x head of the branch). Each program runs a flash-attention online softmax over its
block's keys and merges its (out, lse) into the accumulator ``(acc_out, acc_lse)`` by LSE
(docs/spec.md, exactly). Within one branch every (row, head) belongs to exactly one program,
so the in-place merge has no races; branches run one after another.
Folded forward (:func:`dilated_fwd_folded_kernel`, one launch for all branches, when the
branches nest: see ``triton_launch.fold_geometry``): a program takes BM rows of one head
congruent to c mod r_max inside one w_min window, which every branch takes all or none of,
and runs one online softmax over the concatenated key lists of its branches (exactly the LSE
merge): one output write, no merge.

Backward (exact, the mixing weights are not detached): with the final merged ``out`` and
``lse``, ``P_b = exp(S - lse)`` on branch b's pairs, ``delta = rowsum(dout * out)``
(:func:`dilated_bwd_delta_kernel`), and every branch contributes ``dS = P_b * (dP - delta)``
independently. Per branch two kernels:
- :func:`dilated_bwd_dkdv_kernel`: one program per (key block x segment, batch x kv head x
  offset class). It loops over the query heads that share its kv head *and* its offset
  (``h = g*rep + i0 + k*r``), so dK/dV of shared kv heads are summed inside the program: no
  atomics, deterministic. The (head, query block) loop is one flat loop, computed in the
  transposed form S^T = K Q^T (no register transposes), in two stages: query blocks on the
  causal diagonal (or all, with a padding mask) with masks, then the rest without any.
- :func:`dilated_bwd_dq_kernel`: one program per query block, like the forward, with the same
  mask-free first stage.
Both add into accumulators with a plain load-add-store (each row owned by one program per
branch); with ``FIRST`` (the first branch, when its launch stores every row of the result: the
launcher's ``_bwd_writes_all``) they store without reading, so the buffers need no zero-fill.
Constexpr switches: ``MASKED`` (inner loops) picks the masked stage; ``COMP`` the compensated
(hi, lo) accumulation of a result across branches (:func:`_acc_store`); ``STORE_LO`` is False
for the last branch (its lo part is never read); ``FIRST`` for the first branch (nothing to add
to).

Packed documents (``VARLEN``, a constexpr of every kernel but the delta one): q, k, v are one
(1, total, heads, headdim) stream cut by the int32 offsets ``CU_Q`` / ``CU_K``, and the grid is
flat (:func:`_doc_block`): per branch (segments of W rows, dilation R, blocks of B dilated
rows) a slot is a block of U = R * B key rows where U divides W (a block then starts at or past
its slot's first row), else a segment (U = W); the first axis holds (blocks per slot) x
``total_k // U + NDOCS`` programs, the second the heads only. Document d owns the slots
``[a_d, a_{d+1})``, ``a_d = CU_K[d] // U + d``: ceil(nk_d / U) and at most one spare (an empty
document: one spare only), so its programs grow with its length, not the longest document's; a
program finds its slot's document by counting the ``a_d`` at or below its slot
(:func:`_doc_slot`: one vector load of ``CU_K`` per 32 documents; no host work per call) and
returns at once on a spare slot. It then reads the document's rows (:func:`_doc_bounds`) and
runs the same geometry with the document's own ``NK`` and ``QOFF = nk - nq`` (segments start
at its first key row, queries bottom-right aligned in it), base pointers at its first rows (the
dK/dV kernel adds them to the row indices instead, keeping the bases kernel arguments: bases
from loaded offsets held vector registers in its loops) and the LSE / delta stride ``NQ`` =
total_q. Segment slots (U = W) hold the blocks per segment of
the largest document (``max_seqlen``, bucketed by the plans): blocks past a shorter segment's
end return at once. The launcher's ``triton_launch.block_slot_rows`` makes the same choice of
U.
The folded forward does the same with windows of W = WMIN rows. ``NDOCS`` (the documents of
the call; unused without VARLEN) is not specialised on (``do_not_specialize``), so a call's
document count never selects another binary. With ``VARLEN=False`` the offsets are the
implicit ``b * stride`` of the batch and the kernels compile to the code they compiled to
before varlen existed (benchmarks/compare_kernel_ir.py: same TTIR).

LSE contract: float32, natural log, ``(batch, nheads, seqlen_q)`` (varlen: ``(1, nheads,
total_q)``); a query with no key gets ``out = 0`` and ``lse = -inf`` and zero gradients (never
NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

# log2(e): the kernels work in base 2 (exp2/log2); a constexpr global so that the kernels can
# read it both compiled and in the interpreter
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


# ------------------------------------------------------------------------------------ helpers


@triton.jit
def _block_geometry(pid_s, h, W, R, NK):
    # (segment start s*W, offset o = h % R, block length L) of the rows s*W + o + R*t, t < L,
    # that head h reads in segment s of branch (W, R); L = 0 if o >= the segment length
    o = h % R
    seg_start = pid_s * W
    L = (tl.minimum(W, NK - seg_start) - o + R - 1) // R
    return seg_start, o, L


@triton.jit
def _doc_bounds(CU_Q, CU_K, doc):
    # packed documents (VARLEN): document doc holds query rows CU_Q[doc]:CU_Q[doc+1] and key
    # rows CU_K[doc]:CU_K[doc+1]; returns (first query row, first key row) as int64 and the
    # document's key count nk and query offset qoff = nk - nq (bottom-right alignment) as int32
    q0 = tl.load(CU_Q + doc)
    q1 = tl.load(CU_Q + doc + 1)
    k0 = tl.load(CU_K + doc)
    k1 = tl.load(CU_K + doc + 1)
    nk = k1 - k0
    qoff = nk - (q1 - q0)
    return q0.to(tl.int64), k0.to(tl.int64), nk, qoff


@triton.jit
def _doc_slot(CU_K, g, W, NDOCS):
    # packed documents on the flat grid of a branch with slots of W rows (segments, windows
    # or blocks): document d owns the slots [a_d, a_{d+1}), a_d = CU_K[d] // W + d, i.e.
    # ceil(nk_d / W) slots or one more (one for an empty document); a_d grows strictly with d,
    # so slot g belongs to the largest d < NDOCS with a_d <= g: the number of d in
    # [1, NDOCS) with a_d <= g, counted over 32 offsets per vector load (independent loads:
    # one for up to 33 documents, where a binary search waits on log2(NDOCS) scalar loads in
    # a row before the program's first tile; 32, not 128: the dK/dV kernel's spills stay as
    # they were, benchmarks/kernel_resources.py with Triton 3.6). Returns (d, slot g - a_d of
    # it); the slot may start at or past the document's end (the extra one): the caller
    # returns then
    d = NDOCS * 0
    for c in range(1, NDOCS, 32):
        i = c + tl.arange(0, 32)
        inside = i < NDOCS
        a = tl.load(CU_K + i, mask=inside, other=0) // W + i
        d += tl.sum((inside & (a <= g)).to(tl.int32), axis=0)
    return d, g - (tl.load(CU_K + d) // W + d)


@triton.jit
def _doc_block(CU_K, pid0, NB, W, R, B: tl.constexpr, NDOCS):
    # packed documents: program pid0 of a branch's flat grid -> (document, segment, block of B
    # dilated rows in the segment). Where U = R * B divides W, one program per slot of U key
    # rows: block j of a document's slots is block j % (W // U) of its segment j // (W // U),
    # whose rows start at or past the slot's first row (R * B * block >= U * block), so the
    # ceil(nk / U) slots of a document hold every block with a row. Else a slot is a segment
    # with NB programs (blocks). triton_launch.block_slot_rows mirrors this choice
    U = R * B
    if W % U == 0:
        doc, j = _doc_slot(CU_K, pid0, U, NDOCS)
        nu = W // U
        seg = j // nu
        blk = j % nu
    else:
        doc, seg = _doc_slot(CU_K, pid0 // NB, W, NDOCS)
        blk = pid0 % NB
    return doc, seg, blk


@triton.jit
def _acc_store(ptrs, lo_ptrs, val, mask, FIRST: tl.constexpr, COMP: tl.constexpr,
               STORE_LO: tl.constexpr):
    # x = old + val, stored as hi = x rounded to the buffer's dtype and, if COMP, the
    # rounding residue lo = x - hi in a second buffer of the same dtype: hi + lo carries
    # ~2x the dtype's mantissa (bf16: error <= 2^-17 |x| per branch), hi is at every step
    # the correctly rounded partial sum (so rows a later branch never touches are final)
    if FIRST:
        x = val
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + val
        if COMP:
            x += tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = x.to(ptrs.dtype.element_ty)
    tl.store(ptrs, hi, mask=mask)
    if COMP:
        if STORE_LO:
            tl.store(lo_ptrs, (x - hi.to(tl.float32)).to(lo_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, kbase, vbase, kpm_base, skn, svn, pos0, R, L, offs_m, lo, hi,
    qk_scale, D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr,
):
    offs_d = tl.arange(0, D)
    for n_lo in range(lo, hi, BN):
        offs_n = n_lo + tl.arange(0, BN)
        pos_n = (pos0 + R * offs_n).to(tl.int64)
        kp = kbase + pos_n[:, None] * skn + offs_d[None, :]
        vp = vbase + pos_n[:, None] * svn + offs_d[None, :]
        if MASKED:
            valid_n = offs_n < L
            k = tl.load(kp, mask=valid_n[:, None], other=0.0)
            v = tl.load(vp, mask=valid_n[:, None], other=0.0)
            if HAS_KPM:
                pad = tl.load(kpm_base + pos_n, mask=valid_n, other=1)
                valid_n = valid_n & (pad == 0)
        else:
            k = tl.load(kp)
            v = tl.load(vp)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BM, BN), log2 units
        if MASKED:
            mask = valid_n[None, :]
            if CAUSAL:
                mask = mask & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, QSHIFT, TQ0, pos0, R, L,
    h_start, m_start, j0, nj, jskip, jgap, nhl, offs_n, valid_k, qk_scale,
    D: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    PREC: tl.constexpr, MASKED: tl.constexpr, ROWS_FULL: tl.constexpr,
):
    # one flat loop over (query head, query block j0..j0+nj, blocks from jskip on moved up by
    # jgap): a nested loop under software pipelining gave a wrong dK on the GPU
    # (benchmarks/NOTES_triton.md), so keep it flat. ROWS_FULL: every row of every block of
    # this call is a query of the block (inside L, at or after the first query row), so the
    # q / dO / LSE / delta loads need no row mask: a mask per row (packed documents: their
    # lengths and query offsets are runtime values, so the compiler cannot share predicates
    # between rows) costs integer work in every iteration of this loop. Query row of position
    # pos: pos - QSHIFT from the bases Qb, DOb, LSEb, DELTAb; rows t >= TQ0 of the segment's
    # dilated rows are queries
    offs_d = tl.arange(0, D)
    njd = tl.maximum(nj, 1)  # no division by zero in a pipelined prologue of an empty loop
    for it in range(0, nhl * nj):
        h = h_start + (it // njd) * R
        j = j0 + it % njd
        j = tl.where(j >= jskip, j + jgap, j)
        m_lo = m_start + j * BM
        offs_m = m_lo + tl.arange(0, BM)
        pos_m = (pos0 + R * offs_m).to(tl.int64)
        qrow = pos_m - QSHIFT
        hq = h * NQ
        if ROWS_FULL:
            q = tl.load(Qb + qrow[:, None] * sqn + h * sqh + offs_d[None, :])
            do = tl.load(DOb + qrow[:, None] * sdon + h * sdoh + offs_d[None, :])
            lse = tl.load(LSEb + hq + qrow)
            dlt = tl.load(DELTAb + hq + qrow)
        else:
            valid_m = (offs_m < L) & (offs_m >= TQ0)
            q = tl.load(Qb + qrow[:, None] * sqn + h * sqh + offs_d[None, :],
                        mask=valid_m[:, None], other=0.0)
            do = tl.load(DOb + qrow[:, None] * sdon + h * sdoh + offs_d[None, :],
                         mask=valid_m[:, None], other=0.0)
            # rows that do not exist get other=+inf => p = 0 (no query-row mask needed below)
            lse = tl.load(LSEb + hq + qrow, mask=valid_m, other=float("inf"))
            dlt = tl.load(DELTAb + hq + qrow, mask=valid_m, other=0.0)
        # rows with no key (lse = -inf) get no gradient: treat as +inf => p = 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
        # transposed form (keys on the rows): P^T and dS^T are the left operands in the
        # layout the MMA produced them in, no register transpose; only loaded tiles (q, do)
        # are transposed, which is free
        st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BN, BM)
        pt = tl.math.exp2(st - lse[None, :])
        if MASKED:
            if HAS_KPM:
                pt = tl.where(valid_k[:, None], pt, 0.0)
            if CAUSAL:
                pt = tl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - dlt[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _dq_inner(
    dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, lo, hi,
    qk_scale, D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr,
):
    offs_d = tl.arange(0, D)
    for n_lo in range(lo, hi, BN):
        offs_n = n_lo + tl.arange(0, BN)
        pos_n = (pos0 + R * offs_n).to(tl.int64)
        kp = Kb + pos_n[:, None] * skn + offs_d[None, :]
        vp = Vb + pos_n[:, None] * svn + offs_d[None, :]
        if MASKED:
            valid_n = offs_n < L
            k = tl.load(kp, mask=valid_n[:, None], other=0.0)
            v = tl.load(vp, mask=valid_n[:, None], other=0.0)
            if HAS_KPM:
                pad = tl.load(KPMb + pos_n, mask=valid_n, other=1)
                valid_n = valid_n & (pad == 0)
        else:
            k = tl.load(kp)
            v = tl.load(vp)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            # (no row mask: rows that do not exist have lse = +inf, hence p = 0)
            mask = valid_n[None, :]
            if CAUSAL:
                mask = mask & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(mask, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - dlt[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit(do_not_specialize=["NDOCS"])
def dilated_fwd_kernel(
    Q, K, V, KPM, ACC_O, ACC_LO, ACC_L, CU_Q, CU_K, NDOCS,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sob, son, soh, slob, LO_ROW0,
    NQ, NK, QOFF, HS, NHB, H, REP, W, R, S0, NM,
    qk_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, FIRST: tl.constexpr, PREC: tl.constexpr,
    COMP: tl.constexpr, STORE_LO: tl.constexpr, VARLEN: tl.constexpr,
):
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = pid0 % NM
    pid_s = pid0 // NM + S0
    b = pid_bh // NHB
    h = HS + pid_bh % NHB
    kvh = h // REP
    b64 = b.to(tl.int64)
    if VARLEN:  # flat grid: pid0 is a block of a (document, segment), pid_bh the head
        b, pid_s, pid_m = _doc_block(CU_K, pid0, NM, W, R, BM, NDOCS)
        q0, k0, nk, qoff = _doc_bounds(CU_Q, CU_K, b)
        if pid_s * W >= nk:
            return
        q_base = q0 * sqn
        k_base = k0 * skn
        v_base = k0 * svn
        o_base = q0 * son
        lo_base = o_base
        l_base = h * NQ + q0
    else:
        nk = NK
        qoff = QOFF
        q_base = b64 * sqb
        k_base = b64 * skb
        v_base = b64 * svb
        o_base = b64 * sob
        lo_base = b64 * slob
        l_base = (b64 * H + h) * NQ
    seg_start, o, L = _block_geometry(pid_s, h, W, R, nk)
    m_lo = pid_m * BM
    if m_lo >= L:
        return
    m_hi = tl.minimum(m_lo + BM, L)
    if seg_start + o + R * (m_hi - 1) < qoff:  # every query row of the block is before Nq
        return
    offs_m = m_lo + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    pos_m = (seg_start + o + R * offs_m).to(tl.int64)
    qrow = pos_m - qoff
    valid_m = (offs_m < L) & (qrow >= 0)
    q_ptrs = Q + q_base + qrow[:, None] * sqn + h * sqh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=valid_m[:, None], other=0.0)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    kbase = K + k_base + kvh * skh
    vbase = V + v_base + kvh * svh
    pos0 = seg_start + o
    # stage 1: key blocks that need no mask (full blocks, all visible); stage 2: the rest
    hi = L
    if CAUSAL:
        hi = m_hi
    mid = 0
    if not HAS_KPM:
        if CAUSAL:
            mid = m_lo  # keys before the first query row of the block (BM % BN == 0)
        else:
            mid = L // BN * BN
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, kbase, vbase, KPM + b64 * skpb, skn, svn, pos0, R, L, offs_m, 0, mid,
        qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, False,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, kbase, vbase, KPM + b64 * skpb, skn, svn, pos0, R, L, offs_m, mid, hi,
        qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, True,
    )

    # this branch's lse (natural log) and normalised output
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    lse_b = tl.where(has, (m_i + tl.math.log2(l_safe)) / LOG2E, float("-inf"))
    out_b = acc / l_safe[:, None]
    lptrs = ACC_L + l_base + qrow
    ooff = o_base + qrow[:, None] * son + h * soh + offs_d[None, :]
    optrs = ACC_O + ooff
    # the lo buffer holds the rows from LO_ROW0 on (one range: triton_launch.lo_chunks) with
    # the result's row and head strides: the result's offsets shifted by one scalar
    lo_ptrs = ACC_LO + (lo_base - o_base - LO_ROW0 * son.to(tl.int64)) + ooff
    if FIRST:
        new_lse = lse_b
        new_out = out_b
    else:
        lse_a = tl.load(lptrs, mask=valid_m, other=float("-inf"))
        out_a = tl.load(optrs, mask=valid_m[:, None], other=0.0).to(tl.float32)
        if COMP:
            out_a += tl.load(lo_ptrs, mask=valid_m[:, None], other=0.0).to(tl.float32)
        mx = tl.maximum(lse_a, lse_b)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        wa = tl.exp(lse_a - mx_safe)
        wb = tl.exp(lse_b - mx_safe)
        tot = wa + wb
        tot_safe = tl.where(tot > 0, tot, 1.0)
        new_lse = tl.where(tot > 0, mx_safe + tl.log(tot_safe), float("-inf"))
        new_out = (out_a * wa[:, None] + out_b * wb[:, None]) / tot_safe[:, None]
    tl.store(lptrs, new_lse, mask=valid_m)
    # (the merge is a weighted mean, not a sum: _acc_store with FIRST=True stores it)
    _acc_store(optrs, lo_ptrs, new_out, valid_m[:, None], True, COMP, STORE_LO)


@triton.jit(do_not_specialize=["NDOCS"])
def dilated_fwd_folded_kernel(
    Q, K, V, KPM, OUT, LSE, BRS, CU_Q, CU_K, NDOCS,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sob, son, soh,
    N, H, REP, NB, WMIN, RMAX, NT,
    qk_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    # one program = BM rows of one (batch, head) congruent to c mod RMAX inside one WMIN-aligned
    # window; every branch takes all of them or none (see triton_launch.fold_geometry), so ONE
    # online softmax runs over the concatenated key lists of its branches: no merge, one write.
    # VARLEN: every document has as many queries as keys (the launcher folds only then); N is
    # the total row count (the LSE stride) and n the document's length; the grid is flat, its
    # window index a (document, window) slot (_doc_slot with W = WMIN)
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_t = pid0 % NT
    rest = pid0 // NT
    c = rest % RMAX
    win = rest // RMAX
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // REP
    b64 = b.to(tl.int64)
    if VARLEN:
        b, win = _doc_slot(CU_K, win, WMIN, NDOCS)
        q0, k0, n, _qoff = _doc_bounds(CU_Q, CU_K, b)
        if win * WMIN >= n:
            return
        q_base = q0 * sqn
        k_base = k0 * skn
        v_base = k0 * svn
        o_base = q0 * son
        l_base = h * N + q0
    else:
        n = N
        q_base = b64 * sqb
        k_base = b64 * skb
        v_base = b64 * svb
        o_base = b64 * sob
        l_base = (b64 * H + h) * N
    t0 = pid_t * BM
    offs_t = t0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    pos_m = (win * WMIN + c + RMAX * offs_t).to(tl.int64)
    valid_m = (offs_t < WMIN // RMAX) & (pos_m < n)
    q = tl.load(Q + q_base + pos_m[:, None] * sqn + h * sqh + offs_d[None, :],
                mask=valid_m[:, None], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    kbase = K + k_base + kvh * skh
    vbase = V + v_base + kvh * svh
    kpm_base = KPM + b64 * skpb
    first_pos = win * WMIN + c + RMAX * t0  # smallest row of the tile
    last_pos = tl.minimum(win * WMIN + c + RMAX * tl.minimum(t0 + BM - 1, WMIN // RMAX - 1),
                          n - 1)
    if first_pos < n:
        for bi in range(NB):
            W = tl.load(BRS + 4 * bi)
            R = tl.load(BRS + 4 * bi + 1)
            hs = tl.load(BRS + 4 * bi + 2)
            he = tl.load(BRS + 4 * bi + 3)
            o = h % R
            if (c % R == o) & (h >= hs) & (h < he):
                seg_start = (first_pos // W) * W
                L = (tl.minimum(W, n - seg_start) - o + R - 1) // R
                offs_m = (pos_m - seg_start - o) // R  # this branch's row index of each row
                hi = L
                mid = 0
                if CAUSAL:
                    hi = (last_pos - seg_start - o) // R + 1
                if not HAS_KPM:
                    if CAUSAL:
                        mid = (first_pos - seg_start - o) // R // BN * BN
                    else:
                        mid = L // BN * BN
                acc, l_i, m_i = _fwd_inner(
                    acc, l_i, m_i, q, kbase, vbase, kpm_base, skn, svn, seg_start + o, R, L,
                    offs_m, 0, mid, qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, False,
                )
                acc, l_i, m_i = _fwd_inner(
                    acc, l_i, m_i, q, kbase, vbase, kpm_base, skn, svn, seg_start + o, R, L,
                    offs_m, mid, hi, qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, True,
                )
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.math.log2(l_safe)) / LOG2E, float("-inf"))
    out = acc / l_safe[:, None]
    tl.store(LSE + l_base + pos_m, lse, mask=valid_m)
    tl.store(OUT + o_base + pos_m[:, None] * son + h * soh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=valid_m[:, None])


@triton.jit
def dilated_bwd_delta_kernel(O, DO, DELTA, sob, son, soh, sdob, sdon, sdoh, NROWS, NQ, H,
                             D: tl.constexpr, BR: tl.constexpr):
    # O, DO (B, NQ, H, D), last dim contiguous (DO may be a broadcast view: stride 0 elsewhere);
    # DELTA (B, H, NQ) float32; one row = one (b, t, h)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    valid = rows < NROWS
    offs_d = tl.arange(0, D)
    h = rows % H
    t = (rows // H) % NQ
    b = rows // (H * NQ)
    o = tl.load(O + (b * sob + t * son + h * soh)[:, None] + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    do = tl.load(DO + (b * sdob + t * sdon + h * sdoh)[:, None] + offs_d[None, :],
                 mask=valid[:, None], other=0.0)
    dl = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * H + h) * NQ + t, dl, mask=valid)


@triton.jit
def gluon_bwd_rows_kernel(LSE, DELTA, LSE2, DELTA2, slb, slh, sln, sdb, sdh, sdn, H, W, R, L,
                          CSTAR, NSEG, LP, MULT, BLOCK: tl.constexpr):
    # the Gluon backward's block-major rows of branch (W, R) (kernels/gluon_bwd.py, block_rows):
    # LSE2[b, h, s, t] = MULT * LSE[b, h, s*W + h % R + R*t] with -inf -> +inf, DELTA2 the same
    # with MULT 1; rows t >= L_h (up to LP, a multiple of BLOCK) +inf and 0, where L_h = L for
    # the offsets h % R < CSTAR and L - 1 for the rest (W % R != 0: L = ceil(W / R); else
    # CSTAR = R). LSE, DELTA (B, H, N) float32; LSE2, DELTA2 contiguous (B, H, NSEG, LP)
    # float32. Grid (LP / BLOCK, NSEG, B*H).
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    t = pid_t * BLOCK + tl.arange(0, BLOCK)
    valid = t < L - (h % R >= CSTAR).to(tl.int32)
    row = (s * W + h % R + R * t).to(tl.int64)
    x = tl.load(LSE + b * slb + h * slh + row * sln, mask=valid, other=float("-inf")) * MULT
    x = tl.where(x == float("-inf"), float("inf"), x)
    dl = tl.load(DELTA + b * sdb + h * sdh + row * sdn, mask=valid, other=0.0)
    dl = tl.where(dl == float("-inf"), float("inf"), dl)
    dst = (bh.to(tl.int64) * NSEG + s) * LP + t
    tl.store(LSE2 + dst, x)
    tl.store(DELTA2 + dst, dl)


@triton.jit
def gluon_varlen_rows_kernel(LSE, DELTA, LSE2, DELTA2, ENT_P0, ENT_W, TOTAL, R, NE, LP, MULT,
                             BLOCK: tl.constexpr):
    # the Gluon varlen backward's block-major rows of branch (w, R) over packed documents
    # (kernels/gluon_varlen.py, block_rows): LSE2[h, e, t] = MULT * LSE[h, ENT_P0[e] + h % R + R*t]
    # with -inf -> +inf, DELTA2 the same with MULT 1, for t < L = ceil((ENT_W[e] - h % R) / R);
    # rows t >= L (up to LP, a multiple of BLOCK; every row of an unused slot) +inf and 0. LSE,
    # DELTA (H, TOTAL) float32 contiguous; LSE2, DELTA2 (H, NE, LP) float32 contiguous. Grid
    # (LP / BLOCK, NE, H).
    pid_t = tl.program_id(0)
    e = tl.program_id(1)
    h = tl.program_id(2)
    c = h % R
    p0 = tl.load(ENT_P0 + e).to(tl.int64)
    ws = tl.load(ENT_W + e)
    n_rows = tl.maximum((ws - c + R - 1) // R, 0)
    t = pid_t * BLOCK + tl.arange(0, BLOCK)
    valid = t < n_rows
    src = h.to(tl.int64) * TOTAL + p0 + c + R * t.to(tl.int64)
    x = tl.load(LSE + src, mask=valid, other=float("-inf")) * MULT
    x = tl.where(x == float("-inf"), float("inf"), x)
    dl = tl.load(DELTA + src, mask=valid, other=0.0)
    dl = tl.where(dl == float("-inf"), float("inf"), dl)
    dst = (h.to(tl.int64) * NE + e) * LP + t
    tl.store(LSE2 + dst, x)
    tl.store(DELTA2 + dst, dl)


@triton.jit(do_not_specialize=["NDOCS", "MAX_LEN"])
def fill_uncovered_kernel(X, CU, NDOCS, TOTAL, MAX_LEN, INNER, OUTER, OUTER_STRIDE, ROWS_PER, VALUE,
                          BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    # the rows of packed documents' results that no document covers, set to VALUE (the Gluon varlen
    # path with unchecked device offsets, kernels/gluon_varlen.py fill_uncovered): X holds OUTER
    # slabs (OUTER_STRIDE elements apart) of TOTAL rows of INNER contiguous elements. Where the
    # offsets CU (NDOCS + 1, int32) tile [0, CU[NDOCS]) inside [0, TOTAL] (CU[0] == 0, every
    # document 0..MAX_LEN rows), the rows at or past CU[NDOCS] are set; otherwise every row (the
    # zero-fill the buffers had before). Program p takes rows [p * ROWS_PER, (p + 1) * ROWS_PER)
    # of every slab; only a program with rows below CU[NDOCS] reads the offsets. Grid (programs,).
    pid = tl.program_id(0)
    r0 = pid * ROWS_PER
    r1 = tl.minimum(r0 + ROWS_PER, TOTAL)
    last = tl.load(CU + NDOCS)
    start = tl.minimum(tl.maximum(last, 0), TOTAL)
    if r0 < start:  # rows that a valid set of offsets covers: are they valid?
        bad = (tl.load(CU) != 0) | (last > TOTAL)
        for j in range(0, NDOCS, BLOCK_D):
            i = j + tl.arange(0, BLOCK_D)
            m = i < NDOCS
            a = tl.load(CU + i, mask=m, other=0)
            b = tl.load(CU + i + 1, mask=m, other=0)
            wrong = (((b - a) < 0) | ((b - a) > MAX_LEN)) & m
            bad = bad | (tl.max(wrong.to(tl.int32), axis=0) != 0)
        start = tl.where(bad, 0, start)
    first = tl.maximum(r0, start)
    if first < r1:
        val = (tl.zeros([BLOCK], dtype=tl.float32) + VALUE).to(X.dtype.element_ty)
        lo = first.to(tl.int64) * INNER
        hi = r1.to(tl.int64) * INNER
        slab = lo * 0  # int64: slab o starts o * OUTER_STRIDE elements in
        for _o in range(0, OUTER):
            for e in range(lo, hi, BLOCK):
                idx = e + tl.arange(0, BLOCK)
                tl.store(X + slab + idx, val, mask=idx < hi)
            slab += OUTER_STRIDE


@triton.jit(do_not_specialize=["NDOCS"])
def dilated_bwd_dkdv_kernel(
    Q, K, V, KPM, DO, LSE, DELTA, DK, DV, DK_LO, DV_LO, CU_Q, CU_K, NDOCS,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sdob, sdon, sdoh,
    sdkb, sdkn, sdkh, sdvb, sdvn, sdvh, slob, LO_ROW0,
    NQ, NK, QOFF, HS, HE, H, HKV, REP, NI, W, R, S0, NNB,
    qk_scale, sm_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, PREC: tl.constexpr, COMP: tl.constexpr, STORE_LO: tl.constexpr,
    VARLEN: tl.constexpr, FIRST: tl.constexpr,
):
    pid0 = tl.program_id(0)
    pid_x = tl.program_id(1)
    pid_n = pid0 % NNB
    pid_s = pid0 // NNB + S0
    b = pid_x // (HKV * NI)
    g = (pid_x // NI) % HKV
    i0 = pid_x % NI
    h0 = g * REP + i0
    # query heads of kv head g with the offset of h0, inside the branch's head range [HS, HE)
    h_start = h0 + (tl.maximum(HS - h0, 0) + R - 1) // R * R
    h_end = tl.minimum((g + 1) * REP, HE)
    if h_start >= h_end:
        return
    b64 = b.to(tl.int64)
    if VARLEN:  # flat grid: pid0 is a key block of a (document, segment)
        b, pid_s, pid_n = _doc_block(CU_K, pid0, NNB, W, R, BN, NDOCS)
        q0, k0, nk, qoff = _doc_bounds(CU_Q, CU_K, b)
        if pid_s * W >= nk:
            return
        # the document's first rows enter the row indices, not the bases: the bases stay
        # kernel arguments (uniform registers), where bases from loaded offsets took vector
        # registers in the loops (spills, benchmarks/kernel_resources.py --sass)
        qshift = qoff - q0
        row0 = k0
        q_base = 0
        do_base = 0
        l_base = 0
        k_base = 0
        v_base = 0
        dk_base = 0
        dv_base = 0
        lo_base = 0
    else:
        nk = NK
        qoff = QOFF
        qshift = qoff
        row0 = 0
        q_base = b64 * sqb
        do_base = b64 * sdob
        l_base = b64 * H * NQ
        k_base = b64 * skb
        v_base = b64 * svb
        dk_base = b64 * sdkb
        dv_base = b64 * sdvb
        lo_base = b64 * slob
    seg_start, o, L = _block_geometry(pid_s, h0, W, R, nk)
    n_lo = pid_n * BN
    if n_lo >= L:
        return
    offs_n = n_lo + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    valid_n = offs_n < L
    pos_n = row0 + (seg_start + o + R * offs_n).to(tl.int64)  # key rows (row0: packed)
    k = tl.load(K + k_base + pos_n[:, None] * skn + g * skh + offs_d[None, :],
                mask=valid_n[:, None], other=0.0)
    v = tl.load(V + v_base + pos_n[:, None] * svn + g * svh + offs_d[None, :],
                mask=valid_n[:, None], other=0.0)
    valid_k = valid_n
    if HAS_KPM:
        pad = tl.load(KPM + b64 * skpb + pos_n, mask=valid_n, other=1)
        valid_k = valid_n & (pad == 0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # first query row of the block that exists (seqlen_q < seqlen_k) and, if causal, that
    # can see this key block
    t_q0 = tl.maximum(qoff - seg_start - o + R - 1, 0) // R
    m_start = t_q0 // BM * BM
    if CAUSAL:
        m_start = tl.maximum(m_start, n_lo // BM * BM)
    nmb = tl.maximum(L - m_start + BM - 1, 0) // BM
    nhl = (h_end - h_start + R - 1) // R
    Qb = Q + q_base
    DOb = DO + do_base
    LSEb = LSE + l_base
    DELTAb = DELTA + l_base
    pos0 = seg_start + o
    # masked stage: query blocks that straddle the causal diagonal (all of them with a key
    # padding mask); then the blocks without a causal mask: those whose rows are all queries
    # of the block ([jf0, jf1): no row masks either) and the at most two others (a first block
    # that starts before the first query row, a last one that ends past L), with row masks.
    # Key rows past L (partial key block) need no mask here: their dK/dV rows are never stored.
    if HAS_KPM:
        ndiag = nmb
    elif CAUSAL:
        ndiag = tl.minimum(tl.maximum(n_lo + BN - 1 - m_start + BM - 1, 0) // BM, nmb)
    else:
        ndiag = nmb * 0
    jf0 = tl.minimum(tl.maximum(ndiag, (t_q0 - m_start + BM - 1) // BM), nmb)
    jf1 = tl.maximum(tl.minimum((L - m_start) // BM, nmb), jf0)
    dk, dv = _dkdv_inner(
        dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, qshift, t_q0, pos0, R, L,
        h_start, m_start, 0, ndiag, nmb, 0, nhl, offs_n, valid_k, qk_scale,
        D, BM, CAUSAL, HAS_KPM, PREC, True, False,
    )
    dk, dv = _dkdv_inner(
        dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, qshift, t_q0, pos0, R, L,
        h_start, m_start, ndiag, (jf0 - ndiag) + (nmb - jf1), jf0, jf1 - jf0, nhl, offs_n,
        valid_k, qk_scale, D, BM, CAUSAL, HAS_KPM, PREC, False, False,
    )
    dk, dv = _dkdv_inner(
        dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, qshift, t_q0, pos0, R, L,
        h_start, m_start, jf0, jf1 - jf0, nmb, 0, nhl, offs_n, valid_k, qk_scale,
        D, BM, CAUSAL, HAS_KPM, PREC, False, True,
    )
    dk = dk * sm_scale
    dk_off = dk_base + pos_n[:, None] * sdkn + g * sdkh + offs_d[None, :]
    dv_off = dv_base + pos_n[:, None] * sdvn + g * sdvh + offs_d[None, :]
    # DK_LO, DV_LO: the rows from LO_ROW0 on, with the row and head strides of DK, DV (equal:
    # the launcher checks it): the results' offsets shifted by one scalar
    dk_lo = DK_LO + (lo_base - dk_base - LO_ROW0 * sdkn.to(tl.int64)) + dk_off
    dv_lo = DV_LO + (lo_base - dv_base - LO_ROW0 * sdvn.to(tl.int64)) + dv_off
    _acc_store(DK + dk_off, dk_lo, dk, valid_n[:, None], FIRST, COMP, STORE_LO)
    _acc_store(DV + dv_off, dv_lo, dv, valid_n[:, None], FIRST, COMP, STORE_LO)


@triton.jit(do_not_specialize=["NDOCS"])
def dilated_bwd_dq_kernel(
    Q, K, V, KPM, DO, LSE, DELTA, DQ, DQ_LO, CU_Q, CU_K, NDOCS,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sdob, sdon, sdoh,
    sdqb, sdqn, sdqh, slob, LO_ROW0,
    NQ, NK, QOFF, HS, NHB, H, REP, W, R, S0, NM,
    qk_scale, sm_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, PREC: tl.constexpr, COMP: tl.constexpr, STORE_LO: tl.constexpr,
    VARLEN: tl.constexpr, FIRST: tl.constexpr,
):
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = pid0 % NM
    pid_s = pid0 // NM + S0
    b = pid_bh // NHB
    h = HS + pid_bh % NHB
    kvh = h // REP
    b64 = b.to(tl.int64)
    if VARLEN:  # flat grid: pid0 is a block of a (document, segment), pid_bh the head
        b, pid_s, pid_m = _doc_block(CU_K, pid0, NM, W, R, BM, NDOCS)
        q0, k0, nk, qoff = _doc_bounds(CU_Q, CU_K, b)
        if pid_s * W >= nk:
            return
        q_base = q0 * sqn
        do_base = q0 * sdon
        dq_base = q0 * sdqn
        lo_base = dq_base
        hq = h * NQ + q0
        k_base = k0 * skn
        v_base = k0 * svn
    else:
        nk = NK
        qoff = QOFF
        q_base = b64 * sqb
        do_base = b64 * sdob
        dq_base = b64 * sdqb
        lo_base = b64 * slob
        hq = (b64 * H + h) * NQ
        k_base = b64 * skb
        v_base = b64 * svb
    seg_start, o, L = _block_geometry(pid_s, h, W, R, nk)
    m_lo = pid_m * BM
    if m_lo >= L:
        return
    m_hi = tl.minimum(m_lo + BM, L)
    if seg_start + o + R * (m_hi - 1) < qoff:
        return
    offs_m = m_lo + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    pos_m = (seg_start + o + R * offs_m).to(tl.int64)
    qrow = pos_m - qoff
    valid_m = (offs_m < L) & (qrow >= 0)
    q = tl.load(Q + q_base + qrow[:, None] * sqn + h * sqh + offs_d[None, :],
                mask=valid_m[:, None], other=0.0)
    do = tl.load(DO + do_base + qrow[:, None] * sdon + h * sdoh + offs_d[None, :],
                 mask=valid_m[:, None], other=0.0)
    lse = tl.load(LSE + hq + qrow, mask=valid_m, other=float("inf"))
    # rows with no key (lse = -inf) and rows that do not exist (other=+inf) get p = 0
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    dlt = tl.load(DELTA + hq + qrow, mask=valid_m, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    hi = L
    if CAUSAL:
        hi = m_hi
    Kb = K + k_base + kvh * skh
    Vb = V + v_base + kvh * svh
    KPMb = KPM + b64 * skpb
    pos0 = seg_start + o
    # stage 1: full, fully visible key blocks without masks; stage 2: the rest
    mid = 0
    if not HAS_KPM:
        if CAUSAL:
            mid = m_lo  # BM % BN == 0
        else:
            mid = L // BN * BN
    dq = _dq_inner(
        dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, 0, mid,
        qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, False,
    )
    dq = _dq_inner(
        dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, mid, hi,
        qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, True,
    )
    dq = dq * sm_scale
    dq_off = dq_base + qrow[:, None] * sdqn + h * sdqh + offs_d[None, :]
    # DQ_LO: the rows from LO_ROW0 on, with the row and head strides of DQ: DQ's offsets
    # shifted by one scalar
    dq_lo = DQ_LO + (lo_base - dq_base - LO_ROW0 * sdqn.to(tl.int64)) + dq_off
    _acc_store(DQ + dq_off, dq_lo, dq, valid_m[:, None], FIRST, COMP, STORE_LO)
