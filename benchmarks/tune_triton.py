"""Sweep the Triton kernels' block configs on the GPU (one kernel varied at a time).

    PYTHONPATH=src python3 benchmarks/tune_triton.py --n 131072 --max-seconds 240 --out tune.md

For each candidate (BM, BN, num_warps, num_stages) of the forward, dK/dV and dQ kernels
(passed as the ``config=`` keyword of the launcher, ``dilated_attention.kernels.triton_launch``;
the other kernels at their defaults) it first checks out/dq/dk/dv against the default config on
fresh random inputs at N = 32768 (relative Frobenius error < 1e-2: same math, different
summation order), then times the forward (forward configs) or forward + backward (dK/dV, dQ
configs) at --n, bf16, batch 1, 16 heads x 128, LongNet branches, not causal. The launcher is
called directly (forward, then backward from its out and lse: the kernels of
``impl="triton"`` without the autograd bookkeeping). Configs that fail to compile (shared
memory) or disagree are reported as such. Last, the best of each kernel combined against the
defaults, causal and not, and the defaults with the folded forward off (``fold=False``).
Stops starting new candidates after --max-seconds.

``--row NAME`` tunes on one row of benchmarks/sweep.py instead (its batch, N, heads, kv heads,
head dim, dtype, branches and causality; the check runs at the row's own shape, the last table
in its own causality only), with the candidates of its head dim (:data:`CANDIDATES_D64` at
D <= 64). With ``config=None`` (the "shipped" line) a Hopper GPU may run the Gluon kernels
where their rules take the row; every candidate runs the Triton kernels (a ``config`` keeps
the call off the Gluon path).

    PYTHONPATH=src python3 benchmarks/tune_triton.py --row 8br-paper-d64-fp16-causal --out tune.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NamedTuple

import torch

from dilated_attention.branches import branch_head_ranges
from dilated_attention.flops import dilated_flops
from dilated_attention.kernels import triton_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, results_header  # noqa: E402

SEG, DIL = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 4, 3),
            (128, 32, 8, 3)],
    # dK/dV: 50% of the headline fwd+bwd at 339 TF/s of executed FLOPs (dQ 533; NOTES_triton.md,
    # 2026-11-25); the default (64, 64, 4, 2) first, then wider key blocks, deeper pipelines
    "dkdv": [(64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 1), (32, 128, 8, 3),
             (32, 64, 4, 3), (16, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4),
             (32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3), (32, 64, 4, 4), (128, 128, 8, 2),
             (64, 64, 8, 3)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3),
           (128, 32, 4, 3)],
}

# D <= 64 (2026-11-29: tune the short causal blocks of 8br-paper-d64-fp16-causal, the one sweep
# row under issue 24's floors; its branches run the Triton kernels, gluon_fwd.D64_MIN_BLOCK): the
# default first, then smaller query tiles (short causal blocks: more programs, less diagonal
# waste), other key tiles and pipelines
CANDIDATES_D64 = {
    "fwd": [(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4),
            (128, 64, 8, 3), (64, 64, 2, 3), (128, 128, 8, 2)],
    "dkdv": [(32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3), (16, 64, 4, 3),
             (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 2, 3), (16, 128, 4, 3)],
    "dq": [(128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 16, 4, 3),
           (128, 32, 8, 3), (32, 32, 2, 3)],
}


class Shape(NamedTuple):
    """One call shape: a sweep row's, or the headline's (batch 1, 16 x 128, bf16)."""

    name: str
    batch: int
    n: int
    heads: int
    heads_kv: int
    d: int
    dtype: torch.dtype
    seg: tuple[int, ...]
    dil: tuple[int, ...]
    causal: bool | None  # None: time both (the headline's sweep: not causal, then both)

    @property
    def head_ranges(self):
        return branch_head_ranges(self.heads, len(self.seg), "all")


def headline_shape(n: int) -> Shape:
    return Shape("headline", 1, n, 16, 16, 128, torch.bfloat16, tuple(SEG), tuple(DIL), None)


def row_shape(name: str) -> Shape:
    """The shape of benchmarks/sweep.py's row ``name``."""
    from sweep import _DT, rows_named

    try:
        (r,) = rows_named([name])
    except ValueError as e:
        raise SystemExit(f"--row: {e}") from None
    return Shape(r.name, r.batch, r.seqlen, r.nheads, r.nheads_kv, r.headdim, _DT[r.dtype], tuple(r.seg),
                 tuple(r.dil), r.causal)


def candidates_for(d: int) -> dict:
    return CANDIDATES_D64 if d <= 64 else CANDIDATES


def _fwd_bwd(sh: Shape, q, k, v, do, causal, backward, config=None, fold=None):
    """The kernels of impl="triton" through the launcher: [out] or [out, dq, dk, dv]."""
    args = (list(sh.seg), list(sh.dil), causal, sh.d**-0.5, sh.head_ranges)
    out, lse = triton_launch.forward(q, k, v, None, *args, config=config, fold=fold)
    if not backward:
        return [out]
    return [out, *triton_launch.backward(do, q, k, v, None, out, lse, *args, config=config)]


def _inputs(sh: Shape, n: int, generator=None):
    mk = lambda h: torch.randn(sh.batch, n, h, sh.d, device="cuda", dtype=sh.dtype,  # noqa: E731
                               generator=generator)
    return mk(sh.heads), mk(sh.heads_kv), mk(sh.heads_kv), mk(sh.heads)


