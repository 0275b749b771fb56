"""Launching the Triton kernels: block configs, grids, accumulator buffers, the fold decision.

:func:`forward` and :func:`backward` take validated, last-dim-contiguous tensors and return
plain tensors (no autograd); ``triton_ops.py`` wraps them in the custom ops, the only entry
point other code should use. Tuning knobs are keyword arguments (``config=``, ``fold=``,
``lo_rows=``) for ``benchmarks/tune_triton.py``; nothing here reads the environment at call time.

Launches run through a per-configuration :class:`TrainPlan` (built once: grids, argument
lists, lo ranges, buffer shapes; see "training plans" below); :func:`forward_per_call` /
:func:`backward_per_call` build everything per call (the tests' oracle, ``USE_PLANS = False``).

Accumulation across branches. A result row that more than one branch adds into is, in fp16 and
bf16, accumulated as a compensated pair (hi, lo) of the result dtype: hi is the result buffer
itself (at every step the correctly rounded partial sum, so no final cast and no float32 copy)
and lo the rounding residue (error per branch <= ~2^-17 relative for bf16, far below the final
rounding). The forward's (out, lse) merge uses the same pair. float32 inputs accumulate in
float32 directly; a row with a single contribution is written once in the result dtype. All
dK/dV launches run before all dQ launches, so only one phase's lo buffers are alive at a time,
and at long N a phase runs its launches range by range (:func:`lo_chunks`: 1/16 of the rows,
whole segments of every branch), so a lo buffer holds one range's rows only. Memory ledger at
2M tokens: benchmarks/NOTES_triton.md, "Memory at 2M tokens".
"""

from __future__ import annotations

import functools
import math
import operator
from collections import OrderedDict
from typing import NamedTuple

import torch

from .. import flags
from ..geometry import max_block_length, query_segments
from . import direct_launch, gluon_bwd, gluon_fwd, gluon_varlen, triton_import
from . import triton_kernels as kern
from .constants import int32_table

# Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton_kernels was
# imported, the CPU then) or compiled (CUDA): triton.jit fixed it for the life of the process.
INTERPRET: bool = triton_import.INTERPRET

Config = tuple[int, int, int, int]  # (BM, BN, num_warps, num_stages) of one kernel
KERNELS = ("fwd", "dkdv", "dq")


# Head dim <= 64 where every block is shorter than gluon_fwd.D64_MIN_BLOCK rows (calls that the
# Triton kernels run on Hopper too, the Gluon ones being slower there): query tiles of 64 rows
# instead of 128 (:data:`SHORT_D64_CONFIGS`). benchmarks/tune_triton.py on the one sweep row of
# that kind (8br-paper-d64-fp16-causal, blocks of 512-1366 rows, H200, 2026-11-29,
# results/tune_8br_h200_2026-11-29.md) put them first per kernel: fwd+bwd 14.64 against 15.15 ms
# as shipped (one run each; forward 3.46-3.61 against 3.65-3.68 ms). Off until a same-process
# A/B over short-block rows settles it (benchmarks/split_ab.py --switch triton_launch.SHORT_D64,
# `bash scripts/gpu_check.sh short-d64`). Read per call (the plans' key holds it).
SHORT_D64 = False
SHORT_D64_CONFIGS: dict[str, Config] = dict(fwd=(64, 32, 4, 3), dkdv=(32, 64, 4, 3),
                                             dq=(64, 32, 4, 3))  # fmt: skip


def default_configs(d: int, interpret: bool = INTERPRET, short: bool = False) -> dict[str, Config]:
    """Block sizes and launch parameters per kernel (fixed; tuned on an H100 for D = 64 / 128
    with benchmarks/tune_triton.py, results in benchmarks/results/tune_triton_*.md). ``short``:
    a call of short blocks at head dim <= 64 (:func:`short_blocks`): :data:`SHORT_D64_CONFIGS`.

    fwd and dq need BM % BN == 0 (the causal mask-free stage ends at the block's first row),
    dkdv BN % BM == 0 (its causal diagonal stage counts whole query blocks).
    """
    if interpret:
        # small blocks with BM != BN where the kernels allow it: several causal-diagonal query
        # blocks per key block (dkdv) and several mask-free key blocks before the diagonal
        # (dq, fwd) at test sizes
        return dict(fwd=(32, 16, 1, 1), dkdv=(16, 32, 1, 1), dq=(32, 16, 1, 1))
    if d <= 64:
        if short:
            return dict(SHORT_D64_CONFIGS)
        return dict(fwd=(128, 64, 4, 3), dkdv=(32, 128, 4, 3), dq=(128, 32, 4, 3))
    return dict(fwd=(128, 64, 8, 3), dkdv=(64, 64, 4, 2), dq=(128, 64, 8, 3))


def short_blocks(d: int, n: int, seg, dil) -> bool:
    """Whether a call at head dim ``d`` over ``n`` positions (the longer of queries and keys)
    takes :data:`SHORT_D64_CONFIGS`: :data:`SHORT_D64` on, d <= 64, and every branch's blocks
    shorter than ``gluon_fwd.D64_MIN_BLOCK`` rows."""
    if not SHORT_D64 or d > 64:
        return False
    longest = max(max_block_length(n, w, r) for w, r in zip(seg, dil, strict=True))
    return longest < gluon_fwd.D64_MIN_BLOCK


def resolve_configs(d: int, config: dict[str, Config] | None = None,
                    short: bool = False) -> dict[str, Config]:  # fmt: skip
    """The default configs (``short``: see :func:`default_configs`) with the kernels named in
    ``config`` replaced, checked."""
    cfg = default_configs(d, short=short)
    for name, vals in (config or {}).items():
        vals = tuple(int(x) for x in vals)
        if name not in cfg or len(vals) != 4:
            raise ValueError(
                f"bad Triton config {name}={vals}: want one of {KERNELS} = (BM, BN, num_warps, "
                "num_stages), e.g. dkdv=(64, 64, 4, 2)"
            )
        cfg[name] = vals
    fb, db, qb = cfg["fwd"], cfg["dkdv"], cfg["dq"]
    if fb[0] % fb[1] or qb[0] % qb[1] or db[1] % db[0]:
        raise ValueError(f"Triton configs need fwd/dq BM % BN == 0 and dkdv BN % BM == 0: {cfg}")
    return cfg


# the kernels behind their direct launchers (direct_launch.DirectKernel; the count is the number
# of tensor arguments, which every call site passes first). 256 keys each: a 2M-token call has
# 16 lo ranges x 5 branches of launches per kernel, each its own key
_FWD_FOLDED = direct_launch.DirectKernel(kern.dilated_fwd_folded_kernel, 9, max_plans=256)
_FWD = direct_launch.DirectKernel(kern.dilated_fwd_kernel, 9, max_plans=256)
_DELTA = direct_launch.DirectKernel(kern.dilated_bwd_delta_kernel, 3, max_plans=256)
_DKDV = direct_launch.DirectKernel(kern.dilated_bwd_dkdv_kernel, 13, max_plans=256)
_DQ = direct_launch.DirectKernel(kern.dilated_bwd_dq_kernel, 11, max_plans=256)


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv on ints (on Triton 3.6 a ConstexprFunction: a Python __call__ per use)
    return -(-a // b)


def _launch_kw(cfg: Config) -> dict:
    # the interpreter takes no num_warps / num_stages
    return {} if INTERPRET else dict(num_warps=cfg[2], num_stages=cfg[3])


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no silent TF32), as the dtype promises
    return "ieee" if dtype == torch.float32 else "tf32"


def branch_list(seg, dil, head_ranges) -> list[tuple[int, int, int, int]]:
    """(w, r, head start, head stop) of the branches that have heads."""
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


def _rows_with_several_branches(nh: int, hkv: int, head_ranges) -> tuple[bool, bool]:
    """(dq/out, dk/dv): can a row of that result receive contributions from more than one
    branch? (dk/dv: summed over the query heads of a kv head.) Such results accumulate as
    compensated pairs in fp16/bf16 (:func:`_acc_buffers`)."""
    rep = nh // hkv
    per_head = [0] * nh
    for hs, he in head_ranges:
        for h in range(hs, he):
            per_head[h] += 1
    several_q = max(per_head, default=0) > 1
    several_kv = any(sum(per_head[g * rep : (g + 1) * rep]) > 1 for g in range(hkv))
    return several_q, several_kv


def _acc_buffers(shape, dtype, device, several: bool, fill: bool = True):
    """(hi, needs lo) for a result that ``several`` branches may add into: hi (zeros; empty
    when not ``fill``: the first launch stores every element) in the result dtype is the result
    itself; a lo buffer (:func:`_lo_buffer`, same dtype) holds the rounding residues when rows
    get several contributions in a dtype narrower than float32."""
    hi = (torch.zeros if fill else torch.empty)(shape, dtype=dtype, device=device)
    return hi, several and dtype != torch.float32


# Rows per lo range (lo_chunks): 1/LO_CHUNKS of the rows, but at least LO_MIN_BYTES of lo; a
# result shorter than two such ranges keeps one lo buffer for every row (one launch per branch).
LO_CHUNKS = 16
LO_MIN_BYTES = 512 << 20


