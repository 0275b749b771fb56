"""The single-device ``impl="auto"`` rule as a pure function of the call's shape.

:func:`choose_impl` answers "torch" or "triton" for a :class:`CallShape` (batch, lengths, heads,
head dim, dtype, branches, causal, whether gradients are needed, dropout) without touching a
tensor or the GPU, so it can be unit-tested and audited. The caller says whether the Triton
kernel can run at all (``triton_ok``: ``triton_unavailable_reason(q, k) is None``).

The rule:

1. ``dropout_p > 0`` or the Triton kernel cannot run -> "torch" (the kernel has no dropout;
   unsupported head dims, dtypes and devices never reach it).
2. Otherwise look the call up in :data:`MEASURED`, the timings of benchmarks/sweep.py (every
   available impl of one row timed in the same run): among the measured rows with the same
   ``causal`` and ``requires_grad`` (a forward-only call is judged by forward time, a training
   call by forward+backward time), take the row nearest to the call in the feature space of
   :func:`features` and return the impl that was fastest there.
3. No measured row of that kind -> "triton" (the fused kernel; it was faster than the torch path
   on the shape it was tuned for).

The features are the quantities the two implementations' speeds depend on (see
benchmarks/NOTES_triton.md): the largest dilation rate (the torch path's per-offset strided
blocks get smaller and the Triton launches more numerous as r grows), the number of branches
(launches and merges per call), the fewest keys per query of any branch (short blocks leave
the fused kernel's tiles idle), whether every w is divisible by its r (the folded forward and
the torch path's strided views need it), whether the branches fold into one Triton launch,
the GQA ratio, the head dim and the total work (log of useful FLOPs). The distance weights are
in :data:`WEIGHTS`. ``benchmarks/sweep.py --rule-report RESULTS.json`` prints, per sweep row,
the impl this rule picks (also leave-one-out: with that row removed from the table) and
whether it is within 5% of the fastest, and ``--emit-table`` prints :data:`MEASURED` from a
sweep's JSON.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class CallShape(NamedTuple):
    """What the rule looks at: shapes and options of one call (no tensors)."""

    batch: int
    seqlen: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str  # "bf16", "fp16", "fp32", "fp64"
    branches: tuple[tuple[int, int], ...]  # ((w, r), ...)
    causal: bool
    requires_grad: bool
    dropout_p: float = 0.0


class Measured(NamedTuple):
    """One sweep row: the call and the milliseconds of each impl (forward only when
    ``shape.requires_grad`` is False, forward+backward when True)."""

    shape: CallShape
    ms: tuple[tuple[str, float], ...]  # (("torch", 12.3), ("triton", 10.1))


# ----------------------------------------------------------------------------------------
# MEASURED: filled from a benchmarks/sweep.py results JSON (``--emit-table``); every entry is
# one row of a committed results file. Source: benchmarks/results/sweep_h200_2026-11-29_s26_part1
# and _part2 (all 23 rows of the sweep, each forward-only and forward+backward, one run each, on
# one H200: torch 2.11, triton 3.6, the Gluon kernels on as shipped on Hopper). The fused kernel was
# the fastest impl on every row (``--rule-report``: 46 of 46 within 5%, leave-one-out too). The
# H100 table it replaces (sweep_h100_2026-11-25, before the Gluon kernels) had torch fastest on one
# row, 3br-w64k; with the Gluon kernels the fused kernel wins there too (10.11 vs 11.77 ms forward,
# 43.07 vs 49.08 fwd+bwd). On GPUs without the Gluon kernels (not sm_90) that row's neighbourhood
# may still favour torch: not measured there.
# ----------------------------------------------------------------------------------------
MEASURED: tuple[Measured, ...] = (
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, False, 0.0), (('torch', 13.368), ('triton', 7.43))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, True, 0.0), (('torch', 50.213), ('triton', 33.741))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 10.927), ('triton', 4.923))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 40.554), ('triton', 20.656))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 27.462), ('triton', 9.95))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 93.51), ('triton', 39.09))),
    Measured(CallShape(8, 16384, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, False, 0.0), (('torch', 9.76), ('triton', 4.963))),
    Measured(CallShape(8, 16384, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, True, 0.0), (('torch', 37.8), ('triton', 19.575))),
    Measured(CallShape(2, 65536, 16, 16, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64)), False, False, 0.0), (('torch', 13.325), ('triton', 4.835))),
    Measured(CallShape(2, 65536, 16, 16, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64)), False, True, 0.0), (('torch', 47.552), ('triton', 19.951))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((4096, 1), (16384, 4), (65536, 16)), False, False, 0.0), (('torch', 11.766), ('triton', 10.105))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((4096, 1), (16384, 4), (65536, 16)), False, True, 0.0), (('torch', 49.079), ('triton', 43.067))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), False, False, 0.0), (('torch', 17.766), ('triton', 8.109))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), False, True, 0.0), (('torch', 62.977), ('triton', 40.372))),
    Measured(CallShape(2, 65536, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), True, False, 0.0), (('torch', 31.893), ('triton', 10.478))),
    Measured(CallShape(2, 65536, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), True, True, 0.0), (('torch', 109.081), ('triton', 45.337))),
    Measured(CallShape(1, 100000, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 8.48), ('triton', 4.223))),
    Measured(CallShape(1, 100000, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 31.197), ('triton', 16.02))),
    Measured(CallShape(8, 16384, 16, 1, 64, 'bf16', ((2048, 1), (4096, 2), (8192, 4)), False, False, 0.0), (('torch', 9.013), ('triton', 5.188))),
    Measured(CallShape(8, 16384, 16, 1, 64, 'bf16', ((2048, 1), (4096, 2), (8192, 4)), False, True, 0.0), (('torch', 30.18), ('triton', 18.558))),
    Measured(CallShape(4, 32768, 16, 8, 64, 'fp16', ((4096, 1), (8192, 3), (16384, 6), (32768, 12)), True, False, 0.0), (('torch', 10.008), ('triton', 5.188))),
    Measured(CallShape(4, 32768, 16, 8, 64, 'fp16', ((4096, 1), (8192, 3), (16384, 6), (32768, 12)), True, True, 0.0), (('torch', 34.654), ('triton', 18.085))),
    Measured(CallShape(1, 262144, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16), (65536, 32)), False, False, 0.0), (('torch', 27.885), ('triton', 16.598))),
    Measured(CallShape(1, 262144, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16), (65536, 32)), False, True, 0.0), (('torch', 104.353), ('triton', 70.934))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64), (131072, 64)), False, False, 0.0), (('torch', 28.207), ('triton', 9.177))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64), (131072, 64)), False, True, 0.0), (('torch', 97.144), ('triton', 40.221))),
    Measured(CallShape(2, 65536, 16, 16, 64, 'fp16', ((512, 1), (1024, 1), (2048, 2), (4096, 4), (8192, 6), (16384, 12), (32768, 24), (65536, 48)), True, False, 0.0), (('torch', 12.02), ('triton', 3.848))),
    Measured(CallShape(2, 65536, 16, 16, 64, 'fp16', ((512, 1), (1024, 1), (2048, 2), (4096, 4), (8192, 6), (16384, 12), (32768, 24), (65536, 48)), True, True, 0.0), (('torch', 39.197), ('triton', 15.348))),
    Measured(CallShape(1, 65536, 16, 16, 128, 'bf16', ((3000, 1), (6000, 3), (12500, 6), (25000, 12), (50000, 64)), False, False, 0.0), (('torch', 18.089), ('triton', 4.628))),
    Measured(CallShape(1, 65536, 16, 16, 128, 'bf16', ((3000, 1), (6000, 3), (12500, 6), (25000, 12), (50000, 64)), False, True, 0.0), (('torch', 47.145), ('triton', 19.932))),
    Measured(CallShape(8, 16384, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), False, False, 0.0), (('torch', 33.115), ('triton', 14.321))),
    Measured(CallShape(8, 16384, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), False, True, 0.0), (('torch', 121.806), ('triton', 64.858))),
    Measured(CallShape(4, 32768, 32, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, False, 0.0), (('torch', 26.892), ('triton', 9.485))),
    Measured(CallShape(4, 32768, 32, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, True, 0.0), (('torch', 96.314), ('triton', 39.839))),
    Measured(CallShape(2, 131072, 16, 8, 64, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, False, 0.0), (('torch', 23.886), ('triton', 11.428))),
    Measured(CallShape(2, 131072, 16, 8, 64, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, True, 0.0), (('torch', 81.626), ('triton', 44.652))),
    Measured(CallShape(1, 196608, 32, 1, 128, 'bf16', ((8192, 1), (32768, 6), (131072, 12)), True, False, 0.0), (('torch', 61.154), ('triton', 25.562))),
    Measured(CallShape(1, 196608, 32, 1, 128, 'bf16', ((8192, 1), (32768, 6), (131072, 12)), True, True, 0.0), (('torch', 214.033), ('triton', 122.774))),
    Measured(CallShape(2, 49152, 16, 16, 128, 'bf16', ((2048, 1), (6144, 4), (12288, 6), (24576, 12)), False, False, 0.0), (('torch', 10.374), ('triton', 4.368))),
    Measured(CallShape(2, 49152, 16, 16, 128, 'bf16', ((2048, 1), (6144, 4), (12288, 6), (24576, 12)), False, True, 0.0), (('torch', 36.936), ('triton', 18.099))),
    Measured(CallShape(4, 24576, 16, 4, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, False, 0.0), (('torch', 9.587), ('triton', 4.145))),
    Measured(CallShape(4, 24576, 16, 4, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, True, 0.0), (('torch', 33.124), ('triton', 15.612))),
    Measured(CallShape(1, 524288, 16, 1, 64, 'bf16', ((4096, 1), (8192, 2), (16384, 4), (32768, 8), (65536, 16)), True, False, 0.0), (('torch', 44.156), ('triton', 25.063))),
    Measured(CallShape(1, 524288, 16, 1, 64, 'bf16', ((4096, 1), (8192, 2), (16384, 4), (32768, 8), (65536, 16)), True, True, 0.0), (('torch', 149.137), ('triton', 88.143))),
    Measured(CallShape(1, 1048576, 16, 1, 64, 'bf16', ((8192, 1), (16384, 2), (32768, 4), (65536, 8), (131072, 16)), True, False, 0.0), (('torch', 142.284), ('triton', 89.532))),
    Measured(CallShape(1, 1048576, 16, 1, 64, 'bf16', ((8192, 1), (16384, 2), (32768, 4), (65536, 8), (131072, 16)), True, True, 0.0), (('torch', 499.24), ('triton', 334.973))),
)

# distance weight per feature of :func:`features` (same order); a difference of 1 in a
# weighted feature counts as much as a doubling of the largest dilation rate
WEIGHTS: tuple[float, ...] = (1.0, 0.5, 1.0, 2.0, 2.0, 0.5, 0.5, 0.25)

_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                "torch.float64": "fp64"}


def dtype_name(dtype) -> str:
    """"bf16" / "fp16" / "fp32" / "fp64" for a torch dtype or one of those names."""
    s = str(dtype)
    return _DTYPE_NAMES.get(s, s)


def foldable(branches) -> bool:
    """The Triton forward folds all branches into one launch (several branches, every r
    dividing r_max, every w a multiple of w_min, r_max dividing w_min; not causal)."""
    if len(branches) < 2:
        return False
    wmin = min(w for w, _ in branches)
    rmax = max(r for _, r in branches)
    return wmin % rmax == 0 and all(rmax % r == 0 and w % wmin == 0 for w, r in branches)


def features(c: CallShape) -> tuple[float, ...]:
    """(log2 r_max, branches, log2 min keys per query, all w % r == 0, foldable and not causal,
    log2 GQA ratio, headdim / 64, log10 of the useful pairs)."""
    br = c.branches
    n = c.seqlen
    rmax = max(r for _, r in br)
    keys = min(-(-min(w, n) // r) for w, r in br)
    # pairs attended per head, all branches (not causal; causal halves every row alike)
    pairs = sum(n * -(-min(w, n) // r) for w, r in br) * c.batch * c.nheads
    return (
        math.log2(rmax),
        float(len(br)),
        math.log2(max(keys, 1)),
        float(all(w % r == 0 for w, r in br)),
        float(foldable(br) and not c.causal),
        math.log2(c.nheads / c.nheads_kv),
        c.headdim / 64,
        math.log10(max(pairs, 1)),
    )


def distance(a: CallShape, b: CallShape) -> float:
    fa, fb = features(a), features(b)
    return sum(w * abs(x - y) for w, x, y in zip(WEIGHTS, fa, fb, strict=True))


def fastest(m: Measured, allowed=("torch", "triton")) -> str | None:
    times = [(ms, impl) for impl, ms in m.ms if impl in allowed and ms is not None and ms > 0]
    return min(times)[1] if times else None


def choose_impl(c: CallShape, triton_ok: bool = True, table: tuple[Measured, ...] | None = None) -> str:
    """"torch" or "triton" for a call of shape ``c`` under ``impl="auto"`` (module docstring).

    ``triton_ok``: the Triton kernel can run these inputs (device, dtype, head dim). ``table``:
    the measurements to decide by (default :data:`MEASURED`).
    """
    if c.dropout_p > 0 or not triton_ok:
        return "torch"
    rows = [m for m in (MEASURED if table is None else table)
            if m.shape.causal == c.causal and m.shape.requires_grad == c.requires_grad
            and fastest(m) is not None]
    if not rows:
        return "triton"
    # nearest row; ties go to the earlier row of the table (deterministic)
    best = min(range(len(rows)), key=lambda i: (distance(c, rows[i].shape), i))
    return fastest(rows[best])