def _run(sh: Shape, n, causal, backward, config=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return _fwd_bwd(sh, *_inputs(sh, n, g), causal, backward, config)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _time(sh: Shape, n, causal, backward, config=None, fold=None):
    import triton.testing

    q, k, v, do = _inputs(sh, n)

    def f():
        _fwd_bwd(sh, q, k, v, do, causal, backward, config, fold)

    f()
    return triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")


def _flops(sh: Shape, n, causal):
    return dilated_flops(sh.batch, n, n, sh.heads, sh.d, list(sh.seg), list(sh.dil), causal)


def _spec(config):
    return ";".join(f"{kernel}={','.join(map(str, cfg))}" for kernel, cfg in config.items())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=131072, help="N of the headline shape (without --row)")
    p.add_argument("--row", default=None, help="tune on this benchmarks/sweep.py row instead of the headline")
    p.add_argument("--max-seconds", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--candidates", default=None,
                   help="replace the built-in list, e.g. 'dkdv=64,64,4,3;dq=128,64,8,2' (the default "
                        "config of each kernel named is always timed too)")
    p.add_argument("--kernels", default="fwd,dkdv,dq",
                   help="comma list of the kernels whose built-in candidates run (default all)")
    a = p.parse_args()
    want = [x.strip() for x in a.kernels.split(",") if x.strip()]
    bad = [x for x in want if x not in CANDIDATES]
    if bad:
        p.error(f"--kernels: unknown {bad}; choose from {sorted(CANDIDATES)}")
    sh = row_shape(a.row) if a.row else headline_shape(a.n)
    n = sh.n
    cands = {x: candidates_for(sh.d)[x] for x in want}
    if a.candidates:
        default = triton_launch.default_configs(sh.d)
        cands = {}
        for item in filter(None, (s.strip() for s in a.candidates.split(";"))):
            name, _, vals = item.partition("=")
            cands.setdefault(name.strip(), [default[name.strip()]]).append(tuple(int(x) for x in vals.split(",")))
    t0 = time.time()
    # the check: the headline's at N = 32768 not causal; a row's at its own shape and causality
    check_n, check_causal = (32768, False) if sh.causal is None else (n, sh.causal)
    sweep_causal = bool(sh.causal)
    ref = _run(sh, check_n, check_causal, True)
    fl = _flops(sh, n, sweep_causal)
    lines = ["| kernel | BM, BN, warps, stages | check (max rel err vs default) | ms | TFLOP/s |",
             "|---|---|---|---|---|"]
    best: dict = {}
    for kernel, kc in cands.items():
        for cfg in kc:
            if time.time() - t0 > a.max_seconds:
                lines.append(f"| {kernel} | {cfg} | not run (time) | | |")
                continue
            try:
                got = _run(sh, check_n, check_causal, True, {kernel: cfg})
                err = max(_rel(x, y) for x, y in zip(got, ref, strict=True))
                if not err < 1e-2:
                    lines.append(f"| {kernel} | {cfg} | MISMATCH {err:.2e} | | |")
                    continue
                bwd = kernel != "fwd"
                ms = _time(sh, n, sweep_causal, bwd, {kernel: cfg})
                tf = (3.5 if bwd else 1.0) * fl / ms / 1e9
                lines.append(f"| {kernel} | {cfg} | {err:.1e} | {ms:.2f} | {tf:.0f} |")
                if kernel not in best or ms < best[kernel][1]:
                    best[kernel] = (cfg, ms)
            except Exception as e:  # compile failures (shared memory), keep sweeping
                lines.append(f"| {kernel} | {cfg} | ERR {type(e).__name__}: {str(e)[:50]} | | |")
            finally:
                torch.cuda.empty_cache()
            print(lines[-1], flush=True)
    combo = {kk: c for kk, (c, _) in best.items()}
    lines += ["", f"best per kernel: `config={combo}` (`--candidates '{_spec(combo)}'`)", "",
              "| causal | config | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s |", "|---|---|---|---|---|"]
    for causal in ((False, True) if sh.causal is None else (sh.causal,)):
        flc = _flops(sh, n, causal)
        default = triton_launch.default_configs(sh.d)
        # "shipped": config=None, the library's own choice (Gluon where it takes the call);
        # "default": the Triton kernels at their default configs
        runs = [("shipped (config=None)", None, None), ("default", default, None), ("best", combo, None)]
        if not causal:  # the folded forward is the default only for non-causal calls
            runs.append(("default, fold=False", None, False))
        for name, cfg, fold in runs:
            f_ms = _time(sh, n, causal, False, cfg, fold)
            b_ms = _time(sh, n, causal, True, cfg, fold)
            lines.append(f"| {causal} | {name} | {f_ms:.2f} | {b_ms:.2f} | {3.5 * flc / b_ms / 1e9:.0f} |")
            print(lines[-1], flush=True)
    dt = str(sh.dtype).replace("torch.", "")
    head = results_header("Triton block-config sweep", "cuda", command_line("python3"), [
        f"{sh.name}: N = {n}, {dt}, batch {sh.batch}, {sh.heads} heads ({sh.heads_kv} kv) x {sh.d}, "
        f"w={list(sh.seg)}, r={list(sh.dil)}; candidates timed {'causal' if sweep_causal else 'not causal'}; "
        f"check at N = {check_n}, {'causal' if check_causal else 'not causal'}",
    ]) + [""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
