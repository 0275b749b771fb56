"""Launching the Triton kernels: block configs, grids, accumulator buffers, the fold decision.

:func:`forward` and :func:`backward` take validated, last-dim-contiguous tensors and return
plain tensors (no autograd); ``triton_ops.py`` wraps them in the custom ops, the only entry
point other code should use. Tuning knobs are keyword arguments (``config=``, ``fold=``) for
``benchmarks/tune_triton.py``; nothing here reads the environment at call time.

Accumulation across branches. A result row that more than one branch adds into is, in fp16 and
bf16, accumulated as a compensated pair (hi, lo) of the result dtype: hi is the result buffer
itself (at every step the correctly rounded partial sum, so no final cast and no float32 copy)
and lo the rounding residue (error per branch <= ~2^-17 relative for bf16, far below the final
rounding). The forward's (out, lse) merge uses the same pair. float32 inputs accumulate in
float32 directly; a row with a single contribution is written once in the result dtype. All
dK/dV launches run before all dQ launches, so only one phase's lo buffers are alive at a time.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..geometry import max_block_length, query_segments
from .constants import int32_table
from . import triton_kernels as kern

# Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton_kernels was
# imported, the CPU then) or compiled (CUDA): triton.jit fixed it for the life of the process.
INTERPRET: bool = not isinstance(kern.dilated_fwd_kernel, triton.runtime.JITFunction)

Config = tuple[int, int, int, int]  # (BM, BN, num_warps, num_stages) of one kernel
KERNELS = ("fwd", "dkdv", "dq")


def default_configs(d: int, interpret: bool = INTERPRET) -> dict[str, Config]:
    """Block sizes and launch parameters per kernel (fixed; tuned on an H100 for D = 64 / 128
    with benchmarks/tune_triton.py, results in benchmarks/results/tune_triton_*.md).

    fwd and dq need BM % BN == 0 (the causal mask-free stage ends at the block's first row),
    dkdv BN % BM == 0 (its causal diagonal stage counts whole query blocks).
    """
    if interpret:
        # small blocks with BM != BN where the kernels allow it: several causal-diagonal query
        # blocks per key block (dkdv) and several mask-free key blocks before the diagonal
        # (dq, fwd) at test sizes
        return dict(fwd=(32, 16, 1, 1), dkdv=(16, 32, 1, 1), dq=(32, 16, 1, 1))
    if d <= 64:
        return dict(fwd=(128, 64, 4, 3), dkdv=(32, 128, 4, 3), dq=(128, 32, 4, 3))
    return dict(fwd=(128, 64, 8, 3), dkdv=(64, 64, 4, 2), dq=(128, 64, 8, 3))


def resolve_configs(d: int, config: dict[str, Config] | None = None) -> dict[str, Config]:
    """The default configs with the kernels named in ``config`` replaced, checked."""
    cfg = default_configs(d)
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


def _acc_buffers(shape, dtype, device, several: bool):
    """(hi, lo or None) for a result that ``several`` branches may add into: hi (zeros) in the
    result dtype is the result itself; lo (zeros, same dtype) holds the rounding residues when
    rows get several contributions in a dtype narrower than float32."""
    hi = torch.zeros(shape, dtype=dtype, device=device)
    if not several or dtype == torch.float32:
        return hi, None
    return hi, torch.zeros_like(hi)


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


@functools.lru_cache(maxsize=64)
def _branch_table(branches: tuple, device: torch.device) -> torch.Tensor:
    """(w, r, head start, head stop) per branch as an int32 device tensor, built once per
    (branches, device) outside any CUDA-graph pool (see ``constants.py``)."""
    return int32_table([list(b) for b in branches], device)


def _fwd_folded(q, k, v, kpm, causal, scale, branches, wmin, rmax, cfg):
    bsz, n, nh, d = q.shape
    bm, bn = cfg[:2]
    out = torch.empty_like(q)
    lse = torch.empty(bsz, nh, n, dtype=torch.float32, device=q.device)
    brs = _branch_table(tuple(branches), q.device)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    nt = triton.cdiv(wmin // rmax, bm)
    grid = (nt * rmax * triton.cdiv(n, wmin), bsz * nh)
    kern.dilated_fwd_folded_kernel[grid](
        q, k, v, kp, out, lse, brs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), skp,
        out.stride(0), out.stride(1), out.stride(2),
        n, nh, nh // k.shape[2], len(branches), wmin, rmax, nt,
        scale * kern.LOG2E.value,
        D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=_prec(q.dtype),
        **_launch_kw(cfg),
    )
    return out, lse


def forward(q, k, v, kpm, seg, dil, causal, scale, head_ranges, *, config=None, fold=None):
    """out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) float32 of the branches given.

    q: (B, Nq, H, D), k, v: (B, Nk, Hkv, D), last dim contiguous; kpm: (B, Nk) bool or None;
    head_ranges: [(hs, he)] per branch. ``config``: {kernel: (BM, BN, warps, stages)} overrides
    (:func:`resolve_configs`). ``fold``: None folds the branches into one launch when
    :func:`fold_geometry` allows it and the call is not causal (a folded tile's rows span a
    whole w_min window, so the causal diagonal crosses every key block: measured slower, see
    benchmarks/NOTES_triton.md); True folds whenever the geometry allows, causal too; False
    never (per-branch launches + merge).
    """
    bsz, nq, nh, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    cfg = resolve_configs(d, config)["fwd"]
    branches = branch_list(seg, dil, head_ranges)
    geo = None if fold is False or (fold is None and causal) else fold_geometry(nq, nk, branches)
    if geo is not None:
        return _fwd_folded(q, k, v, kpm, causal, scale, branches, *geo, cfg)
    bm, bn = cfg[:2]
    several = _rows_with_several_branches(nh, hkv, head_ranges)[0]
    acc_o, acc_lo = _acc_buffers((bsz, nq, nh, d), q.dtype, q.device, several)
    acc_l = torch.full((bsz, nh, nq), float("-inf"), dtype=torch.float32, device=q.device)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    qoff = nk - nq
    for bi, (w, r, hs, he) in enumerate(branches):
        s0, nseg = query_segments(nq, nk, w)
        nm = triton.cdiv(max_block_length(nk, w, r), bm)
        grid = (nm * nseg, bsz * (he - hs))
        kern.dilated_fwd_kernel[grid](
            q, k, v, kp, acc_o, acc_o if acc_lo is None else acc_lo, acc_l,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), skp,
            acc_o.stride(0), acc_o.stride(1), acc_o.stride(2),
            nq, nk, qoff, hs, he - hs, nh, nh // hkv, w, r, s0, nm,
            scale * kern.LOG2E.value,
            D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, FIRST=bi == 0, PREC=_prec(q.dtype),
            COMP=acc_lo is not None, STORE_LO=bi < len(branches) - 1,
            **_launch_kw(cfg),
        )
    return acc_o, acc_l


def backward(dout, q, k, v, kpm, out, lse, seg, dil, causal, scale, head_ranges, *, config=None):
    """dq, dk, dv (input dtypes) of the branches given, with the FINAL out and lse (which may
    include branches not given here: every branch's share is independent).

    Shapes as :func:`forward`; lse (B, H, Nq) float32 contiguous. ``config`` as there.
    """
    bsz, nq, nh, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    rep = nh // hkv
    cfgs = resolve_configs(d, config)
    dout = dout.contiguous()
    out = out.contiguous()
    delta = torch.empty(bsz, nh, nq, dtype=torch.float32, device=q.device)
    nrows = bsz * nq * nh
    br = 16 if INTERPRET else 64
    kern.dilated_bwd_delta_kernel[(triton.cdiv(nrows, br),)](
        out, dout, delta, nrows, nq, nh, D=d, BR=br
    )
    several_q, several_kv = _rows_with_several_branches(nh, hkv, head_ranges)
    kp, skp, has_kpm = _kpm_arg(kpm, q)
    qoff = nk - nq
    prec = _prec(q.dtype)
    qk_scale = scale * kern.LOG2E.value
    strides_in = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), skp, dout.stride(0), dout.stride(1), dout.stride(2),
    )
    branches = branch_list(seg, dil, head_ranges)

    def geom(w, r):  # first segment with a query, number of such segments, longest block
        return (*query_segments(nq, nk, w), max_block_length(nk, w, r))

    # all dK/dV first, then all dQ, so that at most one phase's lo buffers are alive (peak: the
    # inputs, out, dout, lse, delta, the results and 2 lo buffers, each the size of a result)
    dk, dk_lo = _acc_buffers(k.shape, k.dtype, q.device, several_kv)
    dv, dv_lo = _acc_buffers(v.shape, v.dtype, q.device, several_kv)
    bm, bn = cfgs["dkdv"][:2]
    for bi, (w, r, hs, he) in enumerate(branches):
        s0, nseg, lmax = geom(w, r)
        nnb = -(-lmax // bn)
        ni = min(rep, r)
        kern.dilated_bwd_dkdv_kernel[(nnb * nseg, bsz * hkv * ni)](
            q, k, v, kp, dout, lse, delta, dk, dv,
            dk if dk_lo is None else dk_lo, dv if dv_lo is None else dv_lo, *strides_in,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            nq, nk, qoff, hs, he, nh, hkv, rep, ni, w, r, s0, nnb,
            qk_scale, scale,
            D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=prec,
            COMP=dk_lo is not None, STORE_LO=bi < len(branches) - 1,
            **_launch_kw(cfgs["dkdv"]),
        )
    del dk_lo, dv_lo
    dq, dq_lo = _acc_buffers(q.shape, q.dtype, q.device, several_q)
    bm, bn = cfgs["dq"][:2]
    for bi, (w, r, hs, he) in enumerate(branches):
        s0, nseg, lmax = geom(w, r)
        nm = -(-lmax // bm)
        kern.dilated_bwd_dq_kernel[(nm * nseg, bsz * (he - hs))](
            q, k, v, kp, dout, lse, delta, dq, dq if dq_lo is None else dq_lo, *strides_in,
            dq.stride(0), dq.stride(1), dq.stride(2),
            nq, nk, qoff, hs, he - hs, nh, rep, w, r, s0, nm,
            qk_scale, scale,
            D=d, BM=bm, BN=bn, CAUSAL=causal, HAS_KPM=has_kpm, PREC=prec,
            COMP=dq_lo is not None, STORE_LO=bi < len(branches) - 1,
            **_launch_kw(cfgs["dq"]),
        )
    return dq, dk, dv
