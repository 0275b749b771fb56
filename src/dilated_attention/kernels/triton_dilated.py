"""``impl="triton"``: fused Triton forward and backward of dilated attention (SPEC section 2).

Design
------
For branch (w, r) the positions split into blocks, one per (segment s, offset o), holding the rows
``s*w + o + r*t`` (t = 0..L-1, L = ceil((seglen - o) / r)); query head h reads the block of offset
``h % r``. Inside a block it is plain dense attention (causal inside the block: positions grow
with t). The kernels read those rows *in place* with pointer arithmetic
(``row = s*w + o + r*t``): no strided copy of q, k or v is ever made, and K/V are read at kv head
``h // (H // Hkv)`` (GQA/MQA without repeating K/V).

Forward: one launch per branch, grid (query block x segment, batch x head of the branch). Each
program runs a flash-attention online softmax over its block's keys and then merges its
(out, lse) into a float32 accumulator ``(acc_out, acc_lse)`` by LSE (SPEC's Eq. 10, exactly).
Within one branch every (row, head) belongs to exactly one program, so the in-place merge has no
races; branches run one after another. ``acc_lse`` *is* the returned lse ``(B, H, Nq)``.
Folded forward (not causal, seqlen_q == seqlen_k, every r dividing r_max, every w a multiple
of w_min, r_max dividing w_min: LongNet's default branches): ONE launch; a program takes BM
rows of one head congruent to c mod r_max inside one w_min window, which every branch takes
all or none of, and runs one online softmax over the concatenated key lists of its branches
(exactly the LSE merge): one output write, no merge (:func:`_fold_geometry`).

Backward (exact, the mixing weights are not detached): with the final merged ``out`` and ``lse``,
``P_b = exp(S - lse)`` on branch b's pairs, ``delta = rowsum(dout * out)``, and every branch
contributes ``dS = P_b * (dP - delta)`` independently. Per branch two kernels:
- dK/dV: one program per (key block x segment, batch x kv head x offset class). It loops over the
  query heads that share its kv head *and* its offset (``h = g*rep + i0 + k*r``), so dK/dV of
  shared kv heads are summed inside the program: no atomics, deterministic. The (head, query
  block) loop is one flat loop (a nested one miscompiled under pipelining, v2), computed in the
  transposed form S^T = K Q^T (no register transposes), in two stages: query blocks on the
  causal diagonal (or all, with a padding mask) with masks, then the rest without any.
- dQ: one program per query block, like the forward, with the same mask-free first stage.
Both add into accumulators with a plain load-add-store (each row owned by one program per
branch); all dK/dV launches run before all dQ launches, so only one phase's accumulators are
alive at a time. In fp16/bf16, a result that a row can receive from more than one branch is
accumulated as a compensated pair (hi, lo) of the result dtype: hi is the result buffer itself
(at every step the correctly rounded partial sum, so no final cast and no float32 copy) and lo
the rounding residue (error per branch <= ~2^-17 relative for bf16, far below the final
rounding). The forward's (out, lse) merge uses the same pair. float32 inputs accumulate in
float32 directly; a row with a single contribution is written once in the result dtype.

LSE contract: float32, natural log, ``(batch, nheads, seqlen_q)``; a query with no key gets
``out = 0`` and ``lse = -inf`` and zero gradients (never NaN).

The ops are registered with ``torch.library.custom_op`` (``dilated_attention::triton_fwd`` and
``::triton_bwd``) with fake implementations and ``register_autograd``, so ``torch.compile``
traces through them as opaque ops.

On the CPU the kernels run only under ``TRITON_INTERPRET=1`` (for tests); the kernels are built
lazily on first use so that the variable is read at call time, not import time.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..autograd_rules import backward_context, no_double_backward
from ..branches import branch_head_ranges

try:  # triton is an optional dependency: this module must import without it
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = str(e)

SUPPORTED_HEADDIMS = (16, 32, 64, 128)
_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(q: torch.Tensor, k: torch.Tensor | None = None) -> str | None:
    """Why the Triton kernel cannot run on these inputs, or None if it can."""
    if _TRITON_IMPORT_ERROR is not None:
        return f"the triton package is not importable ({_TRITON_IMPORT_ERROR}); pip install 'dilated-attention[triton]'"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _interpreting()):
        return f"the triton kernel needs a CUDA tensor, got device {q.device} (TRITON_INTERPRET=1 allows the CPU for tests)"
    if q.device.type == "cuda" and _interpreting():
        return "TRITON_INTERPRET=1 is set but the inputs are on CUDA; unset it to run the compiled kernel"
    d = q.shape[-1]
    if d not in SUPPORTED_HEADDIMS:
        return f"headdim {d} is not supported by the triton kernel (supported: {SUPPORTED_HEADDIMS}); use impl='torch'"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the triton kernel (fp16, bf16, fp32); use impl='torch' or 'reference'"
    if k is not None and k.shape[-1] != d:
        return f"k headdim {k.shape[-1]} differs from q headdim {d}"
    return None


# ---------------------------------------------------------------------------------- kernels
@functools.cache
def _kernels(interpret: bool):
    """Build the jitted kernels (once per mode). ``interpret`` only keys the cache.

    Constexpr switches: ``V3`` selects the v3 loop bodies exactly (variant "v3"); ``COMP`` the
    compensated (hi, lo) accumulation of the output/gradients across branches (see
    ``_acc_store``); ``STORE_LO`` is False for the last branch (its lo part is never read).
    """

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
        dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, QOFF, pos0, R, L,
        h_start, m_start, j0, nj, nhl, offs_n, valid_k, qk_scale,
        D: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
        PREC: tl.constexpr, MASKED: tl.constexpr, V3: tl.constexpr,
    ):
        # one flat loop over (query head, query block j0..j0+nj): a nested loop under software
        # pipelining gave a wrong dK on the GPU (v2)
        offs_d = tl.arange(0, D)
        njd = tl.maximum(nj, 1)  # no division by zero in a pipelined prologue of an empty loop
        for it in range(0, nhl * nj):
            h = h_start + (it // njd) * R
            m_lo = m_start + (j0 + it % njd) * BM
            offs_m = m_lo + tl.arange(0, BM)
            pos_m = (pos0 + R * offs_m).to(tl.int64)
            qrow = pos_m - QOFF
            valid_m = (offs_m < L) & (qrow >= 0)
            q = tl.load(Qb + qrow[:, None] * sqn + h * sqh + offs_d[None, :],
                        mask=valid_m[:, None], other=0.0)
            do = tl.load(DOb + qrow[:, None] * sdon + h * sdoh + offs_d[None, :],
                         mask=valid_m[:, None], other=0.0)
            hq = h * NQ
            lse = tl.load(LSEb + hq + qrow, mask=valid_m, other=float("inf"))
            # rows with no key (lse = -inf) get no gradient: treat as +inf => p = 0; so do the
            # rows that do not exist (other=+inf), which is why v4 needs no query-row mask
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            dlt = tl.load(DELTAb + hq + qrow, mask=valid_m, other=0.0)
            if V3:
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BM, BN)
                p = tl.math.exp2(s - lse[:, None])
                mask = valid_k[None, :] & valid_m[:, None]
                if CAUSAL:
                    mask = mask & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(mask, p, 0.0)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                ds = p * (dp - dlt[:, None])
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
            else:
                # transposed form (keys on the rows): P^T and dS^T are the left operands in
                # the layout the MMA produced them in, no register transpose; only loaded
                # tiles (q, do) are transposed, which is free
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
        dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, valid_m, lo, hi,
        qk_scale, D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_KPM: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr, V3: tl.constexpr,
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
                mask = valid_n[None, :]
                if V3:
                    mask = mask & valid_m[:, None]  # v4: rows that do not exist have p = 0
                if CAUSAL:
                    mask = mask & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(mask, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - dlt[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        return dq

    # kernels resolve helper names through the module globals
    globals()["_acc_store"] = _acc_store
    globals()["_fwd_inner"] = _fwd_inner
    globals()["_dkdv_inner"] = _dkdv_inner
    globals()["_dq_inner"] = _dq_inner

    @triton.jit
    def _fwd_kernel(
        Q, K, V, KPM, ACC_O, ACC_LO, ACC_L,
        sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sob, son, soh,
        NQ, NK, QOFF, HS, NHB, H, REP, W, R, S0, NM,
        qk_scale,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_KPM: tl.constexpr, FIRST: tl.constexpr, PREC: tl.constexpr,
        COMP: tl.constexpr, STORE_LO: tl.constexpr,
    ):
        pid0 = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_m = pid0 % NM
        pid_s = pid0 // NM + S0
        b = pid_bh // NHB
        h = HS + pid_bh % NHB
        kvh = h // REP
        # rows of the (segment, offset) block: pos = s*W + o + R*t, t < L (L = 0 if o >= seglen)
        o = h % R
        seg_start = pid_s * W
        L = (tl.minimum(W, NK - seg_start) - o + R - 1) // R
        m_lo = pid_m * BM
        if m_lo >= L:
            return
        m_hi = tl.minimum(m_lo + BM, L)
        if seg_start + o + R * (m_hi - 1) < QOFF:  # every query row of the block is before Nq
            return
        offs_m = m_lo + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        pos_m = (seg_start + o + R * offs_m).to(tl.int64)
        qrow = pos_m - QOFF
        valid_m = (offs_m < L) & (qrow >= 0)
        b64 = b.to(tl.int64)
        q_ptrs = Q + b64 * sqb + qrow[:, None] * sqn + h * sqh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=valid_m[:, None], other=0.0)

        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        kbase = K + b64 * skb + kvh * skh
        vbase = V + b64 * svb + kvh * svh
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
        lse_b = tl.where(has, (m_i + tl.math.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        out_b = acc / l_safe[:, None]
        hq = (b64 * H + h) * NQ
        lptrs = ACC_L + hq + qrow
        ooff = b64 * sob + qrow[:, None] * son + h * soh + offs_d[None, :]
        optrs = ACC_O + ooff
        if FIRST:
            new_lse = lse_b
            new_out = out_b
        else:
            lse_a = tl.load(lptrs, mask=valid_m, other=float("-inf"))
            out_a = tl.load(optrs, mask=valid_m[:, None], other=0.0).to(tl.float32)
            if COMP:
                out_a += tl.load(ACC_LO + ooff, mask=valid_m[:, None], other=0.0).to(tl.float32)
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
        _acc_store(optrs, ACC_LO + ooff, new_out, valid_m[:, None], True, COMP, STORE_LO)

    @triton.jit
    def _fwd_folded_kernel(
        Q, K, V, KPM, OUT, LSE, BRS,
        sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sob, son, soh,
        N, H, REP, NB, WMIN, RMAX, NT,
        qk_scale,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_KPM: tl.constexpr, PREC: tl.constexpr,
    ):
        # one program = BM rows of one (batch, head) congruent to c mod RMAX inside one WMIN-aligned
        # window; every branch takes all of them or none (see _fold_geometry), so ONE online softmax
        # runs over the concatenated key lists of its branches: no merge, one output write
        pid0 = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_t = pid0 % NT
        rest = pid0 // NT
        c = rest % RMAX
        win = rest // RMAX
        b = pid_bh // H
        h = pid_bh % H
        kvh = h // REP
        t0 = pid_t * BM
        offs_t = t0 + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        pos_m = (win * WMIN + c + RMAX * offs_t).to(tl.int64)
        valid_m = (offs_t < WMIN // RMAX) & (pos_m < N)
        b64 = b.to(tl.int64)
        q = tl.load(Q + b64 * sqb + pos_m[:, None] * sqn + h * sqh + offs_d[None, :],
                    mask=valid_m[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        kbase = K + b64 * skb + kvh * skh
        vbase = V + b64 * svb + kvh * svh
        kpm_base = KPM + b64 * skpb
        first_pos = win * WMIN + c + RMAX * t0  # smallest row of the tile
        last_pos = tl.minimum(win * WMIN + c + RMAX * tl.minimum(t0 + BM - 1, WMIN // RMAX - 1),
                              N - 1)
        if first_pos < N:
            for bi in range(NB):
                W = tl.load(BRS + 4 * bi)
                R = tl.load(BRS + 4 * bi + 1)
                hs = tl.load(BRS + 4 * bi + 2)
                he = tl.load(BRS + 4 * bi + 3)
                o = h % R
                if (c % R == o) & (h >= hs) & (h < he):
                    seg_start = (first_pos // W) * W
                    L = (tl.minimum(W, N - seg_start) - o + R - 1) // R
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
        lse = tl.where(has, (m_i + tl.math.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        out = acc / l_safe[:, None]
        tl.store(LSE + (b64 * H + h) * N + pos_m, lse, mask=valid_m)
        tl.store(OUT + b64 * sob + pos_m[:, None] * son + h * soh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=valid_m[:, None])

    @triton.jit
    def _delta_kernel(O, DO, DELTA, NROWS, NQ, H, D: tl.constexpr, BR: tl.constexpr):
        # O, DO contiguous (B, NQ, H, D); DELTA (B, H, NQ) float32
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        valid = rows < NROWS
        offs_d = tl.arange(0, D)
        o = tl.load(O + rows[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        do = tl.load(DO + rows[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        dl = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        h = rows % H
        t = (rows // H) % NQ
        b = rows // (H * NQ)
        tl.store(DELTA + (b * H + h) * NQ + t, dl, mask=valid)

    @triton.jit
    def _bwd_dkdv_kernel(
        Q, K, V, KPM, DO, LSE, DELTA, DK, DV, DK_LO, DV_LO,
        sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sdob, sdon, sdoh,
        sdkb, sdkn, sdkh, sdvb, sdvn, sdvh,
        NQ, NK, QOFF, HS, HE, H, HKV, REP, NI, W, R, S0, NNB,
        qk_scale, sm_scale,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_KPM: tl.constexpr, PREC: tl.constexpr, V3: tl.constexpr, COMP: tl.constexpr,
        STORE_LO: tl.constexpr,
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
        # rows of the (segment, offset) block: pos = s*W + o + R*t, t < L (L = 0 if o >= seglen)
        o = h0 % R
        seg_start = pid_s * W
        L = (tl.minimum(W, NK - seg_start) - o + R - 1) // R
        n_lo = pid_n * BN
        if n_lo >= L:
            return
        offs_n = n_lo + tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        valid_n = offs_n < L
        pos_n = (seg_start + o + R * offs_n).to(tl.int64)
        b64 = b.to(tl.int64)
        k = tl.load(K + b64 * skb + pos_n[:, None] * skn + g * skh + offs_d[None, :],
                    mask=valid_n[:, None], other=0.0)
        v = tl.load(V + b64 * svb + pos_n[:, None] * svn + g * svh + offs_d[None, :],
                    mask=valid_n[:, None], other=0.0)
        valid_k = valid_n
        if HAS_KPM:
            pad = tl.load(KPM + b64 * skpb + pos_n, mask=valid_n, other=1)
            valid_k = valid_n & (pad == 0)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        # first query row of the block that exists (seqlen_q < seqlen_k) and, if causal, that
        # can see this key block
        t_q0 = tl.maximum(QOFF - seg_start - o + R - 1, 0) // R
        m_start = t_q0 // BM * BM
        if CAUSAL:
            m_start = tl.maximum(m_start, n_lo // BM * BM)
        nmb = tl.maximum(L - m_start + BM - 1, 0) // BM
        nhl = (h_end - h_start + R - 1) // R
        Qb = Q + b64 * sqb
        DOb = DO + b64 * sdob
        LSEb = LSE + b64 * H * NQ
        DELTAb = DELTA + b64 * H * NQ
        pos0 = seg_start + o
        if V3:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, QOFF, pos0, R, L,
                h_start, m_start, 0, nmb, nhl, offs_n, valid_k, qk_scale,
                D, BM, CAUSAL, HAS_KPM, PREC, True, True,
            )
        else:
            # masked stage: query blocks that straddle the causal diagonal (all of them with a
            # key padding mask); then the mask-free stage. Key rows past L (partial key block)
            # need no mask here: their dK/dV rows are never stored.
            if HAS_KPM:
                ndiag = nmb
            elif CAUSAL:
                ndiag = tl.minimum(tl.maximum(n_lo + BN - 1 - m_start + BM - 1, 0) // BM, nmb)
            else:
                ndiag = nmb * 0
            dk, dv = _dkdv_inner(
                dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, QOFF, pos0, R, L,
                h_start, m_start, 0, ndiag, nhl, offs_n, valid_k, qk_scale,
                D, BM, CAUSAL, HAS_KPM, PREC, True, False,
            )
            dk, dv = _dkdv_inner(
                dk, dv, k, v, Qb, DOb, LSEb, DELTAb, sqn, sqh, sdon, sdoh, NQ, QOFF, pos0, R, L,
                h_start, m_start, ndiag, nmb - ndiag, nhl, offs_n, valid_k, qk_scale,
                D, BM, CAUSAL, HAS_KPM, PREC, False, False,
            )
        dk = dk * sm_scale
        dk_off = b64 * sdkb + pos_n[:, None] * sdkn + g * sdkh + offs_d[None, :]
        dv_off = b64 * sdvb + pos_n[:, None] * sdvn + g * sdvh + offs_d[None, :]
        _acc_store(DK + dk_off, DK_LO + dk_off, dk, valid_n[:, None], False, COMP, STORE_LO)
        _acc_store(DV + dv_off, DV_LO + dv_off, dv, valid_n[:, None], False, COMP, STORE_LO)

    @triton.jit
    def _bwd_dq_kernel(
        Q, K, V, KPM, DO, LSE, DELTA, DQ, DQ_LO,
        sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, skpb, sdob, sdon, sdoh,
        sdqb, sdqn, sdqh,
        NQ, NK, QOFF, HS, NHB, H, REP, W, R, S0, NM,
        qk_scale, sm_scale,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_KPM: tl.constexpr, PREC: tl.constexpr, V3: tl.constexpr, COMP: tl.constexpr,
        STORE_LO: tl.constexpr,
    ):
        pid0 = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_m = pid0 % NM
        pid_s = pid0 // NM + S0
        b = pid_bh // NHB
        h = HS + pid_bh % NHB
        kvh = h // REP
        # rows of the (segment, offset) block: pos = s*W + o + R*t, t < L (L = 0 if o >= seglen)
        o = h % R
        seg_start = pid_s * W
        L = (tl.minimum(W, NK - seg_start) - o + R - 1) // R
        m_lo = pid_m * BM
        if m_lo >= L:
            return
        m_hi = tl.minimum(m_lo + BM, L)
        if seg_start + o + R * (m_hi - 1) < QOFF:
            return
        offs_m = m_lo + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        pos_m = (seg_start + o + R * offs_m).to(tl.int64)
        qrow = pos_m - QOFF
        valid_m = (offs_m < L) & (qrow >= 0)
        b64 = b.to(tl.int64)
        q = tl.load(Q + b64 * sqb + qrow[:, None] * sqn + h * sqh + offs_d[None, :],
                    mask=valid_m[:, None], other=0.0)
        do = tl.load(DO + b64 * sdob + qrow[:, None] * sdon + h * sdoh + offs_d[None, :],
                     mask=valid_m[:, None], other=0.0)
        hq = (b64 * H + h) * NQ
        lse = tl.load(LSE + hq + qrow, mask=valid_m, other=float("inf"))
        # rows with no key (lse = -inf) and rows that do not exist (other=+inf) get p = 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        dlt = tl.load(DELTA + hq + qrow, mask=valid_m, other=0.0)
        dq = tl.zeros([BM, D], tl.float32)
        hi = L
        if CAUSAL:
            hi = m_hi
        Kb = K + b64 * skb + kvh * skh
        Vb = V + b64 * svb + kvh * svh
        KPMb = KPM + b64 * skpb
        pos0 = seg_start + o
        if V3:
            dq = _dq_inner(
                dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, valid_m, 0, hi,
                qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, True, True,
            )
        else:
            # stage 1: full, fully visible key blocks without masks; stage 2: the rest
            mid = 0
            if not HAS_KPM:
                if CAUSAL:
                    mid = m_lo  # BM % BN == 0
                else:
                    mid = L // BN * BN
            dq = _dq_inner(
                dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, valid_m, 0, mid,
                qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, False, False,
            )
            dq = _dq_inner(
                dq, q, do, lse, dlt, Kb, Vb, KPMb, skn, svn, pos0, R, L, offs_m, valid_m, mid, hi,
                qk_scale, D, BN, CAUSAL, HAS_KPM, PREC, True, False,
            )
        dq = dq * sm_scale
        dq_off = b64 * sdqb + qrow[:, None] * sdqn + h * sdqh + offs_d[None, :]
        _acc_store(DQ + dq_off, DQ_LO + dq_off, dq, valid_m[:, None], False, COMP, STORE_LO)

    return _fwd_kernel, _delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_folded_kernel


# ---------------------------------------------------------------------------------- launch
# Private A/B switch, read at call time (benchmarks/NOTES_triton.md): "v4" (default), "v3" (the
# v3 kernels, configs and fp32 accumulators exactly) or "v4-fp32acc" (v4 kernels with float32
# accumulators + separate casts instead of the compensated (hi, lo) accumulation).
_VARIANT_ENV = "DILATED_ATTENTION_TRITON_VARIANT"
_VARIANTS = ("v4", "v3", "v4-fp32acc")
# Private override of block configs for GPU sweeps, e.g. "dkdv=32,128,8,3;dq=128,32,8,3"
# (BM, BN, num_warps, num_stages per kernel; fwd and dq need BM % BN == 0, dkdv BN % BM == 0).
_CONFIG_ENV = "DILATED_ATTENTION_TRITON_CONFIG"


def _variant() -> str:
    v = os.environ.get(_VARIANT_ENV, "v4") or "v4"
    if v not in _VARIANTS:
        raise ValueError(f"{_VARIANT_ENV}={v!r}: expected one of {_VARIANTS}")
    return v


def _configs(d: int, interpret: bool, variant: str = "v4") -> dict:
    """Block sizes and launch parameters per kernel (fixed, tuned on an H100 for D = 64/128)."""
    if variant == "v3":
        if interpret:  # small blocks: exercise multi-block loops at test sizes
            return dict(fwd=(16, 16, 1, 1), dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1))
        if d <= 64:
            return dict(fwd=(128, 64, 4, 3), dkdv=(32, 128, 4, 1), dq=(128, 32, 4, 3))
        return dict(fwd=(128, 64, 8, 3), dkdv=(32, 128, 8, 1), dq=(128, 32, 8, 3))
    if interpret:
        # BM != BN where the kernels allow it: several causal-diagonal query blocks per key
        # block (dkdv) and several mask-free key blocks before the diagonal (dq, fwd)
        cfg = dict(fwd=(32, 16, 1, 1), dkdv=(16, 32, 1, 1), dq=(32, 16, 1, 1))
    elif d <= 64:
        cfg = dict(fwd=(128, 64, 4, 3), dkdv=(32, 128, 4, 3), dq=(128, 32, 4, 3))
    else:
        # H100 sweep 2026-11-23 (benchmarks/tune_triton.py): dK/dV 64 x 64, 4 warps was 10%
        # faster than 32 x 128, 8 warps; dQ 128 x 64 on par with 128 x 32
        cfg = dict(fwd=(128, 64, 8, 3), dkdv=(64, 64, 4, 2), dq=(128, 64, 8, 3))
    spec = os.environ.get(_CONFIG_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, vals = item.partition("=")
        vals = tuple(int(x) for x in vals.split(","))
        if name.strip() not in cfg or len(vals) != 4:
            raise ValueError(f"{_CONFIG_ENV}: bad item {item!r} (want e.g. 'dkdv=32,128,8,3')")
        cfg[name.strip()] = vals
    fb, db, qb = cfg["fwd"], cfg["dkdv"], cfg["dq"]
    if fb[0] % fb[1] or qb[0] % qb[1] or db[1] % db[0]:
        raise ValueError(f"{_CONFIG_ENV}: need fwd/dq BM % BN == 0 and dkdv BN % BM == 0: {cfg}")
    return cfg


def _launch_kw(cfg, interpret):
    if interpret:
        return {}
    return dict(num_warps=cfg[2], num_stages=cfg[3])


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no silent TF32), as the dtype promises
    return "ieee" if dtype == torch.float32 else "tf32"


def _branches(nheads, seg, dil, head_ranges):
    return [
        (w, r, hs, he)
        for (w, r), (hs, he) in zip(zip(seg, dil, strict=True), head_ranges, strict=True)
        if he > hs
    ]


def _kpm_arg(kpm: torch.Tensor | None, q: torch.Tensor):
    if kpm is None:
        return q, 0, False  # dummy pointer, never read
    kpm = kpm.contiguous().view(torch.uint8)
    return kpm, kpm.stride(0), True


def _needs_fp32_acc(nh, hkv, head_ranges):
    """(dq, dkv): can a row receive contributions from more than one branch?"""
    rep = nh // hkv
    per_head = [0] * nh
    for hs, he in head_ranges:
        for h in range(hs, he):
            per_head[h] += 1
    dq32 = max(per_head, default=0) > 1
    dkv32 = any(sum(per_head[g * rep : (g + 1) * rep]) > 1 for g in range(hkv))
    return dq32, dkv32


def _acc_buffers(shape, dtype, device, multi: bool, variant: str):
    """Accumulator for a result that ``multi`` branches may add into: (hi, lo or None, fp32?).

    v4: hi in the result dtype (zeros) + lo (zeros, same dtype) when rows get several
    contributions in a dtype narrower than float32; hi is the result. v3 / v4-fp32acc: a
    float32 buffer cast at the end when rows get several contributions.
    """
    if not multi or dtype == torch.float32:
        return torch.zeros(shape, dtype=dtype, device=device), None, False
    if variant == "v4":
        hi = torch.zeros(shape, dtype=dtype, device=device)
        return hi, torch.zeros_like(hi), False
    return torch.zeros(shape, dtype=torch.float32, device=device), None, True


_FOLD_ENV = "DILATED_ATTENTION_TRITON_FOLD"  # "0": per-branch forward launches + merge (A/B)


def _fold_geometry(nq, nk, branches, causal=False):
    """(w_min, r_max) when the forward can fold all branches into one online softmax, else None.

    Needs seqlen_q == seqlen_k, several branches, every r dividing r_max, every w a multiple of
    w_min and r_max dividing w_min. Then the rows of one head congruent to c mod r_max inside
    one w_min-aligned window lie in one segment of every branch and, for each branch (w, r),
    all have the offset c mod r: the branch takes all of them (c mod r == h mod r, h in its
    heads) or none. LongNet's default branches (w = 2048 * 2^i, r = 2^i) qualify; r = 6, 12
    with r = 4 do not. Not causal only: a tile's rows are spread over a whole w_min window, so
    the causal diagonal crosses every key block and the folded causal forward was 1.65x slower
    than the per-branch one on an H100 (benchmarks/results/triton_fold_h100_2026-11-23.md);
    not causal it was 8% faster.
    """
    if causal or nq != nk or len(branches) < 2 or os.environ.get(_FOLD_ENV, "1") == "0":
        return None
    wmin = min(w for w, _, _, _ in branches)
    rmax = max(r for _, r, _, _ in branches)
    if wmin % rmax or any(rmax % r or w % wmin for w, r, _, _ in branches):
        return None
    return wmin, rmax


@functools.lru_cache(maxsize=64)
def _branch_table(branches: tuple, device: torch.device) -> torch.Tensor:
    """(w, r, head start, head stop) per branch as an int32 device tensor, built once per
    (branches, device): a fresh host-to-device copy per call would block the host."""
    return torch.tensor([list(b) for b in branches], dtype=torch.int32, device=device)


def _fwd_folded(q, k, v, kpm, causal, scale, branches, wmin, rmax, cfg, interp):
    bsz, n, nh, d = q.shape
    bm, bn = cfg[:2]
    out = torch.empty_like(q)
    lse = torch.empty(bsz, nh, n, dtype=torch.float32, device=q.device)
    brs = _branch_table(tuple(branches), q.device)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    nt = triton.cdiv(wmin // rmax, bm)
    grid = (nt * rmax * triton.cdiv(n, wmin), bsz * nh)
    _kernels(interp)[4][grid](
        q, k, v, kp, out, lse, brs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), skp,
        out.stride(0), out.stride(1), out.stride(2),
        n, nh, nh // k.shape[2], len(branches), wmin, rmax, nt,
        scale * _LOG2E,
        D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=_prec(q.dtype),
        **_launch_kw(cfg, interp),
    )
    return out, lse


def _fwd_impl(q, k, v, kpm, seg, dil, causal, scale, head_ranges):
    bsz, nq, nh, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    interp = q.device.type == "cpu"
    variant = _variant()
    cfg = _configs(d, interp, variant)["fwd"]
    branches = _branches(nh, seg, dil, head_ranges)
    geo = None if variant == "v3" else _fold_geometry(nq, nk, branches, causal)
    if geo is not None:
        return _fwd_folded(q, k, v, kpm, causal, scale, branches, *geo, cfg, interp)
    fwd_k = _kernels(interp)[0]
    bm, bn = cfg[:2]
    if variant == "v3":
        acc_o, acc_lo, cast = torch.zeros(bsz, nq, nh, d, dtype=torch.float32, device=q.device), None, True
    else:
        multi = _needs_fp32_acc(nh, hkv, head_ranges)[0]
        acc_o, acc_lo, cast = _acc_buffers((bsz, nq, nh, d), q.dtype, q.device, multi, variant)
    acc_l = torch.full((bsz, nh, nq), float("-inf"), dtype=torch.float32, device=q.device)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    qoff = nk - nq
    for bi, (w, r, hs, he) in enumerate(branches):
        s0 = qoff // w
        nseg = -(-nk // w) - s0
        nm = triton.cdiv(triton.cdiv(min(w, nk), r), bm)
        grid = (nm * nseg, bsz * (he - hs))
        fwd_k[grid](
            q, k, v, kp, acc_o, acc_o if acc_lo is None else acc_lo, acc_l,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), skp,
            acc_o.stride(0), acc_o.stride(1), acc_o.stride(2),
            nq, nk, qoff, hs, he - hs, nh, nh // hkv, w, r, s0, nm,
            scale * _LOG2E,
            D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, FIRST=bi == 0, PREC=_prec(q.dtype),
            COMP=acc_lo is not None, STORE_LO=bi < len(branches) - 1,
            **_launch_kw(cfg, interp),
        )
    del acc_lo
    return (acc_o.to(q.dtype) if cast else acc_o), acc_l


def _bwd_impl(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges):
    """dq, dk, dv (input dtypes) of the branches given, with the FINAL out and lse (which may
    include branches not given here: every branch's share is independent)."""
    bsz, nq, nh, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    rep = nh // hkv
    interp = q.device.type == "cpu"
    variant = _variant()
    _, delta_k, dkdv_k, dq_k, _ = _kernels(interp)
    cfgs = _configs(d, interp, variant)
    dout = dout.contiguous()
    out = out.contiguous()
    delta = torch.empty(bsz, nh, nq, dtype=torch.float32, device=q.device)
    nrows = bsz * nq * nh
    br = 16 if interp else 64
    delta_k[(triton.cdiv(nrows, br),)](out, dout, delta, nrows, nq, nh, D=d, BR=br)
    multi_q, multi_kv = _needs_fp32_acc(nh, hkv, head_ranges)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    qoff = nk - nq
    prec = _prec(q.dtype)
    v3 = variant == "v3"
    strides_in = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), skp, dout.stride(0), dout.stride(1), dout.stride(2),
    )
    branches = _branches(nh, seg, dil, head_ranges)

    def geom(w, r):
        s0 = qoff // w
        return s0, -(-nk // w) - s0, -(-min(w, nk) // r)  # first segment, segments, max L

    def launch_dkdv(bi, w, r, hs, he, dk, dk_lo, dv, dv_lo):
        s0, nseg, lmax = geom(w, r)
        bm, bn = cfgs["dkdv"][:2]
        nnb = -(-lmax // bn)
        ni = min(rep, r)
        dkdv_k[(nnb * nseg, bsz * hkv * ni)](
            q, k, v, kp, dout, lse, delta, dk, dv,
            dk if dk_lo is None else dk_lo, dv if dv_lo is None else dv_lo, *strides_in,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            nq, nk, qoff, hs, he, nh, hkv, rep, ni, w, r, s0, nnb,
            scale * _LOG2E, scale,
            D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=prec, V3=v3,
            COMP=dk_lo is not None, STORE_LO=bi < len(branches) - 1,
            **_launch_kw(cfgs["dkdv"], interp),
        )

    def launch_dq(bi, w, r, hs, he, dq, dq_lo):
        s0, nseg, lmax = geom(w, r)
        bm, bn = cfgs["dq"][:2]
        nm = -(-lmax // bm)
        dq_k[(nm * nseg, bsz * (he - hs))](
            q, k, v, kp, dout, lse, delta, dq, dq if dq_lo is None else dq_lo, *strides_in,
            dq.stride(0), dq.stride(1), dq.stride(2),
            nq, nk, qoff, hs, he - hs, nh, rep, w, r, s0, nm,
            scale * _LOG2E, scale,
            D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=prec, V3=v3,
            COMP=dq_lo is not None, STORE_LO=bi < len(branches) - 1,
            **_launch_kw(cfgs["dq"], interp),
        )

    if v3:  # per branch dK/dV then dQ, float32 accumulators, casts at the end
        dq = torch.zeros(q.shape, dtype=torch.float32 if multi_q else q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32 if multi_kv else k.dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32 if multi_kv else v.dtype, device=q.device)
        for bi, (w, r, hs, he) in enumerate(branches):
            launch_dkdv(bi, w, r, hs, he, dk, None, dv, None)
            launch_dq(bi, w, r, hs, he, dq, None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    # v4: all dK/dV first, then all dQ, so that at most one phase's accumulators are alive
    # (peak: the inputs, out, dout, lse, delta, the results and 2 units of lo buffers, each the
    # size of one result; v4-fp32acc: 4 units of float32 during dK/dV, casts one at a time)
    dk, dk_lo, dk_cast = _acc_buffers(k.shape, k.dtype, q.device, multi_kv, variant)
    dv, dv_lo, dv_cast = _acc_buffers(v.shape, v.dtype, q.device, multi_kv, variant)
    for bi, (w, r, hs, he) in enumerate(branches):
        launch_dkdv(bi, w, r, hs, he, dk, dk_lo, dv, dv_lo)
    del dk_lo, dv_lo
    if dk_cast:
        dk = dk.to(k.dtype)
    if dv_cast:
        dv = dv.to(v.dtype)
    dq, dq_lo, dq_cast = _acc_buffers(q.shape, q.dtype, q.device, multi_q, variant)
    for bi, (w, r, hs, he) in enumerate(branches):
        launch_dq(bi, w, r, hs, he, dq, dq_lo)
    del dq_lo
    if dq_cast:
        dq = dq.to(q.dtype)
    return dq, dk, dv


# ---------------------------------------------------------------------------------- torch ops
def _check_last_dim(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("dilated_attention::triton_fwd", mutates_args=())
def _triton_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    head_ranges: list[int],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    hr = list(zip(head_ranges[::2], head_ranges[1::2], strict=True))
    return _fwd_impl(
        _check_last_dim(q), _check_last_dim(k), _check_last_dim(v), key_padding_mask,
        segment_lengths, dilation_rates, causal, scale, hr,
    )


@_triton_fwd_op.register_fake
def _(q, k, v, key_padding_mask, segment_lengths, dilation_rates, head_ranges, causal, scale):
    b, nq, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, nq), dtype=torch.float32)


@torch.library.custom_op("dilated_attention::triton_bwd", mutates_args=())
def _triton_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    head_ranges: list[int],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hr = list(zip(head_ranges[::2], head_ranges[1::2], strict=True))
    return _bwd_impl(
        dout, _check_last_dim(q), _check_last_dim(k), _check_last_dim(v), key_padding_mask,
        out, lse.contiguous(), segment_lengths, dilation_rates, causal, scale, hr,
    )


@_triton_bwd_op.register_fake
def _(dout, q, k, v, key_padding_mask, out, lse, segment_lengths, dilation_rates, head_ranges,
      causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kpm, seg, dil, hr, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, kpm, out, lse)
    ctx.args = (seg, dil, hr, causal, scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, kpm, out, lse = ctx.saved_tensors
    seg, dil, hr, causal, scale = ctx.args
    with backward_context(q.device.type):
        grads = _triton_bwd_op(dout, q, k, v, kpm, out, lse, seg, dil, hr, causal, scale)
    dq, dk, dv = no_double_backward("impl='triton'", tuple(grads), (dout, q, k, v))
    return dq, dk, dv, None, None, None, None, None, None


_triton_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def dilated_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    *,
    causal: bool,
    scale: float,
    key_padding_mask: torch.Tensor | None,
    head_assignment: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs only (see api.py).

    q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool, True = pad.
    Returns out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) float32 (not differentiable).
    """
    reason = unavailable_reason(q, k)
    if reason is not None:
        raise ValueError(f"impl='triton' cannot run here: {reason}")
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    ranges = branch_head_ranges(q.shape[2], len(segment_lengths), head_assignment)
    flat = [x for hr in ranges for x in hr]
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    return _triton_fwd_op(
        q, k, v, key_padding_mask, list(segment_lengths), list(dilation_rates), flat,
        bool(causal), float(scale),
    )
