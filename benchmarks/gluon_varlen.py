"""Prototype: the Gluon kernels over packed documents in ONE launch per branch and kernel (issue 22 item 2b).

Why: on Hopper one sequence runs the Gluon kernels and packed documents the Triton varlen ones,
so the packed stream's rate per useful FLOP lags one sequence's by the two families' gap
(benchmarks/NOTES_triton.md, "Packed documents in the Gluon kernels"). This prototype is NOTES'
option A, forward and backward: the library's Gluon partitions (``kernels/gluon_fwd_kernel``:
loader, two consumer warpgroups, the (hi, lo) merge epilogue; ``kernels/gluon_bwd_kernel``: the
dK/dV and dQ loaders and consumers) unchanged, under new top-level kernels whose programs build
their block's TMA descriptors on the device (``tma.make_tensor_descriptor``): base at the
block's first row ``p0 + c`` (``p0`` the segment's first row in the packed stream, ``c = h %
r``), shape ``[1, L, 1, D]`` (the dK/dV kernel's q / dO: ``[1, L, H, D]``, its loader's column
being the query head) with ``L = ceil((w_s - c) / r)`` rows for a segment of ``w_s`` rows, row
stride ``r x`` the stream's. TMA then zero-fills past the block and drops stores past it,
exactly as the host descriptors do at a launch's L: no masking changes, no length classes (each
program has its own L), short last segments and documents shorter than w included. The
backward's pointer stores (dq, dk, dv rows ``blk * W + c + R t``) get ``blk = p0, W = 1``; its
block-major lse / delta rows are per (head, entry) (:func:`varlen_rows`).

One program per (query tile of 128 rows, entry, head); an entry is one (document, segment)
of the branch, listed on the host here (``entries``: the prototype reads the offsets on the
host; the library would build the table on the device, as its Triton varlen grid does).
Programs past their block's rows do nothing. The descriptors need a global scratch of 640 bytes
a program (forward: five descriptors; 512 in the backward kernels: four), which Triton asks of the allocator in ``triton.runtime._allocation._allocator`` (a
ContextVar): set around each launch and reset after, so the process-wide default (set by the
user or not) is left as found.

    /tmp/t36/bin/python benchmarks/gluon_varlen.py --compile-only    # CPU: sm_90 compile (Triton 3.6)
    PYTHONPATH=src python3 benchmarks/gluon_varlen.py --check --bench --out $OUT/gluon_varlen.md

``--check``: random packed batches (lognormal lengths with empty, one-token and long
documents; branches with w % r != 0, w > a document, r > 1 first; causal and not; GQA; bf16 and
fp16; D 64 and 128) against the float64 reference on each document alone (out, lse, dq, dk,
dv), judged against the library's own varlen error on the same inputs. ``--bench``: the
issue's packed batch (128K tokens, lognormal mean 8K, 16 x 128, bf16, LongNet branches) forward
and forward+backward: this prototype, the library's varlen call (Triton kernels), and one
sequence of 128K tokens (Gluon, and Triton) per useful FLOP; ``--ceiling`` adds both calls'
blocks on dense SDPA (:func:`ceiling_ms`). Exit 2 without an sm_90 GPU (the compile mode needs
only Triton 3.6). The kernels and launches now live in the library (``kernels/gluon_varlen.py``, forward on
by default since 2026-11-29, backward behind ``gluon_varlen.VARLEN_BACKWARD``); this script calls them
without their gates.

Measured (H200, torch 2.11, triton 3.6, 2026-11-29: results/gluon_varlen_h200_2026-11-29.md):
exact (16 bf16 check cases and the 4 fp16 ones without r = 1, each within 2x the library's
error; the first run did not compile where r = 1, since Triton passes an int argument equal to
1 as a constexpr: the compile mode now builds those variants too). On the issue's batch the
forward runs at the one sequence's time per useful FLOP x 1.16 (not causal) and x 1.44 (causal),
faster than the library's Triton varlen forward (x 1.46, x 1.58); forward+backward x 1.43 and
x 1.62, against the library's x 1.49 and x 1.45: the backward over short blocks is the loss.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

try:
    from triton.experimental.gluon import language as gl

    from dilated_attention.kernels import gluon_bwd_kernel as BK
    from dilated_attention.kernels import gluon_fwd_kernel as F

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  (no Gluon / no Hopper module in this Triton)
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

from dilated_attention.kernels import gluon_bwd, gluon_fwd, gluon_varlen  # noqa: E402
from dilated_attention.kernels.gluon_varlen import PROGRAM_ROWS, entries  # noqa: E402

if _IMPORT_ERROR is None:
    # the kernels are the library's (kernels/gluon_varlen_kernel.py, from this prototype)
    from dilated_attention.kernels.gluon_varlen_kernel import (
        SCRATCH_PER_PROGRAM,
        dkdv_varlen_hd_kernel,
        dkdv_varlen_kernel,
        dq_varlen_hd_kernel,
        dq_varlen_kernel,
        gluon_fwd_varlen_hd_kernel,
        gluon_fwd_varlen_kernel,
    )


# ------------------------------------------------------------------------------ host


def grid_for(offsets: list[int], w: int, r: int, nh: int) -> tuple[int, int, int]:
    """(query tiles of the longest block, entries, heads); (0, 0, 0) without an entry. The
    longest block is the first offset's (c = 0) of the longest segment: ceil(min(w, n) / r)."""
    lens = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    n_ent = sum(-(-n // w) for n in lens)
    if not n_ent:
        return (0, 0, 0)
    longest = -(-max(min(w, n) for n in lens) // r)
    return (-(-longest // PROGRAM_ROWS), n_ent, nh)


def varlen_forward(q, k, v, offsets: list[int], seg, dil, causal: bool, scale: float | None = None):
    """out (total, H, D) and lse (H, total) float32 of dilated attention over the packed
    documents ``offsets`` (host ints, queries and keys alike), every head in every branch: the
    library's launch (``gluon_varlen.forward``: the entry table from device offsets, no host
    read) without its gate (:func:`gluon_varlen.problem`)."""
    total, nh, d = q.shape
    for name, x in (("q", q), ("k", k), ("v", v)):  # the descriptors' strides: rows of heads x D
        if not x.is_contiguous():
            raise ValueError(f"varlen_forward: {name} must be contiguous (total, heads, D), got strides {x.stride()}")
    if k.shape != v.shape or nh % k.shape[1] or offsets[-1] > total:
        raise ValueError(f"varlen_forward: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"last offset {offsets[-1]}")
    scale = d**-0.5 if scale is None else scale
    branches = [(w, r, 0, nh) for w, r in zip(seg, dil, strict=True)]
    covered = offsets[0] == 0 and offsets[-1] == total  # every row a document's: no fill (r = 1 first)
    cu = torch.tensor(offsets, dtype=torch.int32).to(q.device, non_blocking=True)
    longest = max([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)] + [1])
    fill = not (dil[0] == 1 and covered)  # as triton_launch._first_branch_writes_all (all heads)
    out, lse = gluon_varlen.forward(q[None], k[None], v[None], cu, longest, branches, causal, scale, fill)
    return out[0], lse[0]


def emulate_forward(q, k, v, offsets: list[int], seg, dil, causal: bool, scale: float | None = None):
    """The kernel's index arithmetic in float64 on any device (a CPU check of the design, no
    Gluon): per branch, entry (p0, w_s) and head h, the block rows p0 + c + r t (t < L, L =
    ceil((w_s - c) / r), c = h % r), dense attention inside it (causal inside the block), its
    (out, lse) merged into the result by LSE weights at rows pos0 + r t of lse's row h."""
    total, nh, d = q.shape
    grp = nh // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(total, nh, d, dtype=torch.float64, device=q.device)
    lse = torch.full((nh, total), float("-inf"), dtype=torch.float64, device=q.device)
    for w, r in zip(seg, dil, strict=True):
        for p0, ws in zip(*entries(offsets, w), strict=True):
            for h in range(nh):
                c = h % r
                n_rows = max(-(-(ws - c) // r), 0)
                if n_rows == 0:
                    continue
                rows = p0 + c + r * torch.arange(n_rows, device=q.device)
                qb = q[rows, h].double()
                kb, vb = k[rows, h // grp].double(), v[rows, h // grp].double()
                s_ = qb @ kb.T * scale
                if causal:
                    s_ = s_.masked_fill(torch.ones_like(s_, dtype=torch.bool).triu(1), float("-inf"))
                lb = torch.logsumexp(s_, dim=1)
                ob = torch.softmax(s_, dim=1) @ vb
                la = lse[h, rows]
                mx = torch.maximum(la, lb)
                wa, wb = torch.exp(la - mx), torch.exp(lb - mx)
                out[rows, h] = (out[rows, h] * wa[:, None] + ob * wb[:, None]) / (wa + wb)[:, None]
                lse[h, rows] = mx + torch.log(wa + wb)
    return out, lse


def varlen_rows(x: torch.Tensor, offsets: list[int], w: int, r: int, pad_value: float,
                mult: float = 1.0) -> torch.Tensor:
    """(H, total) float -> block-major float32 [H, NE, LP] over branch w's entries from host
    offsets: the library's ``gluon_varlen.prep_rows`` (``y[h, e, t] = mult * x[h, p0_e + c + r
    t]`` for t < L(e, c) = ceil((w_e - c) / r), c = h % r; -inf -> +inf; other rows
    ``pad_value``; LP = the longest block rounded up to ``gluon_bwd.LPAD``)."""
    p0, ws = entries(offsets, w)
    longest = max([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)] + [0])
    lp = gluon_varlen.rows_pad(longest, offsets[-1], w, r)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=x.device)  # noqa: E731
    return gluon_varlen.prep_rows(x, as_t(p0), as_t(ws), r, lp, pad_value, mult)


def varlen_backward(dout, q, k, v, out, lse, offsets: list[int], seg, dil, causal: bool,
                    scale: float | None = None):
    """dq, dk, dv (the inputs' dtypes) over the packed documents, from the FINAL out and lse
    (:func:`varlen_forward`): the library's launch (``gluon_varlen.backward``: float32
    accumulators, a first branch with r = 1 over covered rows stores instead of adding; entry
    tables and block-major rows made on the device) without its gate."""
    from dilated_attention.kernels import triton_launch

    total, nh, d = q.shape
    scale = d**-0.5 if scale is None else scale
    delta = triton_launch._delta(out[None], dout[None])
    covered = offsets[0] == 0 and offsets[-1] == total
    store_first = dil[0] == 1 and covered
    branches = [(w, r, 0, nh) for w, r in zip(seg, dil, strict=True)]
    cu = torch.tensor(offsets, dtype=torch.int32).to(q.device, non_blocking=True)
    longest = max([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)] + [1])
    dq, dk, dv = gluon_varlen.backward(dout[None], q[None], k[None], v[None], delta, lse[None], cu, longest,
                                       branches, causal, scale, store_first)  # fmt: skip
    return dq[0], dk[0], dv[0]


# ------------------------------------------------------------------------------ check / bench


def _lengths(rng: torch.Generator, total: int, mean: float) -> list[int]:
    from bench_varlen import document_lengths

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    lens = document_lengths(total, mean, 1.0, seed)
    # empty and one-token documents inside the stream
    lens[len(lens) // 2 : len(lens) // 2] = [0, 1]
    return lens


CHECK_BRANCHES = (
    ([64, 128, 256], [1, 2, 4]),  # LongNet-like, r = 1 first (no fill)
    ([96, 160], [2, 3]),  # r > 1 first (filled buffers), 160 % 3 != 0
    ([64, 1024], [1, 5]),  # w > most documents, 1024 % 5 != 0
    ([128], [1]),  # one branch: no lo buffer
)


def _case_errors(q, k, v, dout, offs, seg, dil, causal, got: dict) -> dict:
    """Max abs error of each of ``got``'s out, lse, dq, dk, dv against the float64 reference run
    on each document alone (lse: inf where their finite masks differ)."""
    from dilated_attention.reference import dilated_attention_reference

    err = dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 0.0)
    for a, b in zip(offs[:-1], offs[1:], strict=True):
        if a == b:
            continue
        xs = [x[a:b][None].double().requires_grad_() for x in (q, k, v)]
        ro, rl = dilated_attention_reference(*xs, seg, dil, causal=causal)
        grads = torch.autograd.grad(ro, xs, dout[a:b][None].double())
        ref = {"out": ro[0], "dq": grads[0][0], "dk": grads[1][0], "dv": grads[2][0]}
        for name, want in ref.items():
            err[name] = max(err[name], (got[name][a:b].double() - want).abs().max().item())
        fin = torch.isfinite(rl[0])
        if not torch.equal(fin, torch.isfinite(got["lse"][:, a:b])):
            err["lse"] = float("inf")
        elif fin.any():
            err["lse"] = max(err["lse"], (got["lse"][:, a:b].double()[fin] - rl[0][fin]).abs().max().item())
    return err


def check(device, lines: list[str], dtypes=(torch.bfloat16, torch.float16), flush=lambda: None) -> bool:
    """The prototype's forward and backward against the float64 reference per document, judged
    as tests/test_gluon_*.py judge the Gluon kernels: each error <= 2x the library's own
    (``dilated_attention_varlen(impl="triton")``, the Triton varlen kernels, same inputs) + 1e-3.
    ``flush`` after each case (the report survives a timeout: 16 cases took 300 s on an H200,
    most of it compiling)."""
    from dilated_attention import dilated_attention_varlen

    ok = True
    rng = torch.Generator().manual_seed(0)
    names = ("out", "lse", "dq", "dk", "dv")
    lines += ["## check against the float64 reference on each document alone", "",
              "max abs errors, prototype (library Triton varlen); ok: each <= 2x the library's + 1e-3", "",
              "| dtype | D | heads | branches | causal | docs | " + " | ".join(names) + " | ok |",
              "|---|---|---|---|---|---|" + "---|" * (len(names) + 1)]  # fmt: skip
    for dtype in dtypes:
        for d, nh, nkv in ((128, 4, 2), (64, 6, 6)):
            for seg, dil in CHECK_BRANCHES:
                for causal in (False, True):
                    lens = _lengths(rng, 1500, 300.0)
                    offs = [0]
                    for n in lens:
                        offs.append(offs[-1] + n)
                    total = offs[-1]
                    q = torch.randn(total, nh, d, device=device, dtype=dtype)
                    k = torch.randn(total, nkv, d, device=device, dtype=dtype)
                    v = torch.randn_like(k)
                    dout = torch.randn_like(q)
                    try:
                        out, lse = varlen_forward(q, k, v, offs, seg, dil, causal)
                        dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, offs, seg, dil, causal)
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001  (report the case, keep checking)
                        ok = False
                        lines.append(f"| {str(dtype)[6:]} | {d} | {nh}/{nkv} | {seg} / {dil} | {causal} | {len(lens)} | "
                                     f"ERROR {type(e).__name__}: {str(e)[:200]} |")  # fmt: skip
                        print(lines[-1], flush=True)
                        flush()
                        continue
                    mine = _case_errors(q, k, v, dout, offs, seg, dil, causal,
                                        dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv))  # fmt: skip
                    cu = torch.tensor(offs, dtype=torch.int32)
                    xs = [x.detach().requires_grad_() for x in (q, k, v)]
                    lo, ll = dilated_attention_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal,
                                                      impl="triton", return_lse=True)  # fmt: skip
                    lg = torch.autograd.grad(lo, xs, dout)
                    lib = _case_errors(q, k, v, dout, offs, seg, dil, causal,
                                       dict(out=lo, lse=ll, dq=lg[0], dk=lg[1], dv=lg[2]))  # fmt: skip
                    good = all(mine[n] <= 2 * lib[n] + 1e-3 for n in names)
                    ok &= good
                    cells = " | ".join(f"{mine[n]:.1e} ({lib[n]:.1e})" for n in names)
                    row = (f"| {str(dtype)[6:]} | {d} | {nh}/{nkv} | {seg} / {dil} | {causal} | {len(lens)} | "
                           f"{cells} | {'yes' if good else '**NO**'} |")
                    print(row, flush=True)
                    lines.append(row)
                    flush()
    lines.append("")
    return ok


def _bench_rows(device, causal, offs, lens, seg, dil, total, nh, d, ceiling: bool = False) -> list[str]:
    import triton.testing
    from bench_varlen import _without_gluon

    from dilated_attention import dilated_attention, dilated_attention_varlen
    from dilated_attention.flops import dilated_flops, dilated_flops_varlen

    q = torch.randn(total, nh, d, device=device, dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(offs, dtype=torch.int32)
    fl_v = dilated_flops_varlen(lens, lens, nh, d, seg, dil, causal)
    fl_1 = dilated_flops(1, total, total, nh, d, seg, dil, causal)

    def t(fn):
        fn()
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    def proto_fb():
        out, lse = varlen_forward(q, k, v, offs, seg, dil, causal)
        return varlen_backward(do, q, k, v, out, lse, offs, seg, dil, causal)

    def lib(x):
        return dilated_attention_varlen(*x, cu, cu, max(lens), max(lens), seg, dil, causal=causal, impl="triton")

    def one(x):
        return dilated_attention(x[0][None], x[1][None], x[2][None], seg, dil, causal=causal, impl="triton")

    def fb(call):
        return lambda: torch.autograd.grad(call(xs), xs, do[None] if call is one else do)

    calls = {
        "prototype (Gluon, packed)": (lambda: varlen_forward(q, k, v, offs, seg, dil, causal), proto_fb, fl_v),
        "library varlen (Triton)": (lambda: lib((q, k, v)), fb(lib), fl_v),
        "one sequence, Gluon": (lambda: one((q, k, v)), fb(one), fl_1),
        "one sequence, Triton": (_without_gluon(lambda: one((q, k, v))), _without_gluon(fb(one)), fl_1),
    }
    ms = {}
    for name, (f, b, fl) in calls.items():
        with torch.no_grad():
            f_ms = t(f)
        ms[name] = (f_ms, t(b), fl)
    if ceiling:
        for name, ls, fl in (("ceiling: packed blocks on dense SDPA", lens, fl_v),
                             ("ceiling: one sequence's blocks on dense SDPA", [total], fl_1)):  # fmt: skip
            ms[name] = (*ceiling_ms(length_groups(ls, nh, seg, dil), d, torch.bfloat16, causal, device), fl)
    one_f, one_b = (ms["one sequence, Gluon"][i] for i in (0, 1))
    rows = []
    for name, (f_ms, b_ms, fl) in ms.items():
        rf, rb = fl / f_ms / 1e9, 3.5 * fl / b_ms / 1e9
        rows.append(f"| {causal} | {name} | {f_ms:.3f} | {b_ms:.3f} | {rf:.0f} / {rb:.0f} | "
                    f"{(fl_1 / one_f / 1e9) / rf:.3f}x / {(3.5 * fl_1 / one_b / 1e9) / rb:.3f}x |")
        print(rows[-1], flush=True)
    return rows


def length_groups(lens: list[int], nh: int, seg, dil) -> list[tuple[int, int]]:
    """``(L, count)``: the (segment, head) blocks of every branch over documents of ``lens``
    (each its own sequence: ``block_ceiling.block_groups`` per document), merged by length L
    (a group's dense time depends only on its count and L), longest first."""
    from block_ceiling import block_groups

    by: Counter = Counter()
    for n in lens:
        for *_, length, c in block_groups(n, nh, seg, dil):
            by[length] += c
    return sorted(by.items(), reverse=True)


def ceiling_ms(groups, d: int, dtype, causal: bool, device, iters: int = 5,
               backends=("flash", "cudnn")) -> tuple[float, float]:  # fmt: skip
    """The dense ceiling (benchmarks/block_ceiling.py) of blocks ``groups`` ((L, count)): each
    group as one (count, 1, L, D) SDPA call on its fastest backend, forward and forward+backward
    ms summed over the groups: what a kernel that ran every block at the dense rate for its length
    would take, merges free."""
    from block_ceiling import time_group

    # the issue's packed batch has 157 block lengths: two backends (the efficient one won no group
    # in results/block_ceiling_h200_2026-11-29.md) and 5 timed calls keep it near a minute
    f = b = 0.0
    for length, c in groups:
        got = time_group(c, length, d, dtype, causal, device, backends, iters)
        f, b = f + got["fwd_ms"], b + got["fb_ms"]
    return f, b


def issue_batch():
    """The issue's packed batch: (w, r, total, heads, D, lengths, offsets): 128K tokens in
    lognormal documents (mean 8192, sigma 1, seed 0), 16 x 128, LongNet branches."""
    from bench_varlen import document_lengths

    lens = document_lengths(131072, 8192.0, 1.0, 0)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16], 131072, 16, 128, lens, offs


def bench(device, lines: list[str], ceiling: bool = False) -> None:
    seg, dil, total, nh, d, lens, offs = issue_batch()
    lines += [f"## forward and forward+backward: {total} tokens in {len(lens)} documents (lognormal mean 8192, sigma 1, seed 0; "
              f"longest {max(lens)}), {nh} x {d}, bf16, w {seg}, r {dil}", "",
              "| causal | call | fwd ms | fwd+bwd ms | useful TF/s fwd / fwd+bwd | time per useful FLOP over one "
              "sequence (Gluon), fwd / fwd+bwd |", "|---|---|---|---|---|---|"]  # fmt: skip
    for causal in (False, True):
        lines += _bench_rows(device, causal, offs, lens, seg, dil, total, nh, d, ceiling)
    lines.append("")
    if ceiling:
        lines += ["ceiling rows: every (segment, head) block on dense SDPA (the faster of flash and cuDNN per "
                  "block length, benchmarks/block_ceiling.py), summed: the packed batch's blocks "
                  f"({len(length_groups(lens, nh, seg, dil))} lengths) and the one sequence's "
                  f"({len(length_groups([total], nh, seg, dil))}). Their ratio bounds what item 2b's 1.1x can reach "
                  "by design (short blocks: edge tiles and causal diagonals weigh more).", ""]  # fmt: skip


def kernel_table(fn, iters: int = 3, top: int = 10) -> list[tuple[str, float, float]]:
    """(kernel name, launches per call, device ms per call) of ``fn``'s CUDA kernels under
    ``torch.profiler`` (after one warm call), the ``top`` longest first, then ("all", n, ms)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(ev.key, ev.count / iters, ev.device_time_total / 1e3 / iters) for ev in prof.key_averages()
            if ev.device_time_total > 0]  # fmt: skip
    rows.sort(key=lambda x: -x[2])
    return rows[:top] + [("all", sum(r[1] for r in rows), sum(r[2] for r in rows))]


def profile(device, lines: list[str]) -> None:
    """Where the forward+backward time goes, per kernel, on the issue's packed batch: the
    prototype, the library's varlen call (Triton) and one sequence on the Gluon kernels."""
    from dilated_attention import dilated_attention, dilated_attention_varlen

    seg, dil, total, nh, d, lens, offs = issue_batch()
    cu = torch.tensor(offs, dtype=torch.int32, device=device)
    q = torch.randn(total, nh, d, device=device, dtype=torch.bfloat16)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    lines += ["## forward+backward per kernel (torch.profiler, device ms per call, 3 calls)", ""]
    for causal in (False, True):

        def proto():
            out, lse = varlen_forward(q, k, v, offs, seg, dil, causal)  # noqa: B023
            return varlen_backward(do, q, k, v, out, lse, offs, seg, dil, causal)  # noqa: B023

        def lib():
            o = dilated_attention_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal,  # noqa: B023
                                         impl="triton")  # fmt: skip
            return torch.autograd.grad(o, xs, do)

        def one():
            o = dilated_attention(*(x[None] for x in xs), seg, dil, causal=causal, impl="triton")  # noqa: B023
            return torch.autograd.grad(o, xs, do[None])

        for name, fn in (("prototype", proto), ("library varlen (Triton)", lib), ("one sequence (Gluon)", one)):
            lines += [f"### causal={causal}: {name}", "", "| kernel | launches | ms |", "|---|---|---|"]
            for kname, cnt, ms in kernel_table(fn):
                lines.append(f"| `{kname[:90]}` | {cnt:.0f} | {ms:.3f} |")
            lines.append("")
            print("\n".join(lines[-14:]), flush=True)


def _resources(cubin: bytes) -> str:
    """'REG / STACK / LOCAL' of a cubin (cuobjdump bundled with Triton)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    got = [re.search(rf"{key}:(\d+)", res) for key in ("REG", "STACK", "LOCAL")]
    return " / ".join(m.group(1) if m else "?" for m in got)


ONES_FWD = ("R", "HKV")  # int arguments that users' calls set to 1 (Triton then passes a constexpr)
ONES_BWD = ("R", "HKV", "NE", "REP", "NI")


def _dump_sass(sass_dir: str | None, name: str, cubin: bytes) -> None:
    """``name``.sass in ``sass_dir`` (cuobjdump -sass of the cubin), if given."""
    if not sass_dir:
        return
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    os.makedirs(sass_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    with open(os.path.join(sass_dir, re.sub(r"[^A-Za-z0-9=_.-]+", "_", name) + ".sass"), "w") as f:
        f.write(sass)


def _compile_variant(kern, sig: dict, consts: dict, attrs: dict, ones: tuple, name: str, prefix: str,
                     maxnreg: int, scratch: int, sass_dir: str | None, lines: list[str]) -> bool:
    """Compile ``kern`` for sm_90 with the int arguments ``ones`` passed as constexpr 1 (as
    Triton passes an int equal to 1: r = 1, MQA, one entry); a table row in ``lines``; True when
    it compiled with ``scratch`` bytes of global scratch a program and no stack or local memory
    (spills). Its SASS goes to ``sass_dir`` (as ``prefix`` + the variant's name)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sg, cs = {**sig, **{n: "constexpr" for n in ones}}, {**consts, **dict.fromkeys(ones, 1)}
    vname = name + (" (" + ", ".join(n + "=1" for n in ones) + ")" if ones else "")
    try:
        ck = triton.compile(GluonASTSource(kern, sg, cs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": maxnreg})  # fmt: skip
    except Exception as e:  # noqa: BLE001
        lines.append(f"| {vname} | compile FAILED: {type(e).__name__}: {str(e)[:300]} | | |")
        print(lines[-1], flush=True)
        return False
    _dump_sass(sass_dir, prefix + vname, ck.asm["cubin"])
    md = ck.metadata
    res = _resources(ck.asm["cubin"])
    lines.append(f"| {vname} | {md.shared} | {md.global_scratch_size} | {res} |")
    print(lines[-1], flush=True)
    return res.endswith("/ 0 / 0") and md.global_scratch_size == scratch


def compile_only(lines: list[str], sass_dir: str | None = None) -> bool:
    """Compile the variants for sm_90 without a GPU (Triton 3.6): shared memory and scratch."""
    import triton

    lines += [f"## sm_90 compile (CPU, triton {triton.__version__})", "",
              "| variant | shared bytes | global scratch bytes / program | regs / stack / local |", "|---|---|---|---|"]  # fmt: skip
    ok = F.BM == PROGRAM_ROWS
    if not ok:
        lines.append(f"PROGRAM_ROWS {PROGRAM_ROWS} != gluon_fwd_kernel.BM {F.BM}")
    for dt, gdt in (("bf16", gl.bfloat16), ("fp16", gl.float16)):
        for d in (128, 64):
            for causal, first, comp in ((False, True, False), (False, False, True), (True, True, True),
                                        (True, False, True)):  # fmt: skip
                name = f"{dt} D={d} causal={causal} first={first} comp={comp}"
                sig = {n: f"*{dt}" for n in ("Q", "K", "V", "O", "LO")}
                sig.update({"LSE": "*fp32", "ENT_P0": "*i32", "ENT_W": "*i32", "LIMIT": "*i32", "qk_scale": "fp32"})
                sig.update({n: "i32" for n in ("TOTAL", "SNQ", "SNK", "R", "H", "HKV")})
                consts = {"q_layout": gl.NVMMASharedLayout.get_default_for([1, F.WG_M, 1, d], gdt),
                          "kv_layout": gl.NVMMASharedLayout.get_default_for([1, gluon_fwd.KV_BN, 1, d], gdt),
                          "BN": gluon_fwd.KV_BN, "D": d, "STAGES": gluon_fwd.stages(d), "CAUSAL": causal,
                          "FIRST": first, "COMP": comp, "STORE_LO": comp, "PART": 2 if causal and not first else 0,
                          "CONSUMER_REGS": gluon_fwd.CONSUMER_REGS, "LOADER_REGS": gluon_fwd.LOADER_REGS}  # fmt: skip
                sig.update({n: "constexpr" for n in consts})
                attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
                for ones in ((), ONES_FWD) if dt == "bf16" else ((),):
                    ok &= _compile_variant(gluon_fwd_varlen_kernel, sig, consts, attrs, ones, name, "fwd ",
                                           gluon_fwd.MAXNREG, SCRATCH_PER_PROGRAM, sass_dir, lines)  # fmt: skip
    # the backward kernels
    row_lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    for dt, gdt in (("bf16", gl.bfloat16), ("fp16", gl.float16)):
        for d in (128, 64):
            for causal, add in ((False, True), (True, False), (True, True)):
                lay = lambda rows: gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], gdt)  # noqa: E731, B023
                regs = dict(CONSUMER_REGS=gluon_bwd.CONSUMER_REGS, LOADER_REGS=gluon_bwd.LOADER_REGS)
                bn = gluon_bwd.dq_bn(d)
                kv_sig = {n: f"*{dt}" for n in ("Q", "DO", "K", "V")}
                kv_sig.update({"l_desc": f"tensordesc<fp32[{BK.BMQ}],{row_lay!r}>",
                               "dl_desc": f"tensordesc<fp32[{BK.BMQ}],{row_lay!r}>", "DK": "*fp32",
                               "DV": "*fp32", "ENT_P0": "*i32", "ENT_W": "*i32", "LIMIT": "*i32",
                               "qk_scale": "fp32", "sm_scale": "fp32"})  # fmt: skip
                kv_sig.update({n: "i32" for n in ("NE", "NNB", "R", "H", "HKV", "REP", "NI", "LP", "SNQ", "SNK")})
                kv_c = {"q_layout": lay(BK.BMQ), "kv_layout": lay(BK.WG_M), "BMQ": BK.BMQ, "D": d,
                        "STAGES": gluon_bwd.kv_stages(d), "CAUSAL": causal, "ADD": add, "PART": 2 if add else 0,
                        **regs}  # fmt: skip
                q_sig = {n: f"*{dt}" for n in ("Q", "DO", "K", "V")}
                q_sig.update({"DQ": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "ENT_P0": "*i32", "ENT_W": "*i32",
                              "LIMIT": "*i32", "qk_scale": "fp32", "sm_scale": "fp32"})  # fmt: skip
                q_sig.update({n: "i32" for n in ("NE", "NMB", "R", "H", "HKV", "LP", "SNQ", "SNK")})
                q_c = {"q_layout": lay(BK.WG_M), "kv_layout": lay(bn), "BN": bn, "D": d,
                       "STAGES": gluon_bwd.DQ_STAGES, "CAUSAL": causal, "ADD": add, "PART": 2 if add else 0,
                       **regs}  # fmt: skip
                for kname, kern, sig, consts in (("dkdv", dkdv_varlen_kernel, kv_sig, kv_c),
                                                 ("dq", dq_varlen_kernel, q_sig, q_c)):  # fmt: skip
                    name = f"{kname} {dt} D={d} causal={causal} add={add}"
                    sig = {**sig, **{n: "constexpr" for n in consts}}
                    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
                    for ones in ((), tuple(n for n in ONES_BWD if n in sig)) if dt == "bf16" else ((),):
                        ok &= _compile_variant(kern, sig, consts, attrs, ones, name, "", gluon_bwd.MAXNREG,
                                               4 * 128, sass_dir, lines)  # fmt: skip
    ok &= _compile_host_descriptor_kernels(lines, sass_dir)
    lines.append("")
    return ok


def _compile_host_descriptor_kernels(lines: list[str], sass_dir: str | None) -> bool:
    """The ``*_hd_kernel``s (descriptors made on the host over the whole stream): no global
    scratch, no spills."""
    row_lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    ok = True
    for dt, gdt in (("bf16", gl.bfloat16), ("fp16", gl.float16)):
        for d in (128, 64):
            lay = lambda rows: gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], gdt)  # noqa: E731, B023
            desc = lambda rows: f"tensordesc<{dt}[1,{rows},1,{d}],{lay(rows)!r}>"  # noqa: E731, B023
            for causal, first, comp in ((False, True, False), (False, False, True), (True, False, True)):
                sig = {"q_desc": desc(F.WG_M), "k_desc": desc(gluon_fwd.KV_BN), "v_desc": desc(gluon_fwd.KV_BN),
                       "o_desc": desc(F.WG_M), "lo_desc": desc(F.WG_M), "O": f"*{dt}", "LO": f"*{dt}",
                       "LSE": "*fp32", "ENT_P0": "*i32", "ENT_W": "*i32", "LIMIT": "*i32", "qk_scale": "fp32"}  # fmt: skip
                sig.update({n: "i32" for n in ("TOTAL", "SNQ", "R", "H", "HKV")})
                consts = {"BN": gluon_fwd.KV_BN, "D": d, "STAGES": gluon_fwd.stages(d), "CAUSAL": causal,
                          "FIRST": first, "COMP": comp, "STORE_LO": comp, "PART": 1 if causal else 0,
                          "CONSUMER_REGS": gluon_fwd.CONSUMER_REGS, "LOADER_REGS": gluon_fwd.LOADER_REGS}  # fmt: skip
                sig.update({n: "constexpr" for n in consts})
                attrs = {(i,): [["tt.divisibility", 16]] for i in (5, 6, 7, 8, 9)}
                for ones in ((), ONES_FWD) if (dt, d) == ("bf16", 128) else ((),):
                    ok &= _compile_variant(gluon_fwd_varlen_hd_kernel, sig, consts, attrs, ones,
                                           f"{dt} D={d} causal={causal} first={first} comp={comp}", "fwd_hd ",
                                           gluon_fwd.MAXNREG, 0, sass_dir, lines)  # fmt: skip
            bn = gluon_bwd.dq_bn(d)
            regs = dict(CONSUMER_REGS=gluon_bwd.CONSUMER_REGS, LOADER_REGS=gluon_bwd.LOADER_REGS)
            for causal, add in ((False, True), (True, False)):
                kv_sig = {"q_desc": desc(BK.BMQ), "do_desc": desc(BK.BMQ), "k_desc": desc(BK.WG_M),
                          "v_desc": desc(BK.WG_M), "l_desc": f"tensordesc<fp32[{BK.BMQ}],{row_lay!r}>",
                          "dl_desc": f"tensordesc<fp32[{BK.BMQ}],{row_lay!r}>", "DK": "*fp32", "DV": "*fp32",
                          "ENT_P0": "*i32", "ENT_W": "*i32", "LIMIT": "*i32", "qk_scale": "fp32",
                          "sm_scale": "fp32"}  # fmt: skip
                kv_sig.update({n: "i32" for n in ("NE", "NNB", "R", "H", "HKV", "REP", "NI", "LP")})
                kv_c = {"BMQ": BK.BMQ, "D": d, "STAGES": gluon_bwd.kv_stages(d), "CAUSAL": causal, "ADD": add,
                        "PART": 1 if add else 0, **regs}  # fmt: skip
                q_sig = {"q_desc": desc(BK.WG_M), "do_desc": desc(BK.WG_M), "k_desc": desc(bn), "v_desc": desc(bn),
                         "DQ": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "ENT_P0": "*i32", "ENT_W": "*i32",
                         "LIMIT": "*i32", "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
                q_sig.update({n: "i32" for n in ("NE", "NMB", "R", "H", "HKV", "LP")})
                q_c = {"BN": bn, "D": d, "STAGES": gluon_bwd.DQ_STAGES, "CAUSAL": causal, "ADD": add,
                       "PART": 1 if add else 0, **regs}  # fmt: skip
                for kname, kern, sig, consts, div in (("dkdv_hd", dkdv_varlen_hd_kernel, kv_sig, kv_c, (6, 7, 8, 9)),
                                                      ("dq_hd", dq_varlen_hd_kernel, q_sig, q_c, (4, 5, 6, 7, 8))):  # fmt: skip
                    sig = {**sig, **{n: "constexpr" for n in consts}}
                    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
                    for ones in ((), tuple(n for n in ONES_BWD if n in sig)) if (dt, d) == ("bf16", 128) else ((),):
                        ok &= _compile_variant(kern, sig, consts, attrs, ones, f"{kname} {dt} D={d} causal={causal} add={add}",
                                               "", gluon_bwd.MAXNREG, 0, sass_dir, lines)  # fmt: skip
    return ok


def env_problem() -> str | None:
    if _IMPORT_ERROR is not None:
        return f"Gluon's Hopper module does not import: {_IMPORT_ERROR}"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm_90 GPU"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="against the float64 reference (GPU)")
    ap.add_argument("--bench", action="store_true", help="the issue's packed batch, forward (GPU)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--profile", action="store_true",
                    help="the packed batch's forward+backward per kernel (torch.profiler): prototype, library, one sequence")  # fmt: skip
    ap.add_argument("--ceiling", action="store_true",
                    help="--bench: also the packed batch's and the one sequence's blocks on dense SDPA")  # fmt: skip
    ap.add_argument("--out", default=None, help="write the markdown report here (rewritten after each check case)")
    ap.add_argument("--sass", default=None,
                    help="with --compile-only: each variant's SASS in this folder (diff two dumps to check a refactor)")  # fmt: skip
    ap.add_argument("--dtypes", default="bfloat16,float16", help="--check: these dtypes (comma-separated)")
    args = ap.parse_args(argv)
    try:
        dtypes = tuple(getattr(torch, n) for n in args.dtypes.split(",") if n)
    except AttributeError as e:
        ap.error(f"--dtypes {args.dtypes!r}: {e}")
    if not dtypes or any(dt not in (torch.bfloat16, torch.float16) for dt in dtypes):
        ap.error(f"--dtypes {args.dtypes!r}: give bfloat16 and/or float16")
    if not (args.check or args.bench or args.compile_only or args.profile):
        ap.error("give --check, --bench, --profile and/or --compile-only")
    lines = ["# Prototype: the Gluon kernels over packed documents (issue 22 item 2b)", "",
             f"`{' '.join(sys.argv)}`", ""]  # fmt: skip
    if _IMPORT_ERROR is not None:
        print(f"Gluon is missing: {_IMPORT_ERROR}", file=sys.stderr)
        return 2
    rc = 0
    if args.compile_only:
        rc |= 0 if compile_only(lines, args.sass) else 1
    if args.check or args.bench or args.profile:
        why = env_problem()
        if why is not None:
            print(f"gluon_varlen.py: {why}", file=sys.stderr)
            return 2
        from dilated_attention.timing import results_header

        lines[:1] = results_header("Prototype: the Gluon kernels over packed documents (issue 22 item 2b)",
                                   torch.device("cuda"), "python3 " + " ".join(sys.argv))[:6]
        lines.append("")
        if args.check:
            rc |= 0 if check(torch.device("cuda"), lines, dtypes, lambda: _write(args.out, lines)) else 1
        if args.bench:
            bench(torch.device("cuda"), lines, args.ceiling)
            _write(args.out, lines)
        if args.profile:
            profile(torch.device("cuda"), lines)
    _write(args.out, lines)
    return rc


def _write(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
