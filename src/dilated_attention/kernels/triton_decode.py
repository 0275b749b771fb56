"""Decode path as two Triton kernels: a split pass over key blocks and an LSE reduction.

What a query reads (``docs/spec.md``; same rule as ``kernels/torch_decode.py``): for branch
(w, r) the row at position i reads the keys ``j = seg0 + c + r*u`` of its own segment
(``seg0 = (i // w) * w``, residue ``c = (i % w) % r``), ``u = 0 .. ceil(w / r) - 1``, up to
``min(seg0 + w, S)`` (``j <= i`` when causal), ``S = cache_seqlens[b] - cache_leftpad[b]``; query head h takes part
when it belongs to the branch and ``h % r == c``. At most ``sum_b ceil(w_b / r_b)`` keys per row,
whatever the cache length.

Split pass (flash-decoding): grid ``(splits, batch * nheads_kv)``. The index space
``u`` of branch b is cut into ``ceil(ceil(w_b / r_b) / BN)`` blocks; every block of every branch
is one split, so the grid depends only on the branch configuration, never on the cache length:
a block past the valid keys stores ``lse = -inf`` and returns without loading (this is what makes
the launch capturable in a CUDA graph while the cache grows). A program loads its K/V block of
one kv head once and serves every query head of the GQA group (``BH`` rows of the score tile),
for each query row in turn; a group with no head of the row's residue skips the loads. It stores
the block's normalised partial output (float32) and its LSE (log2 domain).

Reduction: one program per (batch, row, head) merges its partials by LSE. Merging all blocks of
all branches in one softmax is exactly the multiplicity softmax (a key two branches select sits
in two blocks). A row with no key gets out = 0, lse = -inf.

Cache slots: position p of row b is slot index ``cache_leftpad[b] + p`` and lives in slot
``(cache_leftpad[b] + p) % cache_len`` (a ring buffer; a cache at least as long as the sequence is
the plain cache). Keys a row does not select are never loaded (masked loads), so garbage in
unwritten slots cannot reach the result. Positions, slot indices and offsets are computed in int64
(a 1M-row cache of one batch entry holds 2^30 elements; ``cache_seqlens`` may be up to 2^31 - 1,
and a segment's end or a key's slot index past it must not wrap).
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from . import direct_launch
from .constants import int32_table
from .triton_import import (  # triton, tl: None without triton
    INTERPRET,
    device_reason,
    interpreter_bf16_reason,
    tl,
    triton,
)

SUPPORTED_HEADDIMS = (16, 32, 64, 128, 256)
_LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, SEQLENS, LEFTPAD, BR, OP, LP,
        sqb, sqt, sqh, skb, skn, skh, svb, svn, svh,
        sob, sot, soh, sos, slb, slt, slh,
        T, C, H, REP, NB,
        qk_scale,
        D: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, CAUSAL: tl.constexpr,
        PREC: tl.constexpr, HAS_LEFTPAD: tl.constexpr, SEQ_FULL: tl.constexpr,
    ):  # fmt: skip
        sp = tl.program_id(0)  # split: (branch, key block)
        pid = tl.program_id(1)  # batch * nheads_kv + kv head
        hkv = H // REP
        b = (pid // hkv).to(tl.int64)
        g = pid % hkv
        # branch table rows: (w, r, head start, head stop, first split)
        bi = 0
        for i in range(1, NB):
            bi = tl.where(sp >= tl.load(BR + i * 5 + 4), i, bi)
        w = tl.load(BR + bi * 5)
        r = tl.load(BR + bi * 5 + 1)
        hs = tl.load(BR + bi * 5 + 2)
        he = tl.load(BR + bi * 5 + 3)
        blk = sp - tl.load(BR + bi * 5 + 4)
        # positions in int64: a row's segment end (seg0 + w), its key positions and their slot
        # indices (j + lpad) pass 2^31 when cache_seqlens is within max(w) of it (int32 wrapped
        # there: such rows got out 0, lse -inf)
        if SEQ_FULL:  # every row's valid slots are the whole cache (no SEQLENS tensor)
            seqlen = b * 0 + C  # int64 (b is), also when C is specialised to a constant
        else:
            seqlen = tl.load(SEQLENS + b).to(tl.int64)
        if HAS_LEFTPAD:  # row b's sequence is slots [lpad, cache_seqlens[b]); negative counts as 0
            lpad = tl.maximum(tl.load(LEFTPAD + b), 0).to(tl.int64)
            seqlen = seqlen - lpad
        else:
            lpad = 0

        offs_h = tl.arange(0, BH)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        h = g * REP + offs_h  # query heads of this kv head's group
        in_group = offs_h < REP
        for t in range(0, T):
            ip = seqlen - T + t  # absolute position of query row t (int64; not `i`, the int32 loop index above)
            seg0 = (ip // w) * w
            c = (ip - seg0) % r
            if CAUSAL:
                end = tl.minimum(seg0 + w, ip + 1)
            else:
                end = tl.minimum(seg0 + w, seqlen)
            takes = in_group & (h >= hs) & (h < he) & (h % r == c)  # (BH,)
            j = seg0 + c + r * (blk * BN + offs_n)  # (BN,) key positions
            kvalid = j < end
            lp_ptrs = LP + b * slb + t * slt + h * slh + sp
            n_take = tl.sum(takes.to(tl.int32), axis=0)
            # a row at a negative position (cache_seqlens < seqlen_q) has no key
            if (n_take > 0) & (seg0 + c + r * blk * BN < end) & (ip >= 0):
                slot = (j + lpad) % C  # int64; j >= 0 here
                q = tl.load(
                    Q + b * sqb + t * sqt + h[:, None] * sqh + offs_d[None, :],
                    mask=takes[:, None], other=0.0,
                )  # (BH, D)
                k = tl.load(
                    K + b * skb + slot[:, None] * skn + g * skh + offs_d[None, :],
                    mask=kvalid[:, None], other=0.0,
                )  # (BN, D)
                v = tl.load(
                    V + b * svb + slot[:, None] * svn + g * svh + offs_d[None, :],
                    mask=kvalid[:, None], other=0.0,
                )  # (BN, D)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BH, BN), log2
                s = tl.where(takes[:, None] & kvalid[None, :], s, float("-inf"))
                m = tl.max(s, axis=1)
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                p = tl.exp2(s - m_safe[:, None])
                l_sum = tl.sum(p, axis=1)
                acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)  # (BH, D)
                l_safe = tl.where(l_sum > 0, l_sum, 1.0)
                tl.store(
                    OP + b * sob + t * sot + h[:, None] * soh + sp * sos + offs_d[None, :],
                    acc / l_safe[:, None], mask=takes[:, None],
                )
                lse2 = tl.where(l_sum > 0, m_safe + tl.log2(l_safe), float("-inf"))
                tl.store(lp_ptrs, lse2, mask=in_group)
            else:
                tl.store(lp_ptrs, tl.full([BH], float("-inf"), tl.float32), mask=in_group)

    @triton.jit
    def _decode_reduce_kernel(
        OP, LP, OUT, LSE,
        sob, sot, soh, sos, slb, slt, slh,
        sxb, sxt, sxh, seb, seh,
        T, H, NS,
        BD: tl.constexpr, BS: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)  # (batch, row, head)
        dblk = tl.program_id(1)  # BD columns of headdim: more programs for a short grid
        h = pid % H
        t = (pid // H) % T
        b = (pid // (H * T)).to(tl.int64)
        offs_s = tl.arange(0, BS)
        offs_d = dblk * BD + tl.arange(0, BD)
        lp = LP + b * slb + t * slt + h * slh
        op = OP + b * sob + t * sot + h * soh
        # pass 1: the largest partial LSE (lane-wise, then across lanes)
        mv = tl.full([BS], float("-inf"), tl.float32)
        for s0 in range(0, NS, BS):
            ls = tl.load(lp + s0 + offs_s, mask=s0 + offs_s < NS, other=float("-inf"))
            mv = tl.maximum(mv, ls)
        m = tl.max(mv, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        # pass 2: weights exp2(lse_k - m) <= 1; empty partials (lse = -inf) weigh 0, unread
        lv = tl.zeros([BS], tl.float32)
        acc = tl.zeros([BD], tl.float32)
        for s0 in range(0, NS, BS):
            sm = s0 + offs_s < NS
            ls = tl.load(lp + s0 + offs_s, mask=sm, other=float("-inf"))
            wt = tl.exp2(ls - m_safe)
            has = sm & (ls > float("-inf"))
            o = tl.load(op + (s0 + offs_s)[:, None] * sos + offs_d[None, :], mask=has[:, None], other=0.0)
            acc += tl.sum(wt[:, None] * o, axis=0)
            lv += wt
        l_sum = tl.sum(lv, axis=0)
        l_safe = tl.where(l_sum > 0, l_sum, 1.0)
        out = tl.where(l_sum > 0, acc / l_safe, 0.0)
        tl.store(OUT + b * sxb + t * sxt + h * sxh + offs_d, out.to(OUT.dtype.element_ty))
        if dblk == 0:
            ln_lse = (m_safe + tl.log2(l_safe)) * 0.6931471805599453  # log2 -> natural log
            tl.store(LSE + b * seb + h * seh + t, tl.where(l_sum > 0, ln_lse, float("-inf")))


def unavailable_reason(q: torch.Tensor, interpret: bool) -> str | None:
    """Why the decode kernel cannot run on inputs like ``q`` (None if it can)."""
    reason = device_reason(q, interpret)
    if reason is not None:
        return reason
    if q.shape[-1] not in SUPPORTED_HEADDIMS:
        return f"headdim {q.shape[-1]} is not supported by the triton decode kernel (supported: {SUPPORTED_HEADDIMS}); use impl='torch'"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the triton decode kernel (fp16, bf16, fp32); use impl='torch'"
    return interpreter_bf16_reason(q, interpret, "triton decode kernel")


def split_table(branches: tuple, block_n: int) -> tuple[list[list[int]], int]:
    """Rows (w, r, head start, head stop, first split) and the total number of splits."""
    rows, first = [], 0
    for w, r, hs, he in branches:
        rows.append([w, r, hs, he, first])
        keys = -(-w // r)  # ceil(w / r): the most keys a row reads in this branch
        first += -(-keys // block_n)
    return rows, first


@functools.lru_cache(maxsize=64)
def _table(branches: tuple, block_n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The split table as an int32 device tensor, built once per (branches, block, device) and
    outside any CUDA-graph pool (``constants.py``): a host-to-device copy per call would block
    the host and could not be captured in a graph."""
    rows, nsplit = split_table(branches, block_n)
    return int32_table(rows, device), nsplit


