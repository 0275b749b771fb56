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
# one row of one committed results file, timed on one GPU in one run. Source:
# benchmarks/results/sweep_h100_2026-11-23.json (H100, torch 2.11, triton 3.6; the 8 rows the
# run's time budget allowed, each forward-only and forward+backward).
# ----------------------------------------------------------------------------------------
MEASURED: tuple[Measured, ...] = (
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, False, 0.0), (('torch', 14.163), ('triton', 10.748))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), False, True, 0.0), (('torch', 50.816), ('triton', 48.457))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 14.358), ('triton', 7.321))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 43.426), ('triton', 31.486))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, False, 0.0), (('torch', 29.325), ('triton', 14.132))),
    Measured(CallShape(1, 131072, 32, 8, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)), True, True, 0.0), (('torch', 97.885), ('triton', 58.316))),
    Measured(CallShape(8, 16384, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, False, 0.0), (('torch', 10.63), ('triton', 7.033))),
    Measured(CallShape(8, 16384, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 8)), True, True, 0.0), (('torch', 37.937), ('triton', 30.428))),
    Measured(CallShape(2, 65536, 16, 16, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64)), False, False, 0.0), (('torch', 14.193), ('triton', 44.752))),
    Measured(CallShape(2, 65536, 16, 16, 128, 'bf16', ((1024, 1), (2048, 2), (4096, 4), (8192, 8), (16384, 16), (32768, 32), (65536, 64)), False, True, 0.0), (('torch', 47.777), ('triton', 66.872))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((4096, 1), (16384, 4), (65536, 16)), False, False, 0.0), (('torch', 12.596), ('triton', 14.504))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((4096, 1), (16384, 4), (65536, 16)), False, True, 0.0), (('torch', 49.541), ('triton', 60.519))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), False, False, 0.0), (('torch', 31.406), ('triton', 12.238))),
    Measured(CallShape(1, 131072, 16, 16, 128, 'bf16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), False, True, 0.0), (('torch', 71.822), ('triton', 53.491))),
    Measured(CallShape(2, 65536, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), True, False, 0.0), (('torch', 33.24), ('triton', 14.926))),
    Measured(CallShape(2, 65536, 32, 8, 128, 'fp16', ((2048, 1), (4096, 2), (8192, 4), (16384, 6), (32768, 12)), True, True, 0.0), (('torch', 112.831), ('triton', 63.831))),
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
