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
# one row of a committed results file, timed on one H100 (torch 2.11, triton 3.6). Source:
# benchmarks/results/sweep_h100_2026-11-25_all.json: all 22 rows of the sweep, each forward-only
# and forward+backward, from sweep_h100_2026-11-25_part1/part2 (one run each), with the three
# rows whose forward the fold rule of 2026-11-25 changed (b2-64k-7br-r64, 8br-wN-32x8, 256k-6br)
# taken from sweep_h100_2026-11-25_refold (re-measured after that change). Except 3br-w64k,
# the one row where torch was fastest: the Gluon kernels (on by default on Hopper since
# 2026-11-28) made the fused kernel faster there, 10.42 vs 11.93 ms forward and 42.75 vs 48.11
# fwd+bwd on an H200 (sweep_h200_2026-11-28_gluon_part1); the old H100 entries timed kernels
# that no longer run at that shape on Hopper. To regenerate from an H100 sweep with the Gluon
# kernels (issue 24). In that H200 sweep the fused kernel was the fastest on all 21 rows timed.
# ----------------------------------------------------------------------------------------
MEASURED: tuple[Measured, ...] = (
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, False, 0.0), (('torch', 15.454), ('triton', 10.887))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, True, 0.0), (('torch', 52.538), ('triton', 48.774))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 17.55), ('triton', 7.374))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 44.248), ('triton', 31.418))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 28.756), ('triton', 14.082))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 97.332), ('triton', 57.962))),
    Measured(CallShape(8, 16384, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, False, 0.0), (('torch', 10.38), ('triton', 7.025))),
    Measured(CallShape(8, 16384, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, True, 0.0), (('torch', 37.852), ('triton', 30.114))),
    Measured(CallShape(2, 65536, 16, 16, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64)), False, False, 0.0), (('torch', 13.885), ('triton', 6.966))),
    Measured(CallShape(2, 65536, 16, 16, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64)), False, True, 0.0), (('torch', 47.175), ('triton', 29.979))),
    # 3br-w64k: from sweep_h200_2026-11-28_gluon_part1 (H200, the Gluon kernels on; see above)
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((4096, 1), (16384, 4), (65536, 16)), False, False, 0.0), (('torch', 11.93), ('triton', 10.42))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((4096, 1), (16384, 4), (65536, 16)), False, True, 0.0), (('torch', 48.11), ('triton', 42.75))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), False, False, 0.0), (('torch', 25.721), ('triton', 11.702))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), False, True, 0.0), (('torch', 72.174), ('triton', 53.005))),
    Measured(CallShape(2, 65536, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), True, False, 0.0), (('torch', 33.252), ('triton', 15.153))),
    Measured(CallShape(2, 65536, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), True, True, 0.0), (('torch', 113.105), ('triton', 63.663))),
    Measured(CallShape(1, 100000, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 13.195), ('triton', 5.816))),
    Measured(CallShape(1, 100000, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 37.484), ('triton', 24.534))),
    Measured(CallShape(8, 16384, 16, 1, 64, 'bf16', ((2048, 1), (4096, 2), (8192, 4)), False, False, 0.0), (('torch', 9.167), ('triton', 5.838))),
    Measured(CallShape(8, 16384, 16, 1, 64, 'bf16', ((2048, 1), (4096, 2), (8192, 4)), False, True, 0.0), (('torch', 30.687), ('triton', 23.095))),
    Measured(CallShape(4, 32768, 16, 8, 64, 'fp16', ((4096, 1), (8192, 3), (16384, 6), (32768, 12)), True, False, 0.0), (('torch', 10.487), ('triton', 5.301))),
    Measured(CallShape(4, 32768, 16, 8, 64, 'fp16', ((4096, 1), (8192, 3), (16384, 6), (32768, 12)), True, True, 0.0), (('torch', 35.417), ('triton', 20.96))),
    Measured(CallShape(1, 262144, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16), (65536, 32)), False, False, 0.0), (('torch', 55.578), ('triton', 21.759))),
    Measured(CallShape(1, 262144, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16), (65536, 32)), False, True, 0.0), (('torch', 103.614), ('triton', 98.179))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64), (131072, 64)), False, False, 0.0), (('torch', 29.373), ('triton', 13.747))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64), (131072, 64)), False, True, 0.0), (('torch', 100.704), ('triton', 55.754))),
    Measured(CallShape(2, 65536, 16, 16, 64, 'fp16', ((512, 1), (1024, 1), (2048, 2), (4096, 4), (8192, 6), (16384, 12), (32768, 24), (65536, 48)), True, False, 0.0), (('torch', 21.428), ('triton', 4.321))),
    Measured(CallShape(2, 65536, 16, 16, 64, 'fp16', ((512, 1), (1024, 1), (2048, 2), (4096, 4), (8192, 6), (16384, 12), (32768, 24), (65536, 48)), True, True, 0.0), (('torch', 49.611), ('triton', 16.979))),
    Measured(CallShape(1, 65536, 16, 16, 128, 'bf16', ((3000, 1), (6000, 3), (12500, 6), (25000, 12), (50000, 64)), False, False, 0.0), (('torch', 26.932), ('triton', 6.01))),
    Measured(CallShape(1, 65536, 16, 16, 128, 'bf16', ((3000, 1), (6000, 3), (12500, 6), (25000, 12), (50000, 64)), False, True, 0.0), (('torch', 65.742), ('triton', 26.546))),
    Measured(CallShape(8, 16384, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), False, False, 0.0), (('torch', 34.416), ('triton', 19.941))),
    Measured(CallShape(8, 16384, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), False, True, 0.0), (('torch', 124.932), ('triton', 91.803))),
    Measured(CallShape(4, 32768, 32, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, False, 0.0), (('torch', 28.313), ('triton', 13.7))),
    Measured(CallShape(4, 32768, 32, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, True, 0.0), (('torch', 99.583), ('triton', 57.315))),
    Measured(CallShape(2, 131072, 16, 8, 64, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, False, 0.0), (('torch', 24.657), ('triton', 12.239))),
    Measured(CallShape(2, 131072, 16, 8, 64, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, True, 0.0), (('torch', 83.73), ('triton', 52.371))),
    Measured(CallShape(1, 196608, 32, 1, 128, 'bf16', ((8192, 1), (32768, 6), (131072, 12)), True, False, 0.0), (('torch', 62.373), ('triton', 37.109))),
    Measured(CallShape(1, 196608, 32, 1, 128, 'bf16', ((8192, 1), (32768, 6), (131072, 12)), True, True, 0.0), (('torch', 218.273), ('triton', 167.561))),
    Measured(CallShape(2, 49152, 16, 16, 128, 'bf16', ((2048, 1), (6144, 4), (12288, 6), (24576, 12)), False, False, 0.0), (('torch', 10.903), ('triton', 6.444))),
    Measured(CallShape(2, 49152, 16, 16, 128, 'bf16', ((2048, 1), (6144, 4), (12288, 6), (24576, 12)), False, True, 0.0), (('torch', 39.444), ('triton', 27.65))),
    Measured(CallShape(1, 524288, 16, 1, 64, 'bf16', ((4096, 1), (8192, 2), (16384, 4), (32768, 8), (65536, 16)), True, False, 0.0), (('torch', 46.604), ('triton', 25.616))),
    Measured(CallShape(1, 524288, 16, 1, 64, 'bf16', ((4096, 1), (8192, 2), (16384, 4), (32768, 8), (65536, 16)), True, True, 0.0), (('torch', 152.815), ('triton', 111.371))),
    Measured(CallShape(1, 1048576, 16, 1, 64, 'bf16', ((8192, 1), (16384, 2), (32768, 4), (65536, 8), (131072, 16)), True, False, 0.0), (('torch', 144.354), ('triton', 98.855))),
    Measured(CallShape(1, 1048576, 16, 1, 64, 'bf16', ((8192, 1), (16384, 2), (32768, 4), (65536, 8), (131072, 16)), True, True, 0.0), (('torch', 503.543), ('triton', 423.684))),
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