def _defaults(q: torch.Tensor, block_n: int | None, num_warps: int | None) -> tuple[int, int]:
    interp = INTERPRET
    return (16 if interp else 128) if block_n is None else block_n, 4 if num_warps is None else num_warps


def decode_triton_jit(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    branches,
    causal: bool,
    scale: float,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    reduce_splits: int = 128,
    reduce_cols: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-call path: every argument built on this call, both kernels launched through
    Triton's ``kernel[grid](...)``, four fresh buffers. Same contract and the same bits as
    :func:`decode_triton`; kept as the baseline of the A/B switch
    (``flags.set_direct_launch(False)``) and as the oracle of the plan tests."""
    dev = direct_launch.tensor_device(q)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return decode_triton_jit(q, k_cache, v_cache, cache_seqlens, cache_leftpad, branches, causal, scale,
                                     block_n=block_n, num_warps=num_warps, reduce_splits=reduce_splits,
                                     reduce_cols=reduce_cols)  # fmt: skip
    bsz, nq, nh, d = q.shape
    cap, hkv = k_cache.shape[1], k_cache.shape[2]
    rep = nh // hkv
    interp = INTERPRET
    block_n, num_warps = _defaults(q, block_n, num_warps)
    table, nsplit = _table(tuple(branches), block_n, q.device)
    op = torch.empty(bsz, nq, nh, nsplit, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(bsz, nq, nh, nsplit, dtype=torch.float32, device=q.device)
    out = torch.empty(bsz, nq, nh, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, nh, nq, dtype=torch.float32, device=q.device)
    launch = {} if interp else dict(num_warps=num_warps, num_stages=1)
    has_lpad = cache_leftpad is not None
    full = cache_seqlens is None
    seqlens = table if full else cache_seqlens  # SEQ_FULL: the kernel never reads SEQLENS
    _decode_split_kernel[(nsplit, bsz * hkv)](
        q, k_cache, v_cache, seqlens, cache_leftpad if has_lpad else seqlens, table, op, lp,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *op.stride()[:4],
        *lp.stride()[:3],
        nq, cap, nh, rep, len(branches),
        scale * _LOG2E,
        D=d, BN=block_n, BH=max(16, triton.next_power_of_2(rep)), CAUSAL=causal,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", HAS_LEFTPAD=has_lpad, SEQ_FULL=full,
        **launch,
    )  # fmt: skip
    bd = min(d, reduce_cols)
    _decode_reduce_kernel[(bsz * nq * nh, d // bd)](
        op, lp, out, lse,
        *op.stride()[:4], *lp.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
        nq, nh, nsplit,
        BD=bd, BS=min(reduce_splits, triton.next_power_of_2(nsplit)),
        **({} if interp else dict(num_warps=4, num_stages=1)),
    )  # fmt: skip
    return out, lse


# ------------------------------------------------------------------------------------ plans


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


_F32 = 4  # bytes per workspace element
_REGION = 128  # workspace regions start at multiples of 128 elements (512 bytes)


class DecodePlan:
    """Everything of a decode call that depends only on its configuration, built once.

    The key (:func:`plan_key`) holds the shape and strides of q, the caches' batch, head and
    headdim sizes, the specialisation classes (:func:`.direct_launch.cache_classes`) of the cache length and of
    the caches' strides, the dtype, the device, causal, scale, the branch rows, which index
    tensors are given (``cache_seqlens`` or the whole cache, ``cache_leftpad`` or none) and the
    tuning knobs. The cache length and the caches' strides are passed per call (a cache that
    grows by one token per step keeps its plan); every other integer argument of both kernels,
    every constexpr and both grids are functions of the key (the grid and the number of splits
    depend only on the branch rows and the block size, never on the cache length). So two calls
    with one key need the same compiled binaries; the remaining specialisation fact, 16-byte
    alignment of the data pointers, is checked per call (a misaligned pointer takes Triton's
    path, never the binaries).

    Holds: the grids, the constant parts of both kernels' argument tails, the split table, the layout of
    the fp32 workspace (split partials ``op``, their LSEs ``lp``, and the LSE output when the
    caller does not want it: one buffer, three regions at 512-byte boundaries), the workspace of
    its last eager stream with its three region pointers (a repeated call on one stream looks
    nothing up; see :meth:`launch`) and, after the first launch on a GPU, the direct launch forms
    of the two compiled kernels (``direct_launch.launch_form``: called inline, no Python frame per
    launch).
    """

    __slots__ = (
        "device", "dtype", "cuda", "dev_index", "nsplit", "table", "table_ptr",
        "split_grid", "split_q", "split_mid", "split_rest", "split_opts", "reduce_grid", "reduce_tail", "reduce_opts",
        "out_shape", "lse_shape", "lse_stride", "op_shape", "op_stride", "lp_shape", "lp_stride",
        "lp_off", "lse_off", "ws_numel", "has_lpad", "full", "tried_direct", "out_like_q",
        "split_go", "split_pre", "split_post", "reduce_go", "reduce_pre", "reduce_post", "rt",
        "ws_state",
    )  # fmt: skip

    def __init__(self, q, k_cache, v_cache, has_lpad, full, branches, causal, scale, block_n, num_warps,
                 reduce_splits, reduce_cols):  # fmt: skip
        bsz, nq, nh, d = q.shape
        hkv = k_cache.shape[2]
        rep = nh // hkv
        self.device, self.dtype = q.device, q.dtype
        self.cuda = q.device.type == "cuda"
        self.dev_index = direct_launch.tensor_device(q)
        interp = INTERPRET
        block_n, num_warps = _defaults(q, block_n, num_warps)
        self.table, nsplit = _table(branches, block_n, q.device)
        self.table_ptr = self.table.data_ptr()
        self.nsplit = nsplit
        self.has_lpad, self.full = has_lpad, full
        self.out_shape = (bsz, nq, nh, d)
        self.lse_shape = (bsz, nh, nq)
        self.lse_stride = _contiguous_strides(self.lse_shape)
        self.op_shape = (bsz, nq, nh, nsplit, d)
        self.op_stride = _contiguous_strides(self.op_shape)
        self.lp_shape = (bsz, nq, nh, nsplit)
        self.lp_stride = _contiguous_strides(self.lp_shape)
        n_op, n_lp = bsz * nq * nh * nsplit * d, bsz * nq * nh * nsplit
        self.lp_off = _round_up(n_op, _REGION)
        self.lse_off = _round_up(self.lp_off + n_lp, _REGION)
        self.ws_numel = self.lse_off + bsz * nh * nq
        out_stride = _contiguous_strides(self.out_shape)
        # out has q's shape, dtype and device: where q's strides are the contiguous ones (they are
        # in the key), torch.empty_like(q) gives the same tensor as torch.empty(out_shape, ...)
        # for less host work (no dtype/device keyword parsing)
        self.out_like_q = tuple(q.stride()) == out_stride
        self.split_grid = (nsplit, bsz * hkv)
        # the split kernel's parameters after the 8 pointers, in signature order, constexprs
        # included: split_q + (the caches' strides) + split_mid + (C,) + split_rest (split_tail)
        self.split_q = tuple(q.stride()[:3])
        self.split_mid = (*self.op_stride[:4], *self.lp_stride[:3], nq)
        self.split_rest = (
            nh, rep, len(branches),
            scale * _LOG2E,
            d, block_n, max(16, triton.next_power_of_2(rep)), causal,
            "ieee" if q.dtype == torch.float32 else "tf32", has_lpad, full,
        )  # fmt: skip
        self.split_opts = {} if interp else dict(num_warps=num_warps, num_stages=1)
        bd = min(d, reduce_cols)
        self.reduce_grid = (bsz * nq * nh, d // bd)
        self.reduce_tail = (
            *self.op_stride[:4], *self.lp_stride[:3], *out_stride[:3], *self.lse_stride[:2],
            nq, nh, nsplit,
            bd, min(reduce_splits, triton.next_power_of_2(nsplit)),
        )  # fmt: skip
        self.reduce_opts = {} if interp else dict(num_warps=4, num_stages=1)
        self.split_go = self.reduce_go = None  # the launch forms, once kept (_keep_launchers)
        self.split_pre = self.split_post = self.reduce_pre = self.reduce_post = self.rt = None
        self.tried_direct = False
        # (stream, table epoch, workspace, its three region pointers) of the last eager call:
        # one tuple, read once per call, so that a thread sees one stream's buffer and pointers
        self.ws_state = (None, -1, None, 0, 0, 0)

    def split_tail(self, k_cache, v_cache) -> tuple:
        """The split kernel's parameters after its 8 pointers for these caches: the plan's
        constants with this call's cache strides and length (of the plan's classes: the key)."""
        ks, vs = k_cache.stride(), v_cache.stride()
        return (
            *self.split_q, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], *self.split_mid, k_cache.shape[1],
            *self.split_rest,
        )  # fmt: skip

    def run(self, q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse: bool, reuse_workspace: bool):
        """One call: (out, lse or None). ``need_lse`` False: the LSE goes to the workspace.
        :meth:`launch` with this call's cache length and strides read here."""
        return self.launch(q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse,
                           k_cache.shape[1], k_cache.stride(), v_cache.stride(), reuse_workspace)  # fmt: skip

    def launch(self, q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse: bool, c: int, k_stride: tuple,
               v_stride: tuple, reuse_workspace: bool = True):  # fmt: skip
        """One call with the caches' length ``c`` and strides given (``decode.fast_call`` has
        read them for its key): (out, lse or None).

        The fp32 workspace: one buffer per (device, stream, size) reused by eager calls (the plan
        keeps the one of its last stream and its pointers, fetched again when the stream changes
        or the table of :func:`_workspace` was replaced since), a fresh one while the stream is
        capturing a CUDA graph or when ``reuse_workspace`` is off. With the launch forms kept,
        every pointer 16-byte aligned and no launch hook installed (``direct_launch.hooks_idle``,
        its common case inlined), both kernels are launched directly; otherwise through Triton
        (:meth:`_launch_jit`). Either way on the plan's device, whatever the current one (the
        device guard of ``direct_launch.py``: the current device is read once per call, as the
        direct launch read it before)."""
        go = self.split_go
        if go is None:  # the interpreter, or a GPU plan before its first aligned launch
            return self._run_jit(q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse, reuse_workspace)
        if direct_launch.current_device() != self.dev_index:  # (a plan with launchers is a GPU's)
            with torch.cuda.device(self.dev_index):
                return self.launch(q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse, c, k_stride,
                                   v_stride, reuse_workspace)  # fmt: skip
        stream = direct_launch.current_stream(self.dev_index)
        if reuse_workspace and not direct_launch.capturing():
            st = self.ws_state
            if st[0] != stream or st[1] != _WS_EPOCH:
                st = self._eager_workspace(stream)
            _, _, ws, wp, lpw, lsw = st
        else:
            ws = torch.empty(self.ws_numel, dtype=torch.float32, device=self.device)
            wp = ws.data_ptr()
            lpw, lsw = wp + self.lp_off * _F32, wp + self.lse_off * _F32
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if need_lse else None
        qp, kp, vp, outp = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
        sp = self.table_ptr if self.full else cache_seqlens.data_ptr()
        lpp = cache_leftpad.data_ptr() if self.has_lpad else sp
        lsep = lse.data_ptr() if need_lse else lsw
        # the binaries assume 16-byte aligned pointers (the current device is the plan's: above)
        if not (wp | qp | kp | vp | outp | sp | lpp | lsep) & 15:
            rt = self.rt
            try:  # direct_launch.hooks_idle(), inlined for Triton 3.6's HookChains
                idle = not (rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)
            except AttributeError:  # a hook of another kind, or none: the general answer
                idle = direct_launch.hooks_idle()
            if idle:
                go(
                    *self.split_pre, stream, *self.split_post,
                    qp, kp, vp, sp, lpp, self.table_ptr, wp, lpw, *self.split_q,
                    k_stride[0], k_stride[1], k_stride[2], v_stride[0], v_stride[1], v_stride[2],
                    *self.split_mid, c, *self.split_rest,
                )  # fmt: skip  (the pointers, then split_tail(k_cache, v_cache), inlined)
                self.reduce_go(*self.reduce_pre, stream, *self.reduce_post, wp, lpw, outp, lsep, *self.reduce_tail)
                return out, lse
        self._launch_jit(ws, q, k_cache, v_cache, cache_seqlens, cache_leftpad, out, lse)
        return out, lse

    def _eager_workspace(self, stream: int) -> tuple:
        """The eager workspace of ``stream`` (:func:`_workspace`) as this plan keeps it:
        ``ws_state``, (stream, table epoch, buffer, its three region pointers)."""
        ws = _workspace(self.dev_index, stream, self.ws_numel, self.device)  # now in the current table
        wp = ws.data_ptr()
        st = self.ws_state = (stream, _WS_EPOCH, ws, wp, wp + self.lp_off * _F32, wp + self.lse_off * _F32)
        return st

    def _run_jit(self, q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse, reuse_workspace):
        """A call through Triton's launch (no launch forms kept): the buffers, then :meth:`_launch_jit`;
        on the plan's device whatever the current one (as :meth:`launch`)."""
        if self.dev_index >= 0 and direct_launch.current_device() != self.dev_index:
            with torch.cuda.device(self.dev_index):
                return self._run_jit(q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse, reuse_workspace)
        if self.cuda and reuse_workspace and not direct_launch.capturing():
            stream = direct_launch.current_stream(self.dev_index)
            st = self.ws_state
            if st[0] != stream or st[1] != _WS_EPOCH:
                st = self._eager_workspace(stream)
            ws = st[2]
        else:
            ws = torch.empty(self.ws_numel, dtype=torch.float32, device=self.device)
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if need_lse else None
        self._launch_jit(ws, q, k_cache, v_cache, cache_seqlens, cache_leftpad, out, lse)
        return out, lse

    def _keep_launchers(self, split_form: tuple, reduce_form: tuple) -> None:
        """Launch both kernels directly from now on: ``direct_launch.launch_form`` of each."""
        self.rt = direct_launch.runtime_knobs()
        self.reduce_go, self.reduce_pre, self.reduce_post = reduce_form
        _, self.split_pre, self.split_post = split_form
        self.split_go = split_form[0]  # last: a thread that sees it set sees the rest (launch reads it first)

    def _launch_jit(self, ws, q, k_cache, v_cache, cache_seqlens, cache_leftpad, out, lse):
        """Both kernels through Triton's ``kernel[grid](...)`` with the plan's arguments (the
        first call, the interpreter, a misaligned pointer); keeps the compiled kernels for the
        direct path when the first aligned call on a GPU returns them."""
        op = ws.as_strided(self.op_shape, self.op_stride, 0)
        lp = ws.as_strided(self.lp_shape, self.lp_stride, self.lp_off)
        if lse is None:
            lse = ws.as_strided(self.lse_shape, self.lse_stride, self.lse_off)
        seqlens = self.table if self.full else cache_seqlens
        lpad = cache_leftpad if self.has_lpad else seqlens
        ck1 = _decode_split_kernel[self.split_grid](
            q, k_cache, v_cache, seqlens, lpad, self.table, op, lp, *self.split_tail(k_cache, v_cache),
            **self.split_opts,
        )
        ck2 = _decode_reduce_kernel[self.reduce_grid](op, lp, out, lse, *self.reduce_tail, **self.reduce_opts)
        if self.tried_direct or not self.cuda:
            return
        ptrs = (ws.data_ptr(), op.data_ptr(), lp.data_ptr(), lse.data_ptr(), out.data_ptr(), q.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), seqlens.data_ptr(), lpad.data_ptr())  # fmt: skip
        if any(p & 15 for p in ptrs):
            return  # these binaries were specialised on a misaligned pointer: not the plan's
        if direct_launch.current_device() != self.dev_index:
            return  # Triton compiled (and loaded) them for the current device, not the tensors'
        self.tried_direct = True
        split = direct_launch.launch_form(ck1, self.split_grid)
        reduce = direct_launch.launch_form(ck2, self.reduce_grid)
        if split is not None and reduce is not None:
            self._keep_launchers(split, reduce)