def lo_chunks(lay: _Layout, branches, row_bytes: int, lo_rows: int | None = None):
    """Key-position ranges ``[c0, c1)`` that the launches of a result with a lo buffer run one
    after another, each with a lo buffer of its own rows only (1/``LO_CHUNKS`` of a result at
    long N instead of a whole one: issue 24, 2M tokens on an 80 GB GPU).

    Every range is a whole number of segments of every branch (a multiple of lcm(w)), so all
    contributions to a row land in one range, in branch order, through the same (hi, lo) steps:
    the sums are bitwise those of one range. ``row_bytes``: bytes of one position's lo rows
    (batch x heads x headdim x itemsize); ``lo_rows``: rows per range (rounded up to lcm(w)),
    None for the rule above. One range ``(0, nk)`` for packed documents (their segments start
    at document offsets) and when no cut applies.
    """
    if lay.varlen or not branches:
        return [(0, lay.nk)]
    period = math.lcm(*(w for w, _, _, _ in branches))
    if lo_rows is None:
        lo_rows = max(-(-lay.nk // LO_CHUNKS), -(-LO_MIN_BYTES // max(row_bytes, 1)))
    rows = -(-max(lo_rows, 1) // period) * period
    if rows >= lay.nk:
        return [(0, lay.nk)]
    return [(c, min(c + rows, lay.nk)) for c in range(0, lay.nk, rows)]


def _lo_buffer(result: torch.Tensor, needed: bool, chunks, fill: bool = True) -> torch.Tensor | None:
    """The lo buffer of ``result`` (B, N, H, D), contiguous: None when not ``needed``, zeros
    (empty when not ``fill``) like the result for one range of :func:`lo_chunks`, else (B, rows
    of the longest range, H, D) with the result's row and head strides, which :func:`_lo_range`
    zeroes for each range."""
    if not needed:
        return None
    if len(chunks) == 1:
        return torch.zeros_like(result) if fill else torch.empty_like(result)
    b, _, h, d = result.shape
    rows = max(c1 - c0 for c0, c1 in chunks)
    lo = torch.empty(b, rows, h, d, dtype=result.dtype, device=result.device)
    assert lo.stride()[1:] == result.stride()[1:], (lo.stride(), result.stride())
    return lo


def _lo_range(lo: torch.Tensor | None, result: torch.Tensor, row0: int, chunked: bool,
              fill: bool = True):  # fmt: skip
    """(pointer, batch stride, first row) of the lo buffer for one range: the kernels address
    the lo element of result row i, batch b at ``b * sb + (i - row0) * row stride`` (row and
    head strides: the result's). The range's buffer is zeroed here (unless not ``fill``: the
    range's first launch stores all of it). No lo: the result as a dummy pointer (never read);
    one range: the result's own offsets (row0 = 0)."""
    if lo is None or not chunked:
        return (result if lo is None else lo), result.stride(0), 0
    if fill:
        lo.zero_()
    return lo, lo.stride(0), row0


def fold_geometry(nq: int, nk: int, branches) -> tuple[int, int] | None:
    """(w_min, r_max) when the forward can fold all branches into one online softmax, else None.

    Needs seqlen_q == seqlen_k, several branches, every r dividing r_max, every w a multiple of
    w_min and r_max dividing w_min. Then the rows of one head congruent to c mod r_max inside
    one w_min-aligned window lie in one segment of every branch and, for each branch (w, r),
    all have the offset c mod r: the branch takes all of them (c mod r == h mod r, h in its
    heads) or none. LongNet's default branches (w = 2048 * 2^i, r = 2^i) qualify; r = 6, 12
    with r = 4 do not.
    """
    if nq != nk or len(branches) < 2:
        return None
    wmin = min(w for w, _, _, _ in branches)
    rmax = max(r for _, r, _, _ in branches)
    if wmin % rmax or any(rmax % r or w % wmin for w, r, _, _ in branches):
        return None
    return wmin, rmax


def fold_fills_tile(geo: tuple[int, int], bm: int) -> bool:
    """Whether the folded forward is the default for :func:`fold_geometry`'s (w_min, r_max):
    a folded tile holds the w_min / r_max rows of one residue class in a window, so fewer than
    the forward's BM rows leave most of every tile masked. Measured on an H100
    (``benchmarks/fold_rule.py``, results/fold_rule_h100_2026-11-25.md): w_min / r_max = 16 ran
    6.5x slower than per-branch launches, 64 ran 1.8x slower; >= BM (128) folded ran 0-6%
    faster."""
    return geo[0] // geo[1] >= bm


@functools.lru_cache(maxsize=64)
def _branch_table(branches: tuple, device: torch.device) -> torch.Tensor:
    """(w, r, head start, head stop) per branch as an int32 device tensor, built once per
    (branches, device) outside any CUDA-graph pool (see ``constants.py``)."""
    return int32_table([list(b) for b in branches], device)


class Docs(NamedTuple):
    """Packed documents (varlen): document i holds query rows ``cu_q[i]:cu_q[i+1]`` and key
    rows ``cu_k[i]:cu_k[i+1]`` of a (1, total, heads, headdim) tensor; int32 device tensors of
    shape (docs + 1); ``max_q``/``max_k`` bound every document's lengths (they size the blocks
    per segment; the grids count the documents from the offsets' shape, :func:`_axis0`: the
    launch never reads the offsets on the host).

    ``checked``: the caller checked the offsets' values on the host for these very tensors
    (``checks.check_cu_seqlens_values``: 0 first, non-decreasing, the totals last, no document
    with more queries than keys, ``max_q``/``max_k`` at least every document's lengths). Then
    every row of q and k lies in a document, the first branch's launches can store every
    element of the results, and their buffers need no fill (:func:`_first_branch_writes_all`);
    unchecked offsets may leave rows past the last document, which must read as zeros. Never
    derived from the device offsets here (that would be a host sync)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    checked: bool = False

    def same_offsets(self) -> bool:
        """True when queries and keys share the offsets (same storage, so same values without
        reading them): every document then has as many queries as keys."""
        a, b = self.cu_q, self.cu_k
        return (
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and self.max_q == self.max_k
        )


class _Layout(NamedTuple):
    # what a launch needs to know of the batch or of the packed documents
    batch: int  # the grid's second axis counts it: batch entries; packed documents: 1 (their
    #             documents are on the first axis), 0 for a call without a document
    nq: int  # batch: seqlen_q; varlen: max_seqlen_q (blocks per segment only)
    nk: int  # batch: seqlen_k; varlen: max_seqlen_k (blocks per segment only)
    nq_stride: int  # the LSE / delta row stride: seqlen_q, or total_q
    qoff: int  # batch: nk - nq (varlen: per document, read in the kernel)
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    varlen: bool
    ndocs: int  # the kernels' NDOCS: packed, the call's documents (a plan's: 0); batch: 0
    total_k: int  # key rows of k (packed: a branch has total_k // w + documents slots)
    covered: bool  # every row of q and k is a sequence's (batch; packed: Docs.checked)


def _layout(q: torch.Tensor, k: torch.Tensor, docs: Docs | None) -> _Layout:
    if docs is None:
        bsz, nq = q.shape[:2]
        nk = k.shape[1]
        return _Layout(bsz, nq, nk, nq, nk - nq, q, q, False, 0, nk, True)  # q: dummies, never read
    nd = docs.cu_q.shape[0] - 1
    return _Layout(
        min(nd, 1), docs.max_q, docs.max_k, q.shape[1], 0, docs.cu_q, docs.cu_k, True, nd,
        k.shape[1], bool(docs.checked),
    )


def _seg_range(lay: _Layout, w: int, c0: int, c1: int) -> tuple[int, int]:
    """(first segment, count) of branch w's segments that hold a query and lie in the key
    positions [c0, c1) (c0 a multiple of w: see :func:`lo_chunks`); batch only."""
    s0, nseg = query_segments(lay.nq, lay.nk, w)
    a, b = max(s0, c0 // w), min(s0 + nseg, -(-c1 // w))
    return a, max(b - a, 0)


def block_slot_rows(w: int, r: int, block: int) -> int:
    """The key rows of one slot of a packed-documents launch of branch (w, r) with blocks of
    ``block`` dilated rows: ``r * block`` where that divides ``w`` (a slot per block), else
    ``w`` (a slot per segment). The kernels make the same choice (``triton_kernels._doc_block``)."""
    u = r * block
    return u if w % u == 0 else w


def _axis0(lay: _Layout, w: int, per_seg: int, c0: int, c1: int, r: int = 0,
           block: int = 0) -> tuple[int, int, int]:
    """(first segment S0, fixed programs, programs per document) of the grid's first axis of
    branch w's launch over key positions [c0, c1), ``per_seg`` programs per segment: a call
    over d documents launches ``fixed + per_document * d`` of them.

    Batch: the segments that hold a query in [c0, c1) (:func:`_seg_range`), nothing per
    document. Packed documents (one range; ``r`` and ``block``: the branch's dilation and the
    kernel's block of dilated rows, 0 for windows of w rows): the flat grid of
    ``total_k // u + d`` slots of u key rows (:func:`block_slot_rows`: a block, or a segment
    with ``per_seg`` programs), which the kernels map back by counting the slot starts at or
    below theirs (``triton_kernels._doc_block``): document i owns ``cu_k[i] // u + i``
    onwards, ceil(its keys / u) slots and at most one spare (which returns at once). No host
    work and no offset read per call, and a document's programs grow with its own length: a
    grid of documents x the longest document's segments left most programs without a
    segment, and one of segments x the longest document's blocks most of a short document's
    blocks (issue 22, item 2)."""
    if lay.varlen:
        if block and block_slot_rows(w, r, block) == r * block:  # a slot per block
            return 0, lay.total_k // (r * block), 1
        return 0, per_seg * (lay.total_k // w), per_seg
    s0, nseg = _seg_range(lay, w, c0, c1)
    return s0, per_seg * nseg, 0


def _first_launch(lay: _Layout, branches, nms) -> int:
    """The forward's FIRST branch: the first with a program (it stores without reading), in
    every lo range alike (ranges are whole segments of every branch); -1 if none."""
    return next((bi for bi, (w, _, hs, he) in enumerate(branches)
                 if nms[bi] * lay.batch * (he - hs)
                 and (lay.varlen or _seg_range(lay, w, 0, lay.nk)[1])), -1)  # fmt: skip


def _fwd_folded(q, k, v, kpm, causal, scale, branches, wmin, rmax, cfg, lay):
    bsz, n, nh, d = q.shape
    bm, bn = cfg[:2]
    out = torch.empty_like(q)
    lse = torch.empty(bsz, nh, n, dtype=torch.float32, device=q.device)
    if not lay.covered:
        # rows of no document (past the last offset: none when the caller checked the offsets,
        # Docs.checked) keep these values
        out.zero_()
        lse.fill_(float("-inf"))
    brs = _branch_table(tuple(branches), q.device)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    nt = _cdiv(wmin // rmax, bm)
    _, fixed, per_doc = _axis0(lay, wmin, nt * rmax, 0, lay.nk)  # windows of wmin rows
    grid = (fixed + per_doc * lay.ndocs, lay.batch * nh)
    if grid[0] * grid[1] == 0:
        return out, lse
    _FWD_FOLDED[grid](
        q, k, v, kp, out, lse, brs, lay.cu_q, lay.cu_k, lay.ndocs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), skp,
        out.stride(0), out.stride(1), out.stride(2),
        n, nh, nh // k.shape[2], len(branches), wmin, rmax, nt,
        scale * kern.LOG2E.value,
        D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=_prec(q.dtype),
        VARLEN=lay.varlen,
        **_launch_kw(cfg),
    )
    return out, lse


def forward_per_call(q, k, v, kpm, seg, dil, causal, scale, head_ranges, *, config=None,
                     fold=None, docs: Docs | None = None, lo_rows: int | None = None):
    """:func:`forward` with every argument and buffer built on this call (the code before the
    training plans): ``USE_PLANS = False`` routes every call to it, and it is the oracle of the
    plan tests (tests/test_train_plan.py). Contract as there."""
    dev = direct_launch.tensor_device(q)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return forward_per_call(q, k, v, kpm, seg, dil, causal, scale, head_ranges,
                                    config=config, fold=fold, docs=docs, lo_rows=lo_rows)  # fmt: skip
    bsz, nq, nh, d = q.shape
    hkv = k.shape[2]
    lay = _layout(q, k, docs)
    cfg = resolve_configs(d, config, short_blocks(d, max(q.shape[1], k.shape[1]), seg, dil))["fwd"]
    branches = branch_list(seg, dil, head_ranges)
    if fold is False or (fold is None and causal) or (docs is not None and not docs.same_offsets()):
        geo = None
    else:
        geo = fold_geometry(lay.nq, lay.nk, branches)
    if fold is None and geo is not None and not fold_fills_tile(geo, cfg[0]):
        geo = None
    if geo is not None:
        return _fwd_folded(q, k, v, kpm, causal, scale, branches, *geo, cfg, lay)
    bm, bn = cfg[:2]
    several = _rows_with_several_branches(nh, hkv, head_ranges)[0]
    acc_o, comp = _acc_buffers((bsz, nq, nh, d), q.dtype, q.device, several)
    row_bytes = bsz * nh * d * q.element_size()
    chunks = lo_chunks(lay, branches, row_bytes, lo_rows) if comp else [(0, lay.nk)]
    acc_lo = _lo_buffer(acc_o, comp, chunks)
    acc_l = torch.full((bsz, nh, nq), float("-inf"), dtype=torch.float32, device=q.device)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    nms = [_cdiv(max_block_length(lay.nk, w, r), bm) for w, r, _, _ in branches]
    first = _first_launch(lay, branches, nms)
    for c0, c1 in chunks:
        lo, slob, lo_row0 = _lo_range(acc_lo, acc_o, c0 - lay.qoff, len(chunks) > 1)
        for bi, (w, r, hs, he) in enumerate(branches):
            nm = nms[bi]
            s0, fixed, per_doc = _axis0(lay, w, nm, c0, c1, r, bm)
            grid = (fixed + per_doc * lay.ndocs, lay.batch * (he - hs))
            if grid[0] * grid[1] == 0:
                continue
            _FWD[grid](
                q, k, v, kp, acc_o, lo, acc_l, lay.cu_q, lay.cu_k, lay.ndocs,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), skp,
                acc_o.stride(0), acc_o.stride(1), acc_o.stride(2), slob, lo_row0,
                lay.nq_stride, lay.nk, lay.qoff, hs, he - hs, nh, nh // hkv, w, r, s0, nm,
                scale * kern.LOG2E.value,
                D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, FIRST=bi == first,
                PREC=_prec(q.dtype), COMP=comp, STORE_LO=bi < len(branches) - 1,
                VARLEN=lay.varlen,
                **_launch_kw(cfg),
            )
    return acc_o, acc_l


def _delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * out) (B, H, N) float32 by the delta kernel; out and dout (B, N, H,
    D) with a unit-stride last dim (:func:`_broadcast_view`)."""
    bsz, nq, nh, d = out.shape
    delta = torch.empty(bsz, nh, nq, dtype=torch.float32, device=out.device)
    nrows = bsz * nq * nh
    br = 16 if INTERPRET else 64
    if nrows > 0:
        _DELTA[(_cdiv(nrows, br),)](
            out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2), nrows, nq, nh, D=d, BR=br
        )
    return delta


def _broadcast_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit-stride last dim and the fewest bytes: a broadcast dim (stride 0, e.g.
    the all-ones gradient of ``out.sum()``) stays broadcast, only the rest is copied."""
    if x.stride(-1) == 1:
        return x
    if any(st == 0 and n > 1 for st, n in zip(x.stride()[:-1], x.shape[:-1], strict=True)):
        idx = tuple(slice(0, 1) if st == 0 else slice(None) for st in x.stride()[:-1])
        return x[idx].contiguous().expand(x.shape)
    return x.contiguous()


def backward_per_call(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges, *,
                      config=None, docs: Docs | None = None, lo_rows: int | None = None):
    """:func:`backward` with every argument and buffer built on this call (see
    :func:`forward_per_call`). Contract as there."""
    dev = direct_launch.tensor_device(q)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return backward_per_call(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale,
                                     head_ranges, config=config, docs=docs, lo_rows=lo_rows)  # fmt: skip
    bsz, nq, nh, d = q.shape
    hkv = k.shape[2]
    lay = _layout(q, k, docs)
    rep = nh // hkv
    cfgs = resolve_configs(d, config, short_blocks(d, max(q.shape[1], k.shape[1]), seg, dil))
    dout = _broadcast_view(dout)
    out = _broadcast_view(out)
    delta = _delta(out, dout)
    several_q, several_kv = _rows_with_several_branches(nh, hkv, head_ranges)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    prec = _prec(q.dtype)
    qk_scale = scale * kern.LOG2E.value
    strides_in = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), skp, dout.stride(0), dout.stride(1), dout.stride(2),
    )
    branches = branch_list(seg, dil, head_ranges)

    def geom(w, r):  # longest block of the branch
        return max_block_length(lay.nk, w, r)

    # all dK/dV first, then all dQ, so that one phase's lo buffers are alive at a time (peak:
    # the inputs, out, dout, lse, delta, the three results and the dQ phase's lo buffer)
    q_all, kv_all = _bwd_writes_all(branches, nh, lay.covered, lay.qoff)
    dk, comp = _acc_buffers(k.shape, k.dtype, q.device, several_kv, not kv_all)
    dv, _ = _acc_buffers(v.shape, v.dtype, q.device, several_kv, not kv_all)
    row_bytes = bsz * hkv * d * k.element_size()
    chunks = lo_chunks(lay, branches, row_bytes, lo_rows) if comp else [(0, lay.nk)]
    dk_lo, dv_lo = _lo_buffer(dk, comp, chunks, not kv_all), _lo_buffer(dv, comp, chunks, not kv_all)
    assert dk.stride() == dv.stride()  # one lo batch stride and row origin for both
    bm, bn = cfgs["dkdv"][:2]
    for c0, c1 in chunks:
        # key rows: dk, dv row i is key position i (row0 = c0)
        lk, slob, lo_row0 = _lo_range(dk_lo, dk, c0, len(chunks) > 1, not kv_all)
        lv, _, _ = _lo_range(dv_lo, dv, c0, len(chunks) > 1, not kv_all)
        for bi, (w, r, hs, he) in enumerate(branches):
            nnb = -(-geom(w, r) // bn)
            ni = min(rep, r)
            s0, fixed, per_doc = _axis0(lay, w, nnb, c0, c1, r, bn)
            grid = (fixed + per_doc * lay.ndocs, lay.batch * hkv * ni)
            if grid[0] * grid[1] == 0:
                continue
            _DKDV[grid](
                q, k, v, kp, dout, lse, delta, dk, dv, lk, lv, lay.cu_q, lay.cu_k, lay.ndocs,
                *strides_in,
                dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                slob, lo_row0,
                lay.nq_stride, lay.nk, lay.qoff, hs, he, nh, hkv, rep, ni, w, r, s0, nnb,
                qk_scale, scale,
                D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=prec,
                COMP=comp, STORE_LO=bi < len(branches) - 1, VARLEN=lay.varlen,
                FIRST=kv_all and bi == 0, **_launch_kw(cfgs["dkdv"]),
            )
    del dk_lo, dv_lo, lk, lv
    dq, comp = _acc_buffers(q.shape, q.dtype, q.device, several_q, not q_all)
    row_bytes = bsz * nh * d * q.element_size()
    chunks = lo_chunks(lay, branches, row_bytes, lo_rows) if comp else [(0, lay.nk)]
    dq_lo = _lo_buffer(dq, comp, chunks, not q_all)
    bm, bn = cfgs["dq"][:2]
    for c0, c1 in chunks:
        # query rows: dq row i is key position i + qoff
        lq, slob, lo_row0 = _lo_range(dq_lo, dq, c0 - lay.qoff, len(chunks) > 1, not q_all)
        for bi, (w, r, hs, he) in enumerate(branches):
            nm = -(-geom(w, r) // bm)
            s0, fixed, per_doc = _axis0(lay, w, nm, c0, c1, r, bm)
            grid = (fixed + per_doc * lay.ndocs, lay.batch * (he - hs))
            if grid[0] * grid[1] == 0:
                continue
            _DQ[grid](
                q, k, v, kp, dout, lse, delta, dq, lq,
                lay.cu_q, lay.cu_k, lay.ndocs, *strides_in,
                dq.stride(0), dq.stride(1), dq.stride(2), slob, lo_row0,
                lay.nq_stride, lay.nk, lay.qoff, hs, he - hs, nh, rep, w, r, s0, nm,
                qk_scale, scale,
                D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=prec,
                COMP=comp, STORE_LO=bi < len(branches) - 1, VARLEN=lay.varlen,
                FIRST=q_all and bi == 0, **_launch_kw(cfgs["dq"]),
            )
    return dq, dk, dv



# ------------------------------------------------------------------------------ training plans
#
# A plan holds everything of a training call that depends only on its configuration (issue 23
# item 3; ``triton_decode.DecodePlan`` does the same for decode): the launches of the forward and
# of the backward in their order, each with its kernel, grid, non-tensor arguments (strides,
# sizes, scale, constexprs: exactly those the per-call path passes) and which per-call tensor
# goes into each pointer slot; the lo ranges; the buffer shapes and which need a fill. A call is
# one dict lookup, its allocations and its launches: on a GPU, once every launch of a phase has
# been through ``DirectKernel`` (Triton's path, then its kept launcher), the launchers directly
# with the call's pointers (one alignment check for all of them, one device/hook check per
# call); anywhere else ``DirectKernel[grid](...)`` with the per-call path's very arguments.
#
# Fills. The forward's first branch stores without reading (``FIRST``): when it writes every
# query row of every head of out, lse and lo (:func:`_first_branch_writes_all`: r == 1 over all
# heads, as the LongNet branches with head_assignment="all"), the three buffers are allocated
# empty. The backward's first branch does the same where its launches store every element of
# dq (and of dk, dv: also no key before the first query; :func:`_bwd_writes_all`); elsewhere
# the backward kernels add into zero-filled dq, dk, dv and lo buffers. The lo buffers of dk and
# dv are one allocation (one fill at most; they live and die together).
# Bytes and lifetimes are those of the per-call path (NOTES_triton.md, "Memory at 2M tokens").
# Packed documents: the key adds the buckets of their max lengths, the shared-offsets flag and
# whether the caller checked the offsets (not their count: each call adds its documents' slots
# to the flat grids, ``_Launch.per_doc``); the offsets are per-call pointers. Their buffers are
# filled unless the offsets were checked on the host (``Docs.checked``: rows past the last
# document must read as zeros otherwise); checked, they follow the rule above.

USE_PLANS: bool = True  # False: every call takes the per-call path (tests, A/B)
_MAX_PLANS = 64
_CONTIGUOUS = torch.contiguous_format


class _NoPlan(Exception):
    """A configuration the plans do not cover (it takes the per-call path)."""


class _Launch:
    """One step of a plan: ``kernel[grid](*table[slots], *tail, **opts)``, or, once collected,
    ``go(stream, (*pointers[slots], *args))`` (``args``: every non-tensor parameter in
    signature order, as ``DirectKernel`` keeps it). ``kernel`` None: ``table[slot].zero_()``
    (a lo range's fill).

    ``per_doc`` (packed documents; 0 otherwise): the grid's first axis depends on the call's
    document count, which varies per call: a call over d documents launches
    ``(grid[0] + per_doc * d, grid[1])`` (:meth:`grid_for`: the flat grid of :func:`_axis0`)
    and passes d as the kernel's first non-tensor argument (``NDOCS``), which ``tail`` and
    ``args`` leave out; once collected, through ``go`` of ``direct_launch.grid_launcher``
    (``go(gx, gy, gz, stream, args)``). A call without a document launches nothing."""

    __slots__ = ("kernel", "grid", "slots", "take", "tail", "opts", "go", "args", "slot", "per_doc")

    def __init__(self, kernel, grid, slots, tail, opts, slot: int = -1, per_doc: int = 0):
        self.kernel, self.grid, self.slots, self.tail, self.opts = kernel, grid, slots, tail, opts
        self.take = operator.itemgetter(*slots) if len(slots) > 1 else None
        self.go = self.args = None
        self.slot = slot
        self.per_doc = per_doc

    def grid_for(self, ndocs: int) -> tuple:
        """The grid of a call over ``ndocs`` documents (the plan's own grid if not per_doc)."""
        if not self.per_doc:
            return self.grid
        return (self.grid[0] + self.per_doc * ndocs, self.grid[1])


def _zero_step(slot: int) -> _Launch:
    return _Launch(None, None, (), (), {}, slot)


class _Seq:
    """The steps of one phase, in order. ``direct``: None (launchers not collected yet), True
    (every launch has its launcher), False (Triton's path for good: ``DirectKernel`` kept no
    launcher for one of them)."""

    __slots__ = ("steps", "direct")

    def __init__(self, steps):
        self.steps = steps
        self.direct = None

    def launches(self) -> list[_Launch]:
        return [st for st in self.steps if st.kernel is not None]


def _collect(seq: _Seq, table, ndocs: int) -> None:
    """After a phase ran through ``DirectKernel`` on a GPU (over ``ndocs`` documents, packed;
    else unused): take the launchers it kept (per-document steps: a launcher with the grid per
    call, of the same compiled kernel)."""
    found = []
    for st in seq.launches():
        entry = getattr(st.kernel, "entry", None)
        if entry is None:  # not a DirectKernel: Triton's path for good
            seq.direct = False
            return
        if st.per_doc and not ndocs:
            return  # not launched in this call (no document): next call
        tail = (ndocs, *st.tail) if st.per_doc else st.tail
        e = entry(st.grid_for(ndocs), st.take(table), tail, st.opts)
        if e is None:
            return  # not kept yet (misaligned, hooks, other device, switch off): next call
        if e is not False and st.per_doc:
            go = direct_launch.grid_launcher(e[2])
            e = False if go is None else (go, e[1][1:], None)  # NDOCS: per call
        found.append(e)
    if any(e is False for e in found):
        seq.direct = False
        return
    for st, (go, args, _) in zip(seq.launches(), found, strict=True):
        st.go, st.args = go, args
    seq.direct = True


def _first_branch_writes_all(branches, first: int, nh: int, covered: bool, qoff: int) -> bool:
    """Whether the forward's FIRST launch (branch ``first``, in every lo range) stores every
    query row of every head of out and lse, and of lo when there is one: then no later branch
    reads what the buffers were filled with, and they need no fill.

    Branch (w, 1) over heads [0, nh): head h reads offset h % 1 = 0, so the block of a segment
    is all of its rows; the launch covers every segment that holds a query (in each lo range:
    ranges are whole segments of every branch) with ceil(longest block / BM) query blocks, and a
    program stores every row of its block that is a query (out = 0, lse = -inf for a row with
    no key). More queries than keys (qoff < 0, refused by the front door): the first rows are
    no position's. Packed documents (``covered`` = :attr:`Docs.checked`): the flat grid has a
    slot for every segment of every document and its programs store each document's query rows
    alike (its own qoff = nk - nq >= 0, blocks sized for ``max_k`` >= its nk); unchecked
    offsets may leave rows past the last document to no program, so those keep the fills."""
    if not covered or first != 0 or not branches or qoff < 0:
        return False
    _, r, hs, he = branches[0]
    return r == 1 and hs == 0 and he == nh


def _bwd_writes_all(branches, nh: int, covered: bool, qoff: int) -> tuple[bool, bool]:
    """(dq, dk and dv): whether the backward's launches of the FIRST branch store every element
    of the result (and of its lo buffer), so that it is allocated empty and that branch stores
    without reading (``FIRST``), in every lo range alike (ranges are whole segments).

    The forward's rule (:func:`_first_branch_writes_all`) with branch 0 as the first: (w, 1)
    over heads [0, nh) has a program for every query block of every segment that holds a query
    and for every kv head (one offset class), and each stores all of its rows, zeros for a row
    with no key or no query. dK/dV also need every key row to lie in such a segment: no key
    before the first query (qoff == 0; the batch grid skips segments without a query). Packed
    documents: the flat grid launches every segment of a document, queries or not, and dK/dV
    stores every key row of each (zeros where no query sees it), so documents with fewer
    queries than keys (and keys-only ones) need no fill either once the offsets are checked
    (``covered``; their layout's qoff is 0)."""
    q_all = _first_branch_writes_all(branches, 0, nh, covered, qoff)
    return q_all, q_all and qoff == 0


def _contiguous_strides(shape) -> tuple[int, ...]:
    st, acc = [], 1
    for n in reversed(tuple(shape)):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


def _config_key(config) -> tuple | None:
    if not config:
        return None
    return tuple(sorted((str(name), tuple(int(x) for x in vals)) for name, vals in config.items()))


def grid_bucket(n: int) -> int:
    """The length a packed-documents plan sizes its grids for when the longest document has
    ``n`` rows: n rounded up to a multiple of 1/8 of the power of two above it, at least 16
    (0 stays 0): 4 buckets per octave, at most 25% more rows (n > 128; at most 15 below).

    Exact: the grids' blocks per segment are sized for the bucket, and every block past a
    segment's end finds its block empty (``m_lo >= L`` / ``n_lo >= L``, or no row below ``n``
    in the folded kernel) and returns before any load of q, k, v or store, as the blocks past
    a shorter document's end do already; the integer arguments of the launches (``NK``, blocks
    per segment) are the bucket's, so a plan never meets another specialisation of them (the
    segments themselves are the flat grid's slots, counted from shapes: :func:`_axis0`)."""
    if n <= 0:
        return 0
    step = max(1 << max((n - 1).bit_length() - 3, 0), 16)
    return -(-n // step) * step


def plan_key(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config=None, fold=None,
             lo_rows=None, docs: Docs | None = None) -> tuple:  # fmt: skip
    """The configuration a :class:`TrainPlan` is built for: every grid, integer argument,
    constexpr, buffer shape and fill of its launches is a function of it (with the module's
    ``LO_CHUNKS``, ``LO_MIN_BYTES``, ``INTERPRET`` and ``SHORT_D64``, which it includes). Cheap: attribute
    reads and one tuple. ``head_ranges``: [(start, stop)] per branch. ``docs``: packed documents:
    the buckets of ``max_q`` / ``max_k`` (:func:`grid_bucket`: a plan sizes its grids and integer
    arguments from them, so that steps whose longest document differs share a plan), whether
    queries and keys share the offsets, the offsets' dtype, whether they were checked
    (:attr:`Docs.checked`: the fills); neither the number of documents (a call's grids count
    them: :meth:`_Launch.grid_for`) nor the offsets (per-call pointers)."""
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
        q.device, None if kpm is None else (kpm.shape, kpm.stride(), kpm.dtype),
        causal, scale, tuple(seg), tuple(dil), tuple(head_ranges), _config_key(config), fold,
        lo_rows, LO_CHUNKS, LO_MIN_BYTES, INTERPRET, SHORT_D64,
        None if docs is None else (docs.cu_q.dtype, docs.cu_k.dtype, grid_bucket(docs.max_q),
                                   grid_bucket(docs.max_k), docs.same_offsets(),
                                   bool(docs.checked)),
    )  # fmt: skip


class _BwdPlan:
    """The backward's steps for one (dout, out) layout: delta, the dK/dV phase, the dQ phase."""

    __slots__ = ("delta", "dkdv", "dq", "kv_comp", "kv_chunked", "kv_lo_shape", "q_comp",
                 "q_chunked", "q_lo_shape", "kv_fill", "q_fill")  # fmt: skip


class TrainPlan:
    """The launches of one training configuration (:func:`plan_key`), built once.

    Pointer slots of the forward: 0 q, 1 k, 2 v, 3 kpm (its uint8 view; q when none), 4 out,
    5 out's lo buffer (out when none), 6 lse, 7 the branch table (folded), 8 cu_q, 9 cu_k.
    Backward: delta phase 0 out, 1 dout, 2 delta; dK/dV phase 0 q, 1 k, 2 v, 3 kpm, 4 dout,
    5 lse, 6 delta, 7 dk, 8 dv, 9 dk's lo, 10 dv's lo (dk, dv when none), 11 the buffer holding
    both lo, 12 cu_q, 13 cu_k; dQ phase 0-6 as dK/dV, 7 dq, 8 dq's lo (dq when none), 9 cu_q,
    10 cu_k. Without packed documents cu_q / cu_k are q (dummies, never read)."""

    def __init__(self, q, k, v, kpm, seg, dil, causal, scale, head_ranges, config=None, fold=None,
                 lo_rows=None, docs: Docs | None = None):  # fmt: skip
        if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
            raise _NoPlan("q, k, v of shape (B, N, H, D), k and v alike")
        self.device, self.dtype = q.device, q.dtype
        self.dev = direct_launch.tensor_device(q)
        self.gpu = self.dev >= 0
        self.causal, self.scale = causal, scale
        self.config_key, self.lo_rows = _config_key(config), lo_rows
        # without its dummy pointers (q): a plan holds no tensor of a call
        self.lay = _layout(q, k, docs)._replace(cu_q=None, cu_k=None)
        self.varlen = docs is not None
        if self.varlen:
            # blocks per segment and integer arguments for the buckets of the longest lengths
            # (plan_key); the flat grids' slots per document are added per call (_Launch.per_doc)
            self.lay = self.lay._replace(batch=1, ndocs=0, nq=grid_bucket(docs.max_q),
                                         nk=grid_bucket(docs.max_k))  # fmt: skip
        # the kernels' NDOCS: a call's documents for packed launches (per call), else 0
        self.nd_arg = () if self.varlen else (0,)
        self.cfgs = resolve_configs(q.shape[-1], config,
                                    short_blocks(q.shape[-1], max(q.shape[1], k.shape[1]), seg, dil))  # fmt: skip
        self.branches = branch_list(seg, dil, head_ranges)
        self.has_kpm = kpm is not None
        self.skp = _kpm_arg(kpm, q)[1] if kpm is not None else 0
        self.several_q, self.several_kv = _rows_with_several_branches(
            q.shape[2], k.shape[2], list(head_ranges)
        )
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self._build_forward(q, k, v, fold, docs is not None and not docs.same_offsets())
        self._bwd: dict = {}

    # ---------------------------------------------------------------------------- forward
    def _build_forward(self, q, k, v, fold, no_fold: bool):
        lay, branches, causal = self.lay, self.branches, self.causal
        bsz, nq, nh, d = q.shape
        hkv = k.shape[2]
        cfg = self.cfgs["fwd"]
        bm, bn = cfg[:2]
        qk_scale = self.scale * kern.LOG2E.value
        strides_in = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), self.skp)  # fmt: skip
        geo = None
        if not (fold is False or (fold is None and causal) or no_fold):
            geo = fold_geometry(lay.nq, lay.nk, branches)
        if fold is None and geo is not None and not fold_fills_tile(geo, bm):
            geo = None  # as forward_per_call
        self.folded = geo is not None
        if self.folded:  # as _fwd_folded
            wmin, rmax = geo
            self.brs = _branch_table(tuple(branches), q.device)
            ost = torch.empty_like(q, device="meta").stride()  # out = torch.empty_like(q)
            nt = _cdiv(wmin // rmax, bm)
            _, fixed, per_doc = _axis0(lay, wmin, nt * rmax, 0, lay.nk)
            grid = (fixed, lay.batch * nh)
            steps = []
            if (fixed + per_doc) * grid[1]:
                steps.append(_Launch(
                    _FWD_FOLDED, grid, (0, 1, 2, 3, 4, 6, 7, 8, 9),
                    (*self.nd_arg, *strides_in, ost[0], ost[1], ost[2],
                     nq, nh, nh // hkv, len(branches), wmin, rmax, nt, qk_scale),
                    dict(D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=self.has_kpm,
                         PREC=_prec(q.dtype), VARLEN=lay.varlen, **_launch_kw(cfg)),
                    per_doc=per_doc,
                ))  # fmt: skip
            self.fwd = _Seq(steps)
            return
        # per-branch launches + merge, as forward_per_call
        self.out_shape = (bsz, nq, nh, d)
        ost = _contiguous_strides(self.out_shape)
        comp = self.several_q and q.dtype != torch.float32
        row_bytes = bsz * nh * d * q.element_size()
        chunks = lo_chunks(lay, branches, row_bytes, self.lo_rows) if comp else [(0, lay.nk)]
        chunked = len(chunks) > 1
        self.fwd_comp, self.fwd_chunked = comp, chunked
        self.fwd_lo_shape = (bsz, max(c1 - c0 for c0, c1 in chunks), nh, d) if chunked else self.out_shape
        lost = _contiguous_strides(self.fwd_lo_shape)
        nms = [_cdiv(max_block_length(lay.nk, w, r), bm) for w, r, _, _ in branches]
        first = _first_launch(lay, branches, nms)
        self.fwd_fill = not _first_branch_writes_all(branches, first, nh, lay.covered, lay.qoff)
        steps = []
        for c0, c1 in chunks:
            if comp and chunked:  # _lo_range
                slob, lo_row0 = lost[0], c0 - lay.qoff
                if self.fwd_fill:
                    steps.append(_zero_step(5))
            else:
                slob, lo_row0 = ost[0], 0
            for bi, (w, r, hs, he) in enumerate(branches):
                nm = nms[bi]
                s0, fixed, per_doc = _axis0(lay, w, nm, c0, c1, r, bm)
                grid = (fixed, lay.batch * (he - hs))
                if (fixed + per_doc) * grid[1] == 0:
                    continue
                steps.append(_Launch(
                    _FWD, grid, (0, 1, 2, 3, 4, 5, 6, 8, 9),
                    (*self.nd_arg, *strides_in, ost[0], ost[1], ost[2], slob, lo_row0,
                     lay.nq_stride, lay.nk, lay.qoff, hs, he - hs, nh, nh // hkv, w, r, s0, nm,
                     qk_scale),
                    dict(D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=self.has_kpm,
                         FIRST=bi == first, PREC=_prec(q.dtype), COMP=comp,
                         STORE_LO=bi < len(branches) - 1, VARLEN=lay.varlen, **_launch_kw(cfg)),
                    per_doc=per_doc,
                ))  # fmt: skip
        self.fwd = _Seq(steps)

    def forward(self, q, k, v, kpm, docs: Docs | None = None):
        """(out, lse) of one call with tensors of the plan's configuration, on the plan's device
        whatever the current one (the device guard of ``direct_launch.py``; one check per call,
        which :meth:`_stream` then needs not repeat)."""
        if self.gpu and direct_launch.current_device() != self.dev:
            with torch.cuda.device(self.dev):
                return self.forward(q, k, v, kpm, docs)
        kp = q if kpm is None else kpm.contiguous().view(torch.uint8)
        cq, ck = (q, q) if docs is None else (docs.cu_q, docs.cu_k)  # q: dummies, never read
        nd = 1 if docs is None else docs.cu_q.shape[0] - 1  # documents: a shape, no sync
        dev = self.device
        if self.folded:
            out = torch.empty_like(q)
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
            if not self.lay.covered:  # rows of no document keep these values
                out.zero_()
                lse.fill_(float("-inf"))
            if self.fwd.steps:
                self._run(self.fwd, [q, k, v, kp, out, out, lse, self.brs, cq, ck], self._stream(),
                          nd)  # fmt: skip
            return out, lse
        lo = None
        if self.fwd_fill:
            out = torch.zeros_like(q, memory_format=_CONTIGUOUS)
            if self.fwd_comp:  # _lo_buffer: zeros for one range, else a buffer zeroed per range
                lo = (torch.empty(self.fwd_lo_shape, dtype=q.dtype, device=dev) if self.fwd_chunked
                      else torch.zeros_like(out))  # fmt: skip
            lse = torch.full(self.lse_shape, float("-inf"), dtype=torch.float32, device=dev)
        else:  # the first branch writes every element of all three
            # out_shape is q's: *_like(q, contiguous) is torch.empty(out_shape, ...) for less
            # argument parsing (issue 23 item 3); so below and in the backward
            out = torch.empty_like(q, memory_format=_CONTIGUOUS)
            if self.fwd_comp:
                lo = (torch.empty(self.fwd_lo_shape, dtype=q.dtype, device=dev) if self.fwd_chunked
                      else torch.empty_like(out))  # fmt: skip
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        self._run(self.fwd, [q, k, v, kp, out, out if lo is None else lo, lse, q, cq, ck],
                  self._stream(), nd)  # fmt: skip
        return out, lse

    # --------------------------------------------------------------------------- backward
    def _lo_ranges(self, x, several: bool):
        """(comp, chunked, row ranges, lo shape) of one gradient's lo accumulator (x: q for dq,
        k for dk and dv): as ``_acc_buffers`` / ``lo_chunks`` / ``_lo_buffer`` decide per call."""
        bsz, _, heads, d = x.shape
        comp = several and x.dtype != torch.float32
        row_bytes = bsz * heads * d * x.element_size()
        chunks = lo_chunks(self.lay, self.branches, row_bytes, self.lo_rows) if comp else [(0, self.lay.nk)]
        chunked = len(chunks) > 1
        shape = (bsz, max(c1 - c0 for c0, c1 in chunks), heads, d) if chunked else tuple(x.shape)
        return comp, chunked, chunks, shape

    def _build_backward(self, q, k, v, dout, out) -> _BwdPlan:
        lay, branches, causal, scale, cfgs = self.lay, self.branches, self.causal, self.scale, self.cfgs
        bsz, nq, nh, d = q.shape
        hkv = k.shape[2]
        rep = nh // hkv
        b = _BwdPlan()
        q_all, kv_all = _bwd_writes_all(branches, nh, lay.covered, lay.qoff)
        b.q_fill, b.kv_fill = not q_all, not kv_all
        nrows = bsz * nq * nh
        br = 16 if INTERPRET else 64
        steps = []
        if nrows > 0:
            steps.append(_Launch(
                _DELTA, (_cdiv(nrows, br),), (0, 1, 2),
                (out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
                 dout.stride(2), nrows, nq, nh),
                dict(D=d, BR=br),
            ))  # fmt: skip
        b.delta = _Seq(steps)
        prec = _prec(q.dtype)
        qk_scale = scale * kern.LOG2E.value
        strides_in = (
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), self.skp, dout.stride(0), dout.stride(1),
            dout.stride(2),
        )  # fmt: skip

        def geom(w, r):  # longest block of the branch
            return max_block_length(lay.nk, w, r)

        # dK/dV: dk, dv zeros (k's shape, contiguous), their lo buffers one allocation
        kst = _contiguous_strides(k.shape)
        comp, chunked, chunks, b.kv_lo_shape = self._lo_ranges(k, self.several_kv)
        b.kv_comp, b.kv_chunked = comp, chunked
        lost = _contiguous_strides(b.kv_lo_shape)
        bm, bn = cfgs["dkdv"][:2]
        steps = []
        for c0, c1 in chunks:
            if comp and chunked:
                slob, lo_row0 = lost[0], c0
                if b.kv_fill:
                    steps.append(_zero_step(11))
            else:
                slob, lo_row0 = kst[0], 0
            for bi, (w, r, hs, he) in enumerate(branches):
                nnb = -(-geom(w, r) // bn)
                ni = min(rep, r)
                s0, fixed, per_doc = _axis0(lay, w, nnb, c0, c1, r, bn)
                grid = (fixed, lay.batch * hkv * ni)
                if (fixed + per_doc) * grid[1] == 0:
                    continue
                steps.append(_Launch(
                    _DKDV, grid, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13),
                    (*self.nd_arg, *strides_in, kst[0], kst[1], kst[2], kst[0], kst[1], kst[2],
                     slob, lo_row0, lay.nq_stride, lay.nk, lay.qoff, hs, he, nh, hkv, rep, ni, w,
                     r, s0, nnb, qk_scale, scale),
                    dict(D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=self.has_kpm, PREC=prec,
                         COMP=comp, STORE_LO=bi < len(branches) - 1, VARLEN=lay.varlen,
                         FIRST=kv_all and bi == 0, **_launch_kw(cfgs["dkdv"])),
                    per_doc=per_doc,
                ))  # fmt: skip
        b.dkdv = _Seq(steps)
        # dQ
        qst = _contiguous_strides(q.shape)
        comp, chunked, chunks, b.q_lo_shape = self._lo_ranges(q, self.several_q)
        b.q_comp, b.q_chunked = comp, chunked
        lost = _contiguous_strides(b.q_lo_shape)
        bm, bn = cfgs["dq"][:2]
        steps = []
        for c0, c1 in chunks:
            if comp and chunked:
                slob, lo_row0 = lost[0], c0 - lay.qoff
                if b.q_fill:
                    steps.append(_zero_step(8))
            else:
                slob, lo_row0 = qst[0], 0
            for bi, (w, r, hs, he) in enumerate(branches):
                nm = -(-geom(w, r) // bm)
                s0, fixed, per_doc = _axis0(lay, w, nm, c0, c1, r, bm)
                grid = (fixed, lay.batch * (he - hs))
                if (fixed + per_doc) * grid[1] == 0:
                    continue
                steps.append(_Launch(
                    _DQ, grid, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
                    (*self.nd_arg, *strides_in, qst[0], qst[1], qst[2], slob, lo_row0,
                     lay.nq_stride, lay.nk, lay.qoff, hs, he - hs, nh, rep, w, r, s0, nm,
                     qk_scale, scale),
                    dict(D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=self.has_kpm, PREC=prec,
                         COMP=comp, STORE_LO=bi < len(branches) - 1, VARLEN=lay.varlen,
                         FIRST=q_all and bi == 0, **_launch_kw(cfgs["dq"])),
                    per_doc=per_doc,
                ))  # fmt: skip
        b.dq = _Seq(steps)
        return b

    def backward(self, dout, q, k, v, kpm, out, lse, docs: Docs | None = None):
        """dq, dk, dv of one call (see :func:`backward`); the same buffers as
        :func:`backward_per_call` but for the one allocation holding dk's and dv's lo. On the
        plan's device whatever the current one (as :meth:`forward`)."""
        if self.gpu and direct_launch.current_device() != self.dev:
            with torch.cuda.device(self.dev):
                return self.backward(dout, q, k, v, kpm, out, lse, docs)
        dout = _broadcast_view(dout)
        out = _broadcast_view(out)
        bkey = (dout.shape, dout.stride(), out.shape, out.stride(), dout.dtype, out.dtype, lse.dtype)
        b = self._bwd.get(bkey)
        if b is None:
            b = self._bwd[bkey] = self._build_backward(q, k, v, dout, out)
        kp = q if kpm is None else kpm.contiguous().view(torch.uint8)
        cq, ck = (q, q) if docs is None else (docs.cu_q, docs.cu_k)
        nd = 1 if docs is None else docs.cu_q.shape[0] - 1
        dev = self.device
        stream = self._stream()
        delta = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        if b.delta.steps:
            self._run(b.delta, [out, dout, delta], stream)
        # all dK/dV first, then all dQ: one phase's lo buffers alive at a time; buffers that the
        # first branch's launches store completely (FIRST, _bwd_writes_all) are left unfilled
        new = torch.zeros_like if b.kv_fill else torch.empty_like
        dk = new(k, memory_format=_CONTIGUOUS)
        dv = new(v, memory_format=_CONTIGUOUS)
        if b.kv_comp:
            shape = (2, *b.kv_lo_shape)
            lo2 = (torch.zeros(shape, dtype=k.dtype, device=dev) if b.kv_fill and not b.kv_chunked
                   else torch.empty(shape, dtype=k.dtype, device=dev))  # fmt: skip
            self._run(b.dkdv, [q, k, v, kp, dout, lse, delta, dk, dv, lo2[0], lo2[1], lo2, cq, ck],
                      stream, nd)  # fmt: skip
            del lo2
        else:
            self._run(b.dkdv, [q, k, v, kp, dout, lse, delta, dk, dv, dk, dv, dk, cq, ck], stream, nd)
        dq = (torch.zeros_like if b.q_fill else torch.empty_like)(q, memory_format=_CONTIGUOUS)
        lq = dq
        if b.q_comp:
            lq = (torch.zeros_like(dq) if b.q_fill and not b.q_chunked
                  else torch.empty(b.q_lo_shape, dtype=q.dtype, device=dev))  # fmt: skip
        self._run(b.dq, [q, k, v, kp, dout, lse, delta, dq, lq, cq, ck], stream, nd)
        return dq, dk, dv

    # ------------------------------------------------------------------------------ launch
    def _stream(self):
        """The raw stream to launch on directly, or None for Triton's path (CPU, the switch off,
        a launch hook installed): checked once per call. The current device is the plan's
        (:meth:`forward` and :meth:`backward` made it so)."""
        if not self.gpu or not flags.direct_launch_enabled() or not direct_launch.hooks_idle():
            return None
        return direct_launch.current_stream(self.dev)

    @staticmethod
    def _run(seq: _Seq, table: list, stream, ndocs: int = 1) -> None:
        # ndocs: the call's documents (packed: per_doc steps launch grid[0] + per_doc * ndocs
        # programs on the first axis and take ndocs as NDOCS)
        if stream is not None and seq.direct:
            ptrs = [t.data_ptr() for t in table]
            misaligned = 0
            for p in ptrs:
                misaligned |= p
            if not misaligned & 15:  # the kept binaries assume 16-byte aligned pointers
                for st in seq.steps:
                    if st.kernel is None:
                        table[st.slot].zero_()
                    elif not st.per_doc:
                        st.go(stream, st.take(ptrs) + st.args)
                    elif ndocs:
                        st.go(st.grid[0] + st.per_doc * ndocs, st.grid[1], 1, stream,
                              (*st.take(ptrs), ndocs, *st.args))  # fmt: skip
                return
        for st in seq.steps:
            if st.kernel is None:
                table[st.slot].zero_()
            elif not st.per_doc:
                st.kernel[st.grid](*st.take(table), *st.tail, **st.opts)
            elif ndocs:
                st.kernel[st.grid_for(ndocs)](*st.take(table), ndocs, *st.tail, **st.opts)
        if seq.direct is None and stream is not None:
            _collect(seq, table, ndocs)


_PLANS: OrderedDict = OrderedDict()


def get_plan(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config=None, fold=None,
             lo_rows=None, docs: Docs | None = None) -> TrainPlan | None:  # fmt: skip
    """The plan of this configuration (built on a miss; the last ``_MAX_PLANS`` kept, the
    oldest built dropped first), or None where the per-call path runs it."""
    try:
        key = plan_key(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config, fold, lo_rows,
                       docs)  # fmt: skip
        plan = _PLANS.get(key, _PLANS)
    except TypeError:  # an unhashable entry (lists in head_ranges): normalise, once
        head_ranges = [tuple(x) for x in head_ranges]
        key = plan_key(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config, fold, lo_rows,
                       docs)  # fmt: skip
        plan = _PLANS.get(key, _PLANS)
    if plan is _PLANS:
        try:
            plan = TrainPlan(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config, fold,
                             lo_rows, docs)  # fmt: skip
        except _NoPlan:
            plan = None
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.popitem(last=False)
        _PLANS[key] = plan
    return plan


def forward(q, k, v, kpm, seg, dil, causal, scale, head_ranges, *, config=None, fold=None,
            docs: Docs | None = None, lo_rows: int | None = None, plan_sink: list | None = None):
    """out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) float32 of the branches given.

    q: (B, Nq, H, D), k, v: (B, Nk, Hkv, D), last dim contiguous; kpm: (B, Nk) bool or None;
    head_ranges: [(hs, he)] per branch. ``config``: {kernel: (BM, BN, warps, stages)} overrides
    (:func:`resolve_configs`). ``fold``: None folds the branches into one launch when
    :func:`fold_geometry` allows it, w_min / r_max fills the forward's BM rows
    (:func:`fold_fills_tile`) and the call is not causal (a folded tile's rows span a
    whole w_min window, so the causal diagonal crosses every key block: measured slower, see
    benchmarks/NOTES_triton.md); True folds whenever the geometry allows, causal too; False
    never (per-branch launches + merge).

    ``docs``: packed documents (:class:`Docs`); then B = 1, q is (1, total_q, H, D), k, v
    (1, total_k, Hkv, D), kpm None, and each document is its own sequence. Folding needs
    queries and keys to share the offsets (:meth:`Docs.same_offsets`).

    ``lo_rows``: rows per range of the per-branch launches when the output needs a lo buffer
    (:func:`lo_chunks`; None: the rule there). The result does not depend on it.

    Where the Gluon forward applies (no ``kpm``, ``docs`` or ``config``, ``fold`` not True,
    the switch on and :func:`gluon_fwd.problem` None: Hopper, bf16/fp16, D 64/128, w // r >= 2,
    the speed rules; its module docstring) the branches run through it (:func:`_gluon_forward`,
    no plan: ``plan_sink`` gets None); packed documents likewise through the Gluon varlen
    kernel where :func:`gluon_varlen.problem` is None (:func:`_gluon_varlen_forward`; its
    switch ``gluon_varlen.VARLEN_FORWARD``, on; head dim 128, documents of
    ``gluon_varlen.MIN_MEAN_DOC`` rows on average, or ``DEVICE_DESC_MIN_MEAN_DOC`` where a
    branch's r does not divide the stream's rows). Else runs through the configuration's :class:`TrainPlan` (``USE_PLANS`` False:
    :func:`forward_per_call`; the same bits). ``plan_sink``: a list that gets the plan
    used (None for the per-call path), for a caller that passes it to :func:`backward`.
    """
    if kpm is None and config is None and fold is not True:
        if docs is None:
            res = _gluon_forward(q, k, v, seg, dil, causal, scale, head_ranges, lo_rows)
        else:
            res = _gluon_varlen_forward(q, k, v, seg, dil, causal, scale, head_ranges, docs)
        if res is not None:
            if plan_sink is not None:
                plan_sink.append(None)  # the backward looks its plan up
            return res
    plan = None
    if USE_PLANS:
        plan = get_plan(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config, fold, lo_rows,
                        docs)  # fmt: skip
    if plan_sink is not None:
        plan_sink.append(plan)
    if plan is None:
        return forward_per_call(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config=config,
                                fold=fold, docs=docs, lo_rows=lo_rows)  # fmt: skip
    return plan.forward(q, k, v, kpm, docs)


def _gluon_forward(q, k, v, seg, dil, causal, scale, head_ranges, lo_rows):
    """:func:`forward` through the Gluon kernel (``gluon_fwd``), or None where it does not
    apply (the switch off, :func:`gluon_fwd.problem`) or its first launch of a configuration
    failed (then a warning, and the Triton kernels run it). The buffers, the lo ranges, the
    branch order and the FIRST / COMP / STORE_LO choices are :func:`forward_per_call`'s, so
    the merge is the same (hi, lo) arithmetic."""
    if not flags.gluon_forward_enabled():
        return None
    branches = branch_list(seg, dil, head_ranges)
    if gluon_fwd.problem(q, k, v, causal, branches) is not None:
        return None
    dev = direct_launch.tensor_device(q)
    if direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return _gluon_forward(q, k, v, seg, dil, causal, scale, head_ranges, lo_rows)
    bsz, n, nh, d = q.shape
    lay = _layout(q, k, None)
    several = _rows_with_several_branches(nh, k.shape[2], head_ranges)[0]
    # branch 0 is the first launch (its segments, then its short last one where N % w != 0:
    # gluon_fwd.TAIL_SEGMENTS); r == 1 over all heads stores every row of out, lse and lo: no fill
    fill = not _first_branch_writes_all(branches, 0, nh, True, 0)
    out, comp = _acc_buffers((bsz, n, nh, d), q.dtype, q.device, several, fill)
    chunks = lo_chunks(lay, branches, bsz * nh * d * q.element_size(), lo_rows) if comp else [(0, n)]
    acc_lo = _lo_buffer(out, comp, chunks, fill)
    if fill:
        lse = torch.full((bsz, nh, n), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty((bsz, nh, n), dtype=torch.float32, device=q.device)
    last = len(branches) - 1
    # batch > 1 with short last segments: each entry apart (gluon_fwd.TAIL_BATCHES)
    entries = gluon_fwd.batch_entries(bsz, n, branches)
    # the launches below: each after the first may start while the one before finishes
    # (gluon_fwd.PDL). Their inputs q, k, v were written before the first; what they share (out,
    # lse, lo) each touches only after its predecessor completed. The only other work between
    # them, _lo_range's zeroing of lo per range, is an ordinary launch: it waits for the launch
    # before it, and the launch after it waits for it.
    chain = gluon_fwd.chain(q)
    try:
        for c0, c1 in chunks:
            lo, _, row0 = _lo_range(acc_lo, out, c0, len(chunks) > 1, fill)
            for qe, ke, ve, oe, loe, lsee in gluon_fwd.entry_views(entries, q, k, v, out, lo, lse):
                for bi, (w, r, hs, he) in enumerate(branches):
                    gluon_fwd.launch_branch(
                        qe, ke, ve, oe, loe, lsee, w, r, hs, he, causal, scale, c0 // w, (c1 - c0) // w,
                        row0 // w, bi == 0, comp, bi < last, chain,
                    )  # fmt: skip
                    if c1 % w:  # the short last segment (only the last range ends at N)
                        gluon_fwd.launch_tail(qe, ke, ve, oe, loe, lsee, w, r, hs, he, causal, scale, row0,
                                              bi == 0, comp, bi < last, chain)  # fmt: skip
    except Exception as e:  # noqa: BLE001  (a compile / resource failure: the Triton path)
        gluon_fwd.note_failure(q, causal, e)
        return None
    return out, lse


def _gluon_varlen_forward(q, k, v, seg, dil, causal, scale, head_ranges, docs: Docs):
    """:func:`forward` of packed documents through the Gluon varlen kernel (``gluon_varlen``),
    or None where it does not apply (the Gluon forward's switch off, :func:`gluon_varlen.problem`)
    or its first launch of a configuration failed (then a warning, and the Triton varlen kernels
    run it). No host read of the offsets; the out and lse it returns are the Triton varlen
    backward's inputs as the Triton forward's are."""
    if not flags.gluon_forward_enabled():
        return None
    branches = branch_list(seg, dil, head_ranges)
    ndocs = docs.cu_q.shape[0] - 1
    covered = bool(docs.checked)  # every row in a document: the host-descriptor kernels may read any row
    if gluon_varlen.problem(q, k, v, causal, branches, docs.same_offsets(), docs.max_q, ndocs,
                            covered=covered) is not None:  # fmt: skip
        return None
    # the first branch stores every row of every document: no fill over checked offsets; over
    # unchecked ones a fill of the rows no document covers (gluon_varlen.FILL_UNCOVERED_ONLY) or of all
    docs_all = _first_branch_writes_all(branches, 0, q.shape[2], True, 0)
    uncovered_only = docs_all and not covered and gluon_varlen.FILL_UNCOVERED_ONLY
    fill = not (docs_all and covered) and not uncovered_only
    return _gluon_attempt(q, causal, gluon_varlen.note_failure, None, lambda: gluon_varlen.forward(
        q, k, v, docs.cu_q, docs.max_q, branches, causal, scale, fill, covered=covered,
        fill_uncovered_rows=uncovered_only))  # fmt: skip


def _gluon_attempt(q, causal: bool, note_failure, note_oom, run):
    """``run()`` on q's device (the device guard, direct_launch.py), or None where it failed: a
    compile / resource failure is recorded by ``note_failure`` (a warning once; that
    configuration runs the Triton kernels from then on); out of memory gives None for this call
    only where ``note_oom`` takes it (the Gluon backwards' float32 accumulators: the Triton
    backward needs less), else it propagates as the Triton path's would."""
    dev = direct_launch.tensor_device(q)
    if direct_launch.current_device() != dev:
        with torch.cuda.device(dev):
            return _gluon_attempt(q, causal, note_failure, note_oom, run)
    try:
        return run()
    except torch.cuda.OutOfMemoryError:
        if note_oom is None:
            raise
        note_oom(q)
        return None
    except Exception as e:  # noqa: BLE001  (a compile / resource failure: the Triton path)
        note_failure(q, causal, e)
        return None


def gluon_backward(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges):
    """:func:`backward` through the Gluon kernels (``gluon_bwd``), or None where they do not
    apply (the switch off, a mask, :func:`gluon_bwd.problem`, dO of another dtype) or their first
    launch of a configuration failed (then a warning, and the Triton backward runs it). Out of
    memory (their three float32 accumulators: ~1.5x the Triton backward's peak) gives None for
    this call only: the Triton backward, which needs less, runs it (a warning, once)."""
    if kpm is not None or not flags.gluon_backward_enabled() or dout.dtype != q.dtype:
        return None
    branches = branch_list(seg, dil, head_ranges)
    if gluon_bwd.problem(q, k, v, causal, branches, q.shape[2]) is not None:
        return None

    def run():
        delta = _delta(_broadcast_view(out), _broadcast_view(dout))
        return gluon_bwd.backward(dout, q, k, v, delta, lse, branches, causal, scale)

    return _gluon_attempt(q, causal, gluon_bwd.note_failure, gluon_bwd.note_out_of_memory, run)


def _gluon_varlen_backward(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges, docs: Docs):
    """:func:`backward` of packed documents through the Gluon varlen kernels (``gluon_varlen``),
    or None where they do not apply (the backward switch or ``gluon_varlen.VARLEN_BACKWARD``
    off, a mask, dO of another dtype, :func:`gluon_varlen.backward_problem`), their float32
    accumulators did not fit (this call only), or their first launch of a configuration failed
    (then a warning): the Triton varlen backward runs it. No host read of the offsets."""
    if kpm is not None or not flags.gluon_backward_enabled() or dout.dtype != q.dtype:
        return None
    branches = branch_list(seg, dil, head_ranges)
    ndocs = docs.cu_q.shape[0] - 1
    covered = bool(docs.checked)
    if gluon_varlen.backward_problem(q, k, v, causal, branches, docs.same_offsets(), docs.max_q, ndocs,
                                     covered=covered) is not None:  # fmt: skip
        return None
    # same offsets for queries and keys (the gate): qoff 0, so dq and dk/dv alike
    # as the forward: unchecked offsets store too where only the uncovered rows are zeroed
    docs_all = all(_bwd_writes_all(branches, q.shape[2], True, 0))
    uncovered_only = docs_all and not covered and gluon_varlen.FILL_UNCOVERED_ONLY
    store_first = (docs_all and covered) or uncovered_only

    def run():
        delta = _delta(_broadcast_view(out), _broadcast_view(dout))
        return gluon_varlen.backward(dout, q, k, v, delta, lse, docs.cu_q, docs.max_q, branches, causal, scale,
                                     store_first, covered=covered, fill_uncovered_rows=uncovered_only)  # fmt: skip

    return _gluon_attempt(q, causal, gluon_varlen.note_backward_failure, gluon_bwd.note_out_of_memory, run)


def backward(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges, *, config=None,
             docs: Docs | None = None, lo_rows: int | None = None, plan: TrainPlan | None = None):
    """dq, dk, dv (input dtypes) of the branches given, with the FINAL out and lse (which may
    include branches not given here: every branch's share is independent).

    Shapes as :func:`forward`; lse (B, H, Nq) float32 contiguous; dout and out need a unit
    stride along headdim only (a broadcast dout, e.g. from ``out.sum()``, is read in place).
    ``config``, ``docs`` and ``lo_rows`` as there. ``plan``: the forward's plan (from its
    ``plan_sink``) for these very q, k, v, kpm and arguments: skips the lookup.

    Memory (benchmarks/NOTES_triton.md, "Memory at 2M tokens"): besides the inputs, out, dout
    and lse, the results dk, dv, dq (zeros, or empty where :func:`_bwd_writes_all` says the
    first branch stores all of them; each written in place), delta (one float32 per
    query row and head) and the lo buffers of one phase, each 1/LO_CHUNKS of a result at long N.

    Where the Gluon backward applies (no ``config``, ``docs`` or ``kpm``, the switch on:
    :func:`gluon_backward`) it runs instead; packed documents likewise through the Gluon varlen
    kernels where :func:`gluon_varlen.backward_problem` is None (:func:`_gluon_varlen_backward`;
    its switch ``gluon_varlen.VARLEN_BACKWARD``, on by default).
    """
    if config is None:
        if docs is None:
            res = gluon_backward(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges)
        else:
            res = _gluon_varlen_backward(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges, docs)
        if res is not None:
            return res
    if USE_PLANS:
        if (plan is None or plan.config_key != _config_key(config) or plan.lo_rows != lo_rows
                or plan.varlen != (docs is not None)
                or plan.lay.covered != (docs is None or bool(docs.checked))):  # fmt: skip
            plan = get_plan(q, k, v, kpm, seg, dil, causal, scale, head_ranges, config, None, lo_rows,
                            docs)  # fmt: skip
        if plan is not None:
            return plan.backward(dout, q, k, v, kpm, out, lse, docs)
    return backward_per_call(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges,
                             config=config, docs=docs, lo_rows=lo_rows)  # fmt: skip
