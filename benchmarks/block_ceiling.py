"""The dense ceiling of a sweep row: its blocks attended by the best dense kernel (issue 24).

A segment-then-dilate kernel does only useful work, but that work comes as many short dense
problems: every (segment, residue class) block of every branch is a dense attention over
``w // r`` rows (``N % w`` for a short last segment). Dense SDPA at the row's full length is the
issue's yardstick; this script asks what dense kernels reach on the row's own blocks. For each
row of ``benchmarks/sweep.py`` named by ``--rows`` it groups the blocks by length
(:func:`block_groups`: per branch, each block length with the number of (segment, head) blocks of
that length, from ``dilated_attention.geometry``: the same geometry as ``dilated_flops``), builds
contiguous ``(blocks, 1, L, D)`` tensors per group, and times SDPA on them with each dense backend
(FlashAttention, cuDNN, memory-efficient; ``--backends``), forward under no_grad and
forward+backward, keeping the fastest backend per group and direction. The sum over groups is
the **ceiling**: the time of a kernel that ran every block at the best dense rate for its length
and merged the branches for free. Beside it, in the same process: the library's ``impl``
(default triton) on the whole row, dense SDPA on the whole row (``sweep.run_dense``: the issue's
yardstick), and with ``--per-branch`` the library on each branch alone.

Reading it: ``ceiling % dense`` is the most any kernel of this design can reach on the row;
where it is under the issue's floor the floor is out of reach by design, not by the kernel.
``library % ceiling`` is what is left to win in the kernel; ``sum of branches / library``
above 1 says the merges are cheap, a library call slower than the sum of its branches says they
are not.

    PYTHONPATH=src python3 benchmarks/block_ceiling.py --rows 8br-paper-d64-fp16-causal --per-branch --out $OUT/ceiling.md
    PYTHONPATH=src python3 benchmarks/block_ceiling.py --tiny --rows 8br-paper-d64-fp16-causal   # CPU, seconds
    bash scripts/gpu_check.sh ceiling   # the rows below the issue's floors, and some above
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import command_line, results_header, run_info  # noqa: E402
from sweep import (  # noqa: E402
    _DT,
    AB_ROWS,
    ROWS,
    Row,
    Timer,
    dflops,
    flops,
    measure,
    rows_named,
    run_dense,
    tiny_row,
)

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.branches import branch_head_ranges  # noqa: E402
from dilated_attention.flops import _block_pairs  # noqa: E402
from dilated_attention.geometry import block_length, block_offsets, segments  # noqa: E402

BACKENDS = ("flash", "cudnn", "efficient")


def block_groups(
    n: int, nheads: int, seg, dil, head_assignment: str = "all"
) -> list[tuple[int, ...]]:
    """``(branch, w, r, L, count)`` per branch and block length: ``count`` (segment, head) blocks of ``L``
    rows in one batch entry of ``n`` rows (seqlen_q == seqlen_k). Head ``h`` of a branch with
    dilation ``r`` attends the residue class ``h % r`` of every segment (docs/spec.md); blocks
    of 0 rows are left out."""
    out = []
    ranges = branch_head_ranges(nheads, len(seg), head_assignment)
    for i, ((w, r), (hs, he)) in enumerate(zip(zip(seg, dil, strict=True), ranges, strict=True)):
        heads_per_off = Counter(h % r for h in range(hs, he))
        lengths: Counter = Counter()
        for _, ls in segments(n, w):
            for o in block_offsets(r, ls):
                length = block_length(ls, o, r)
                if length > 0 and heads_per_off[o]:
                    lengths[length] += heads_per_off[o]
        out += [(i, w, r, length, c) for length, c in sorted(lengths.items(), reverse=True)]
    return out


def group_pairs(groups, batch: int, causal: bool) -> int:
    """Attended (query, key, head, branch) pairs of the groups: ``dilated_pairs`` of the row."""
    return sum(batch * c * _block_pairs(length, length, causal) for *_, length, c in groups)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None),
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def time_group(
    blocks: int, length: int, d: int, dtype, causal: bool, dev, backends, iters: int
) -> dict:
    """Fastest backend's forward and forward+backward ms on ``(blocks, 1, length, d)`` tensors
    (``sweep.measure`` per backend): ``{"fwd_ms", "fb_ms", "fwd_backend", "fb_backend", "errors"}``."""
    from torch.nn.attention import sdpa_kernel

    xs = [torch.randn(blocks, 1, length, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)]
    do = torch.randn_like(xs[0])
    best: dict = {"errors": []}
    for name in backends:
        be = _sdpa_backend(name)
        if be is None:
            continue
        try:
            with sdpa_kernel([be]):
                m = measure(lambda: F.scaled_dot_product_attention(*xs, is_causal=causal), xs, do,
                            Timer(dev), dev, iters)  # fmt: skip
        except Exception as e:  # a backend that does not take this shape: the others do
            best["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        for key in ("fwd", "fb"):
            if m[f"{key}_ms"] < best.get(f"{key}_ms", float("inf")):
                best[f"{key}_ms"], best[f"{key}_backend"] = m[f"{key}_ms"], name
    if "fwd_ms" not in best:
        raise RuntimeError(f"no SDPA backend ran {blocks} x {length} x {d}: {best['errors']}")
    return best


def time_library(r: Row, seg, dil, dev, impl: str, iters: int) -> dict:
    """The library's ``impl`` on row ``r`` with branches (seg, dil): fwd (no_grad) and fwd+bwd ms
    (``sweep.measure``)."""
    dt = _DT[r.dtype]
    q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    call = lambda: dilated_attention(q, k, v, list(seg), list(dil), causal=r.causal, impl=impl)  # noqa: E731
    return measure(call, (q, k, v), torch.randn_like(q), Timer(dev), dev, iters)


def run_row(r: Row, dev, args) -> dict:
    groups = block_groups(r.seqlen, r.nheads, r.seg, r.dil)
    res: dict = {"row": r, "groups": [], "branches": {}}
    for i, w, d, length, c in groups:
        t = time_group(
            r.batch * c, length, r.headdim, _DT[r.dtype], r.causal, dev, args.backends, args.iters
        )
        res["groups"].append({"branch": i, "w": w, "r": d, "L": length, "blocks": r.batch * c, **t})
        print(
            f"  {r.name}: w={w} r={d} L={length} x{r.batch * c}: fwd {t['fwd_ms']:.3f} ms "
            f"({t['fwd_backend']}), fwd+bwd {t['fb_ms']:.3f} ms ({t['fb_backend']})",
            flush=True,
        )
    for key in ("fwd", "fb"):
        res[f"ceiling_{key}_ms"] = sum(g[f"{key}_ms"] for g in res["groups"])
    res["branches"] = {g["branch"]: {"w": g["w"], "r": g["r"]} for g in res["groups"]}
    for g in res["groups"]:
        b = res["branches"][g["branch"]]
        for key in ("fwd", "fb"):
            b[f"ceiling_{key}_ms"] = b.get(f"ceiling_{key}_ms", 0.0) + g[f"{key}_ms"]
    try:
        res["library"] = time_library(r, r.seg, r.dil, dev, args.impl, args.iters)
    except Exception as e:  # report the row, keep going
        res["library"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    if args.per_branch:
        for b in res["branches"].values():
            try:
                b["library"] = time_library(r, (b["w"],), (b["r"],), dev, args.impl, args.iters)
            except Exception as e:
                b["library"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    dt = _DT[r.dtype]
    q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device=dev, dtype=dt)
    k = torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device=dev, dtype=dt)
    res["dense"] = run_dense(
        r,
        q,
        k,
        torch.randn_like(k),
        torch.randn_like(q),
        dev,
        Timer(dev),
        SimpleNamespace(iters=args.iters),
    )
    del q, k
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _tf(fl: float, ms) -> float | None:
    return fl / ms / 1e9 if ms else None


def _pct(a, b) -> str:
    return f"{100 * a / b:.0f}%" if a and b else "-"


def _ms(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "-"


def markdown(results: list[dict], meta: dict, args) -> str:
    lines = results_header(
        "Dense ceiling of sweep rows: their blocks on dense SDPA (issue 24)", info=meta
    )
    lines += [
        f"- blocks: per branch and block length, contiguous (blocks, 1, L, D) tensors; backends tried: "
        f"{', '.join(args.backends)}; the fastest per group and direction; median of {args.iters} timed "
        f"calls after 1 warmup (CUDA events)",
        "- ceiling = sum over the groups (no merge cost); useful FLOPs = `dilated_flops` (fwd+bwd 3.5x); "
        "`% dense` = TF/s over dense SDPA's on the whole row (same run; `sweep.run_dense`)",
        f'- library = `dilated_attention(..., impl="{args.impl}")` on the whole row, same run',
        "",
        "| row | dir | useful TF/s: dense | ceiling ms | ceiling TF/s | ceiling % dense | library ms | "
        "library TF/s | library % dense | library % ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        r = res["row"]
        for key, bwd in (("fwd", False), ("fb", True)):
            fl = flops(r, bwd)
            dense_ms = res["dense"].get(f"{key}_ms")
            dense_tf = _tf(dflops(r, bwd), dense_ms)
            ceil_tf = _tf(fl, res[f"ceiling_{key}_ms"])
            lib_ms = res["library"].get(f"{key}_ms")
            lib_tf = _tf(fl, lib_ms)
            lines.append(
                f"| {r.name} | {'fwd+bwd' if bwd else 'fwd'} | {f'{dense_tf:.0f}' if dense_tf else '-'} | "
                f"{_ms(res[f'ceiling_{key}_ms'])} | {ceil_tf:.0f} | {_pct(ceil_tf, dense_tf)} | {_ms(lib_ms)} | "
                f"{f'{lib_tf:.0f}' if lib_tf else res['library'].get('error', '-')} | {_pct(lib_tf, dense_tf)} | "
                f"{_pct(res[f'ceiling_{key}_ms'], lib_ms)} |"
            )
    lines += [
        "",
        "## Per block group",
        "",
        "| row | w | r | L | blocks | fwd ms | backend | fwd+bwd ms | backend |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for g in res["groups"]:
            lines.append(
                f"| {res['row'].name} | {g['w']} | {g['r']} | {g['L']} | {g['blocks']} | {g['fwd_ms']:.3f} | "
                f"{g['fwd_backend']} | {g['fb_ms']:.3f} | {g['fb_backend']} |"
            )
    if args.per_branch:
        lines += [
            "",
            "## Per branch: the library on one branch alone against that branch's ceiling",
            "",
            "| row | w | r | ceiling fwd ms | library fwd ms | ceiling fwd+bwd ms | library fwd+bwd ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for res in results:
            tot = {"fwd_ms": 0.0, "fb_ms": 0.0}
            for b in res["branches"].values():
                lib = b.get("library", {})
                for key in tot:
                    tot[key] += lib.get(key, float("nan"))
                lines.append(
                    f"| {res['row'].name} | {b['w']} | {b['r']} | {b['ceiling_fwd_ms']:.3f} | "
                    f"{_ms(lib.get('fwd_ms')) if 'fwd_ms' in lib else lib.get('error', '-')} | "
                    f"{b['ceiling_fb_ms']:.3f} | {_ms(lib.get('fb_ms'))} |"
                )
            whole = res["library"]
            lines.append(
                f"| {res['row'].name} | sum of branches / whole call | | "
                f"{_ms(res['ceiling_fwd_ms'])} | {_ms(tot['fwd_ms'])} / {_ms(whole.get('fwd_ms'))} | "
                f"{_ms(res['ceiling_fb_ms'])} | {_ms(tot['fb_ms'])} / {_ms(whole.get('fb_ms'))} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows",
        default="8br-paper-d64-fp16-causal",
        help="comma-separated sweep.py row names, or 'all'",
    )
    p.add_argument("--impl", default="triton", help="the library impl timed beside the ceiling")
    p.add_argument(
        "--backends",
        type=lambda x: x.split(","),
        default=list(BACKENDS),
        help=f"dense SDPA backends to try per block group (default {','.join(BACKENDS)})",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed calls per measurement (default 5; 1 with --tiny)",
    )
    p.add_argument(
        "--per-branch", action="store_true", help="also the library on each branch alone"
    )
    p.add_argument(
        "--budget-s", type=float, default=1e9, help="skip the rows after this many seconds"
    )
    p.add_argument(
        "--tiny", action="store_true", help="CPU, the rows shrunk (sweep.tiny_row): a smoke test"
    )
    p.add_argument("--out", help="write the markdown here")
    args = p.parse_args(argv)
    names = [r.name for r in ROWS] if args.rows == "all" else args.rows.split(",")
    try:
        picked = rows_named(names)
    except ValueError as e:
        sys.exit(str(e))
    rows = [r for r in ROWS + AB_ROWS if r in picked]
    if args.tiny:
        rows, dev = [tiny_row(r) for r in rows], torch.device("cpu")
        args.backends, args.impl = ["math"], "torch"
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        sys.exit("block_ceiling.py needs a CUDA GPU (or --tiny on the CPU)")
    args.iters = args.iters or (1 if args.tiny else 5)
    meta = run_info(dev, command_line("python3"))
    t0 = time.perf_counter()
    results = []
    for r in rows:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"skipped {r.name}: past --budget-s {args.budget_s:.0f}", flush=True)
            continue
        results.append(run_row(r, dev, args))
        text = markdown(results, meta, args)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    print(markdown(results, meta, args) if results else "no rows ran")


if __name__ == "__main__":
    main()