_WORKSPACES: dict[tuple[int, int, int], torch.Tensor] = {}
_MAX_WORKSPACES = 16
_WS_EPOCH = 0  # counts the replacements of _WORKSPACES (plans compare the epoch of the buffer they keep)


def _workspace(dev_index: int, stream: int, numel: int, device: torch.device) -> torch.Tensor:
    """One fp32 buffer per (device, stream, size), reused by eager calls. Safe: a call's split
    pass writes it and its reduction reads it, both on this stream, so the next call on the same
    stream (stream order) cannot overwrite it early, and another stream has its own. It is
    allocated on that stream (the caching allocator frees it only in that stream's order when the
    cache drops it). Never used while capturing a CUDA graph (a graph gets its own buffers) or
    under torch.compile (``decode.py`` passes ``reuse_workspace=False`` from the custom op, whose
    warm-up may run inside a graph's memory pool).

    At most ``_MAX_WORKSPACES`` buffers; when full the table is replaced by an empty one and
    ``_WS_EPOCH`` counts up: a plan that kept a buffer of an older table (``DecodePlan.launch``)
    notices on its next call and takes one from the new table. Until then it holds its own
    reference, so a buffer a plan launches on is never freed under it (at most one buffer per
    plan beyond the table)."""
    global _WORKSPACES, _WS_EPOCH
    key = (dev_index, stream, numel)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if len(_WORKSPACES) >= _MAX_WORKSPACES:
            _WORKSPACES = {}
            _WS_EPOCH += 1
        ws = _WORKSPACES[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return ws


_PLAN_USERS: list = []  # callables that drop every other reference to plans (decode.py's fast path)


def on_plans_cleared(fn) -> None:
    """Call ``fn()`` whenever the plan table is cleared: a cache that holds plans outside it
    (``decode.py``'s fast path of repeated calls) drops them too, so that clearing the table
    (tests, a user resetting state) leaves no plan in use. An evicted plan (the table is bounded)
    stays valid: a cache that still holds it may keep running it."""
    if fn not in _PLAN_USERS:
        _PLAN_USERS.append(fn)


class _PlanTable(OrderedDict):
    """The plans by key; ``clear`` also clears the caches registered with :func:`on_plans_cleared`."""

    def clear(self) -> None:
        super().clear()
        for fn in _PLAN_USERS:
            fn()


_PLANS: _PlanTable = _PlanTable()
_MAX_PLANS = 64


def plan_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, branches, causal, scale,
             block_n=None, num_warps=None, reduce_splits=128, reduce_cols=32) -> tuple:  # fmt: skip
    """The configuration a plan is built for (see :class:`DecodePlan`); cheap: a few C calls.
    Not the cache length nor the caches' strides (passed per call), only their specialisation
    classes: a growing cache keeps its plan, a change of class (e.g. a length that becomes a
    multiple of 16) gets another plan, as it needs another binary."""
    ks = k_cache.shape
    return (
        q.shape, q.stride(), ks[0], ks[2], ks[3], direct_launch.cache_classes(ks[1], k_cache.stride(), v_cache.stride()), q.dtype, q.get_device(),
        causal, scale, branches, cache_seqlens is None, cache_leftpad is not None,
        block_n, num_warps, reduce_splits, reduce_cols,
    )  # fmt: skip


def get_plan(key: tuple, q, k_cache, v_cache, cache_seqlens, cache_leftpad, branches, causal, scale,
             block_n=None, num_warps=None, reduce_splits=128, reduce_cols=32) -> DecodePlan:  # fmt: skip
    """The plan for ``key`` (built on a miss; the last ``_MAX_PLANS`` are kept, least recently
    built first out)."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = DecodePlan(q, k_cache, v_cache, cache_leftpad is not None, cache_seqlens is None, branches, causal,
                          scale, block_n, num_warps, reduce_splits, reduce_cols)  # fmt: skip
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.popitem(last=False)
        _PLANS[key] = plan
    return plan


def decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    branches,
    causal: bool,
    scale: float,
    *,
    need_lse: bool = True,
    reuse_workspace: bool = True,
    record: list | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    reduce_splits: int = 128,
    reduce_cols: int = 32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validated inputs (see ``decode.py``); same contract as :func:`torch_decode.decode_torch`.

    q (B, T, H, D) and the caches (B, C, Hkv, D) need unit stride in the last dim.
    ``cache_seqlens`` None: every row's valid slots are the whole cache (``dilated_attention``'s
    decode route; no index tensor is read). ``branches``: a tuple of (w, r, head start, head
    stop) tuples. ``need_lse`` False returns lse None (it is written to the workspace);
    ``reuse_workspace`` False allocates the split partials' buffer for this call (the custom op
    under torch.compile). ``record``: a list the plan is appended to (``decode.py``'s fast path
    keeps it for the next call of the same configuration).

    Runs through the configuration's :class:`DecodePlan`: one dict lookup, one or two fresh
    buffers, two launches of the compiled kernels through their launchers (Triton's
    ``kernel[grid](...)`` on the first call, under the interpreter, or for misaligned pointers).

    Tuning knobs for benchmarks: ``block_n`` (keys per split) and ``num_warps`` of the split
    pass; ``reduce_splits`` (partials per step) and ``reduce_cols`` (headdim columns per
    program) of the reduction: one step over all partials where they fit (the LongNet branches
    give 80 splits of 128 keys), and several programs per head so that the short grid of one
    token still spreads over the SMs.
    """
    if type(branches) is not tuple:
        branches = tuple(tuple(b) for b in branches)
    key = plan_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, branches, causal, scale,
                   block_n, num_warps, reduce_splits, reduce_cols)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = get_plan(key, q, k_cache, v_cache, cache_seqlens, cache_leftpad, branches, causal, scale,
                        block_n, num_warps, reduce_splits, reduce_cols)  # fmt: skip
    if record is not None:
        record.append(plan)
    return plan.run(q, k_cache, v_cache, cache_seqlens, cache_leftpad, need_lse, reuse_workspace)
