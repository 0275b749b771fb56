"""Sweep: every available impl and dense SDPA, in the same run, over >= 20 configurations (issue 19).

Each row times ``impl="torch"``, ``impl="triton"`` (where it can run) and dense SDPA on the same
inputs: forward (no grad) and forward+backward, useful TF/s (``dilated_attention.flops``:
dilated_flops for the dilated impls, dense_flops for SDPA; fwd+bwd = 3.5 x forward), peak memory
of forward+backward and its ratio to the bytes of q, k, v, out, dout, dq, dk, dv, which impl the
library's ``auto`` picks and which impl the proposed rule (kernels/auto_rule.py) picks. On the
headline shape (B=1, 16 x 128, LongNet 5 branches, N=131072) it also times the peers of
benchmarks/peers.py (FlexAttention, torchscale-style per-branch flash + exact LSE merge).

Timing: CUDA events, warmup 1 forward and 1 forward+backward call (they also compile the Triton
kernels and the compiled FlexAttention), then
``--iters`` timed calls (2 when one call is estimated above 150 ms), median reported. Dense SDPA
runs with k, v repeated to the query heads (the same FLOPs as GQA) and the math backend disabled
(an N x N fallback would not fit); for N >= 512K it is timed forward only (1 warmup call, which
absorbs the per-shape setup, and 1 timed call), and its fwd+bwd rate is taken from another row with the same head dim and
causality (same dtype and heads preferred; marked ``*``). A row is skipped (and says so) when the
elapsed time plus its estimated time passes ``--budget-s``; results are written after every row.

    PYTHONPATH=src python3 benchmarks/sweep.py --out benchmarks/results --name sweep_h100_DATE
    PYTHONPATH=src python3 benchmarks/sweep.py --tiny --out /tmp/sweep_tiny      # CPU, seconds
    python3 benchmarks/sweep.py --plan                    # the rows and estimated GPU seconds
    python3 benchmarks/sweep.py --rule-report DIR/sweep.json   # rule vs fastest per row
    python3 benchmarks/sweep.py --emit-table DIR/sweep.json    # MEASURED for auto_rule.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.flops import dense_flops, dilated_flops
from dilated_attention.kernels import auto_rule

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import command_line, median_ms, results_header, run_info  # noqa: E402


class Row(NamedTuple):
    name: str
    batch: int
    seqlen: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str
    seg: tuple[int, ...]
    dil: tuple[int, ...]
    causal: bool


def _geo(w0, nb, r):
    return tuple(w0 * 2**i for i in range(nb)), tuple(r)


LONGNET5 = _geo(2048, 5, (1, 2, 4, 8, 16))
PAPER5 = _geo(2048, 5, (1, 2, 4, 6, 12))

# name, B, N, H, Hkv, D, dtype, (seg, dil), causal. Ordered by priority: rows past the budget
# are skipped, so the issue's six configurations come first.
ROWS = [
    Row("headline", 1, 131072, 16, 16, 128, "bf16", *LONGNET5, False),
    Row("headline-causal", 1, 131072, 16, 16, 128, "bf16", *LONGNET5, True),
    Row("gqa32x8-causal", 1, 131072, 32, 8, 128, "bf16", *LONGNET5, True),
    Row("b8-16k-4br-causal", 8, 16384, 16, 16, 128, "bf16", *_geo(2048, 4, (1, 2, 4, 8)), True),
    Row("b2-64k-7br-r64", 2, 65536, 16, 16, 128, "bf16", *_geo(1024, 7, (1, 2, 4, 8, 16, 32, 64)), False),
    Row("3br-w64k", 1, 131072, 16, 16, 128, "bf16", (4096, 16384, 65536), (1, 4, 16), False),
    Row("paper-r6-12", 1, 131072, 16, 16, 128, "bf16", *PAPER5, False),
    Row("paper-r6-12-causal-fp16", 2, 65536, 32, 8, 128, "fp16", *PAPER5, True),
    Row("n100000-causal", 1, 100000, 16, 16, 128, "bf16", *LONGNET5, True),
    Row("b8-16k-mqa-d64-w8k", 8, 16384, 16, 1, 64, "bf16", (2048, 4096, 8192), (1, 2, 4), False),
    Row("b4-32k-r3-12-d64-fp16", 4, 32768, 16, 8, 64, "fp16", (4096, 8192, 16384, 32768), (1, 3, 6, 12), True),
    Row("256k-6br", 1, 262144, 16, 16, 128, "bf16", *_geo(2048, 6, (1, 2, 4, 8, 16, 32)), False),
    Row("8br-wN-32x8", 1, 131072, 32, 8, 128, "bf16", *_geo(1024, 8, (1, 2, 4, 8, 16, 32, 64, 64)), False),
    Row("8br-paper-d64-fp16-causal", 2, 65536, 16, 16, 64, "fp16",
        *_geo(512, 8, (1, 1, 2, 4, 6, 12, 24, 48)), True),
    Row("w%r-r64-n65536", 1, 65536, 16, 16, 128, "bf16", (3000, 6000, 12500, 25000, 50000),
        (1, 3, 6, 12, 64), False),
    Row("b8-16k-32x8-fp16", 8, 16384, 32, 8, 128, "fp16", *_geo(2048, 4, (1, 2, 4, 8)), False),
    Row("b4-32k-32x16-causal", 4, 32768, 32, 16, 128, "bf16", *_geo(2048, 4, (1, 2, 4, 8)), True),
    Row("b2-128k-16x8-d64-fp16", 2, 131072, 16, 8, 64, "fp16", *LONGNET5, False),
    Row("192k-32x1-causal", 1, 196608, 32, 1, 128, "bf16", (8192, 32768, 131072), (1, 6, 12), True),
    Row("b2-48k-r12-w%r", 2, 49152, 16, 16, 128, "bf16", (2048, 6144, 12288, 24576), (1, 4, 6, 12), False),
    # batch > 1 with a short last segment (24576 % 16384): the Gluon kernels launch each entry
    # apart (gluon_fwd.TAIL_BATCHES, 2026-11-29)
    Row("b4-24k-tail-gqa-causal", 4, 24576, 16, 4, 128, "bf16", *_geo(2048, 4, (1, 2, 4, 8)), True),
    Row("512k-mqa-d64-causal", 1, 524288, 16, 1, 64, "bf16", *_geo(4096, 5, (1, 2, 4, 8, 16)), True),
    Row("1m-mqa-d64-causal", 1, 1048576, 16, 1, 64, "bf16", *_geo(8192, 5, (1, 2, 4, 8, 16)), True),
    # LongNet 'base' attention calls of issue 23's end-to-end rows (12 heads x 64, causal)
    Row("base-b4-8k-d64-causal", 4, 8192, 12, 12, 64, "bf16", *_geo(2048, 3, (1, 2, 4)), True),
    Row("base-b2-16k-d64-causal", 2, 16384, 12, 12, 64, "bf16", *_geo(2048, 4, (1, 2, 4, 8)), True),
]
HEADLINE = "headline"
# Rows for A/B scripts (split_ab.py, gluon_ab.py) that are not sweep configurations: head dim 64
# with every block shorter than gluon_fwd.D64_MIN_BLOCK rows, where the Triton kernels run on
# Hopper too (triton_launch.SHORT_D64), beside the one such sweep row (8br-paper-d64-fp16-causal)
AB_ROWS = [
    Row("8br-paper-d64-fp16", 2, 65536, 16, 16, 64, "fp16", *_geo(512, 8, (1, 1, 2, 4, 6, 12, 24, 48)), False),
    Row("b8-16k-d64-w512-causal", 8, 16384, 12, 12, 64, "bf16", (512, 1024, 2048), (1, 2, 4), True),
    Row("b8-16k-d64-w512", 8, 16384, 12, 12, 64, "bf16", (512, 1024, 2048), (1, 2, 4), False),
    Row("b4-32k-gqa-d64-w1k-causal", 4, 32768, 16, 4, 64, "bf16", *_geo(1024, 4, (1, 2, 4, 8)), True),
]


def rows_named(names) -> list[Row]:
    """The rows of :data:`ROWS` (and :data:`AB_ROWS`) called ``names``, in that order; ValueError
    naming the unknown ones and the known ones (every script that takes ``--rows`` asks this)."""
    known = {r.name: r for r in ROWS + AB_ROWS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]
DENSE_FWD_ONLY_N = 524288
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# rough rates (TF/s) for --plan and the iteration choice only; never reported
_RATE = {"fwd": 200e12, "fb": 150e12, "dense_fwd": 600e12, "dense_fb": 520e12}


def tiny_row(r: Row) -> Row:
    """The same structure at CPU size: N and w / 1024 (w >= r), 4 query heads (GQA ratio kept
    up to 4), head dim 16, batch <= 2, float32."""
    f = 1024
    n = max(64, r.seqlen // f)
    seg = tuple(max(d, w // f) for w, d in zip(r.seg, r.dil, strict=True))
    rep = min(4, r.nheads // r.nheads_kv)
    return r._replace(batch=min(r.batch, 2), seqlen=n, nheads=4, nheads_kv=4 // rep, headdim=16,
                      dtype="fp32", seg=seg)


def flops(r: Row, backward=False) -> float:
    return dilated_flops(r.batch, r.seqlen, r.seqlen, r.nheads, r.headdim, r.seg, r.dil, r.causal,
                         backward=backward)


def dflops(r: Row, backward=False) -> float:
    return dense_flops(r.batch, r.seqlen, r.nheads, r.headdim, r.causal, backward=backward)


def estimate_s(r: Row, iters: int = 3) -> float:
    """Rough GPU seconds of one row (2 dilated impls + dense), for planning only."""
    fwd, fb = flops(r) / _RATE["fwd"], flops(r, True) / _RATE["fb"]
    it = 2 if fb > 0.15 else iters
    dil = 2 * (1 + it) * (fwd + fb)  # torch and triton: warmup fwd + fwd+bwd, then timed
    dfwd, dfb = dflops(r) / _RATE["dense_fwd"], dflops(r, True) / _RATE["dense_fb"]
    if r.seqlen >= DENSE_FWD_ONLY_N:
        dense = 2 * dfwd  # warmup + 1 timed call
    else:
        dit = 1 if dfb > 0.5 else (2 if dfb > 0.15 else iters)
        dense = (1 + dit) * (dfwd + dfb)
    return dil + dense + 0.5  # allocation, randn, empty_cache


# ------------------------------------------------------------------------------------ timing
class Timer:
    """The shared timer (common.median_ms: CUDA events on a GPU, perf_counter on the CPU) bound
    to this run's device; no warmup here (measure() warms up once itself)."""

    def __init__(self, device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self, fn, iters: int) -> float:
        """Median ms of ``iters`` calls."""
        return median_ms(fn, self.device, 0, iters)


def _empty_cache(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return None


def eight_tensor_bytes(r: Row) -> int:
    """Bytes of q, k, v, out, dout, dq, dk, dv (k, v, dk, dv at the kv heads)."""
    es = torch.empty((), dtype=_DT.get(r.dtype, torch.float32)).element_size()
    qn = r.batch * r.seqlen * r.nheads * r.headdim
    kn = r.batch * r.seqlen * r.nheads_kv * r.headdim
    return es * (4 * qn + 4 * kn)


def measure(fn_fwd, inputs, do, timer, dev, iters, fwd_only=False, warm=None):
    """{fwd_ms, fb_ms, peak, ...}: warm (one fwd and one fwd+bwd, or ``warm()``), forward under no_grad,
    forward+backward with autograd.grad; peak memory over the timed fwd+bwd calls."""
    res = {}

    def fb():
        out = fn_fwd()
        torch.autograd.grad(out, inputs, do)

    def fwd():
        with torch.no_grad():
            fn_fwd()

    # warm every mode that is timed: a compiled callee (FlexAttention) traces no_grad and
    # grad calls separately, and the first call compiles the Triton kernels
    if warm is not None:
        warm()
    else:
        fwd()
        if not fwd_only:
            fb()
    timer.sync()
    res["fwd_ms"] = timer.time(fwd, iters)
    if fwd_only:
        return res
    _reset_peak(dev)
    res["fb_ms"] = timer.time(fb, iters)
    res["peak"] = _peak(dev)
    return res


def library_auto(q, k, r: Row, requires_grad: bool, dropout_p=0.0) -> str:
    """What the library's single-device selection picks for impl='auto' on a call of row ``r``
    (its branches, causal flag and whether gradients are needed: the measured rule needs them;
    without the branches the selection always answers "triton")."""
    from dilated_attention.kernels.select import pick_impl

    return pick_impl("auto", q, k, dropout_p, causal=r.causal, segment_lengths=tuple(r.seg),
                     dilation_rates=tuple(r.dil), requires_grad=requires_grad)


def triton_reason(q, k):
    from dilated_attention.kernels.select import triton_unavailable_reason

    return triton_unavailable_reason(q, k)


def call_shape(r: Row, requires_grad: bool) -> auto_rule.CallShape:
    return auto_rule.CallShape(r.batch, r.seqlen, r.nheads, r.nheads_kv, r.headdim, r.dtype,
                               tuple(zip(r.seg, r.dil, strict=True)), r.causal, requires_grad, 0.0)


def _err(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "OOM"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def run_row(r: Row, dev, timer, args) -> dict:
    dt = _DT[r.dtype]
    res = {"row": r._asdict(), "impls": {}}
    est_fb = flops(r, True) / _RATE["fb"]
    iters = 2 if (est_fb > 0.15 and dev.type == "cuda") else args.iters
    q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device=dev, dtype=dt)
    k = torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    res["auto_library"] = library_auto(q, k, r, True)  # a training call (judged by fwd+bwd)
    res["auto_library_fwd"] = library_auto(q, k, r, False)
    reason = triton_reason(q, k)
    triton_ok = reason is None
    res["triton_unavailable"] = reason
    res["auto_rule_fwd"] = auto_rule.choose_impl(call_shape(r, False), triton_ok)
    res["auto_rule_fb"] = auto_rule.choose_impl(call_shape(r, True), triton_ok)
    impls = [i for i in ["torch"] + (["triton"] if triton_ok else []) if i in args.impls]
    eight = eight_tensor_bytes(r)
    for impl in impls:
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        try:
            m = measure(lambda xs=xs, impl=impl: dilated_attention(
                *xs, r.seg, r.dil, causal=r.causal, impl=impl), xs, do, timer, dev, iters)
            m["fwd_tf"] = flops(r) / m["fwd_ms"] / 1e9
            m["fb_tf"] = flops(r, True) / m["fb_ms"] / 1e9
            if m.get("peak") is not None:
                m["mem_ratio"] = m["peak"] / eight
        except Exception as e:  # report the row, keep sweeping
            m = {"error": _err(e)}
        del xs
        _empty_cache(dev)
        res["impls"][impl] = m
        print(f"  {r.name:28} {impl:8} {_fmt(m)}", flush=True)
    res["impls"]["dense"] = run_dense(r, q, k, v, do, dev, timer, args)
    print(f"  {r.name:28} {'dense':8} {_fmt(res['impls']['dense'])}", flush=True)
    del q, k, v, do
    _empty_cache(dev)
    return res


def run_dense(r: Row, q, k, v, do, dev, timer, args) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = r.nheads // r.nheads_kv
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backends.insert(0, SDPBackend.CUDNN_ATTENTION)
    if dev.type == "cpu":
        backends.append(SDPBackend.MATH)  # tiny sizes only
    m: dict = {}
    try:
        qt = q.transpose(1, 2).detach().requires_grad_()
        kt = k.repeat_interleave(rep, dim=2).transpose(1, 2).detach().requires_grad_()
        vt = v.repeat_interleave(rep, dim=2).transpose(1, 2).detach().requires_grad_()
        dot = do.transpose(1, 2)
        fwd_only = r.seqlen >= DENSE_FWD_ONLY_N
        est_fb = dflops(r, True) / _RATE["dense_fb"]
        iters = 1 if fwd_only else (1 if est_fb > 0.5 else (2 if est_fb > 0.15 else args.iters))
        if dev.type == "cpu":
            iters = args.iters

        def fn():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=r.causal)

        with sdpa_kernel(backends):
            m = measure(fn, (qt, kt, vt), dot, timer, dev, iters, fwd_only=fwd_only)
        m["iters"] = iters
        m["fwd_tf"] = dflops(r) / m["fwd_ms"] / 1e9
        if "fb_ms" in m:
            m["fb_tf"] = dflops(r, True) / m["fb_ms"] / 1e9
        else:
            m["note"] = f"N >= {DENSE_FWD_ONLY_N}: forward only"
    except Exception as e:
        m = {"error": _err(e)}
    _empty_cache(dev)
    return m


def run_peers(r: Row, dev, timer, args) -> dict:
    """FlexAttention and the torchscale-style peer on row r (inputs of the row's shape)."""
    import peers

    dt = _DT[r.dtype]
    out = {}
    q = torch.randn(r.batch, r.seqlen, r.nheads, r.headdim, device=dev, dtype=dt)
    k = torch.randn(r.batch, r.seqlen, r.nheads_kv, r.headdim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    eight = eight_tensor_bytes(r)
    iters = 2 if dev.type == "cuda" else args.iters
    # FlexAttention: compiled on CUDA; eager forward only on the CPU (no CPU backward)
    try:
        from torch.nn.attention.flex_attention import flex_attention

        t0 = time.perf_counter()
        bs = 128 if dev.type == "cuda" else 32
        bm = peers.flex_block_mask(r.seqlen, r.seg, bs, r.causal, dev)
        sm = peers.multiplicity_score_mod(r.seg, r.dil, r.nheads, r.causal)
        fn = torch.compile(flex_attention, dynamic=False) if dev.type == "cuda" else flex_attention
        xs = [t.detach().requires_grad_(dev.type == "cuda") for t in (q, k, v)]

        def flex():
            return peers.flex_dilated_attention(*xs, r.seg, r.dil, causal=r.causal, block_mask=bm,
                                                score_mod=sm, flex_fn=fn, block_size=bs)

        m = measure(flex, xs, do, timer, dev, iters, fwd_only=dev.type != "cuda")
        m["setup_s"] = time.perf_counter() - t0  # block mask + compile + timing
        m["block_density"] = float(peers.segment_block_mask_dense(r.seqlen, r.seg, bs, r.causal).float().mean())
        m["fwd_tf"] = flops(r) / m["fwd_ms"] / 1e9
        if "fb_ms" in m:
            m["fb_tf"] = flops(r, True) / m["fb_ms"] / 1e9
            if m.get("peak") is not None:
                m["mem_ratio"] = m["peak"] / eight
        else:
            m["note"] = "forward only (FlexAttention has no CPU backward)"
        del xs, bm
    except Exception as e:
        m = {"error": _err(e)}
    _empty_cache(dev)
    out["flex"] = m
    print(f"  {r.name:28} {'flex':8} {_fmt(m)}", flush=True)
    try:
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        m = measure(lambda: peers.torchscale_dilated_attention(*xs, r.seg, r.dil, causal=r.causal),
                    xs, do, timer, dev, iters)
        m["fwd_tf"] = flops(r) / m["fwd_ms"] / 1e9
        m["fb_tf"] = flops(r, True) / m["fb_ms"] / 1e9
        if m.get("peak") is not None:
            m["mem_ratio"] = m["peak"] / eight
        del xs
    except Exception as e:
        m = {"error": _err(e)}
    _empty_cache(dev)
    out["torchscale"] = m
    print(f"  {r.name:28} {'tscale':8} {_fmt(m)}", flush=True)
    return out


def _fmt(m: dict) -> str:
    if "error" in m:
        return m["error"]
    s = f"fwd {m['fwd_ms']:8.2f} ms {m['fwd_tf']:6.0f} TF/s"
    if "fb_ms" in m:
        s += f" | fwd+bwd {m['fb_ms']:8.2f} ms {m['fb_tf']:6.0f} TF/s"
    if m.get("mem_ratio") is not None:
        s += f" | peak {m['peak'] / 2**30:6.2f} GiB ({m['mem_ratio']:.2f}x)"
    return s


# ------------------------------------------------------------------------- dense fill-in
def dense_reference(results: list[dict], i: int) -> tuple[float | None, float | None, str]:
    """(dense fwd TF/s, dense fwd+bwd TF/s, mark) for row i: its own, or, for a forward-only
    dense row, the fwd+bwd rate of another row with the same head dim and causality (dense
    TF/s is nearly flat in N): preferring the same dtype, then the same heads, then the largest
    N; mark "*"."""
    d = results[i]["impls"].get("dense", {})
    fwd, fb = d.get("fwd_tf"), d.get("fb_tf")
    if fb is not None or fwd is None:
        return fwd, fb, ""
    r = results[i]["row"]
    best = None
    for j, o in enumerate(results):
        ro, od = o["row"], o.get("impls", {}).get("dense", {})
        if j == i or od.get("fb_tf") is None or (ro["headdim"], ro["causal"]) != (r["headdim"], r["causal"]):
            continue
        key = (ro["dtype"] == r["dtype"], ro["nheads"] == r["nheads"], ro["seqlen"])
        if best is None or key > best[0]:
            best = (key, od["fb_tf"])
    return fwd, (best[1] if best else None), ("*" if best else "")


# ------------------------------------------------------------------------- rule evaluation
def measured_from_results(results: list[dict]) -> tuple[auto_rule.Measured, ...]:
    """Two entries per completed row: forward-only (fwd ms) and training (fwd+bwd ms)."""
    table = []
    for res in results:
        r = Row(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in res["row"].items()})
        for grad, key in ((False, "fwd_ms"), (True, "fb_ms")):
            ms = tuple((impl, res["impls"].get(impl, {}).get(key)) for impl in ("torch", "triton"))
            if any(t is not None for _, t in ms):
                table.append(auto_rule.Measured(call_shape(r, grad), ms))
    return tuple(table)


def rule_report(results: list[dict]) -> tuple[str, int, int]:
    """Markdown table: per row and class, the fastest impl, the rule's pick with the full table
    and leave-one-out (the row's own entry removed), and whether each is within 5% of the
    fastest. Returns (text, rows within 5% with the full table, leave-one-out within 5%)."""
    table = measured_from_results(results)
    lines = ["| row | class | torch ms | triton ms | fastest | library auto | rule | rule LOO | "
             "rule <= 1.05x | LOO <= 1.05x |", "|---|---|---|---|---|---|---|---|---|---|"]
    ok = ok_loo = 0
    res_by = {}
    for res in results:
        res_by.setdefault(res["row"]["name"], res)
    for idx, m in enumerate(table):
        times = dict(m.ms)
        best = auto_rule.fastest(m)
        tbest = times[best]
        pick = auto_rule.choose_impl(m.shape, times.get("triton") is not None, table)
        loo = auto_rule.choose_impl(m.shape, times.get("triton") is not None, table[:idx] + table[idx + 1:])
        within = lambda impl: times.get(impl) is not None and times[impl] <= 1.05 * tbest  # noqa: E731
        ok += within(pick)
        ok_loo += within(loo)
        name = next((n for n, res in res_by.items() if call_shape(Row(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in res["row"].items()}), m.shape.requires_grad) == m.shape), "?")
        got = res_by.get(name, {})
        lib = got.get("auto_library", "?") if m.shape.requires_grad else got.get("auto_library_fwd", got.get("auto_library", "?"))
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(
            f"| {name} | {'fwd+bwd' if m.shape.requires_grad else 'fwd'} | {fmt(times.get('torch'))} | "
            f"{fmt(times.get('triton'))} | {best} | {lib}{'' if within(lib) else ' (slow)'} | {pick} | {loo} | "
            f"{'yes' if within(pick) else 'NO'} | {'yes' if within(loo) else 'NO'} |"
        )
    lines.append("")
    lines.append(f"rule within 5% of the fastest: {ok}/{len(table)} (full table), "
                 f"{ok_loo}/{len(table)} (leave-one-out)")
    return "\n".join(lines), ok, ok_loo


def emit_table(results: list[dict]) -> str:
    """Python source of ``MEASURED`` for kernels/auto_rule.py from a sweep's results."""
    out = ["MEASURED: tuple[Measured, ...] = ("]
    for m in measured_from_results(results):
        ms = tuple((i, None if t is None else round(t, 3)) for i, t in m.ms)
        out.append(f"    Measured(CallShape{tuple(m.shape)!r}, {ms!r}),")
    out.append(")")
    return "\n".join(out)


# ------------------------------------------------------------------------------- reporting
def _ratio(m):
    return "" if m.get("mem_ratio") is None else f"{m['mem_ratio']:.2f}"


def _pct(x, d):
    return "" if x is None or not d else f"{100 * x / d:.0f}%"


def markdown(results, peers_res, meta) -> str:
    lines = results_header("Dilated attention sweep: every impl and dense SDPA in the same run (issue 19)", info=meta, extra=[
        "useful TF/s (dilated_attention.flops: dilated_flops for the dilated impls and the peers, "
        "dense_flops for SDPA; fwd+bwd = 3.5 x forward); fwd timed under no_grad; median of the "
        "timed calls after 1 warmup (CUDA events); `% dense` = TF/s / dense SDPA TF/s of the same row",
        "dense SDPA: k, v repeated to the query heads, math backend off; for N >= "
        f"{DENSE_FWD_ONLY_N} forward only (1 timed call after 1 warmup call) and `*` = its fwd+bwd rate taken from "
        "another row with the same head dim and causality (same dtype, then heads, then largest N preferred)",
        "mem ratio = peak allocated during fwd+bwd / bytes of q, k, v, out, dout, dq, dk, dv",
        "auto: the library's `pick_impl('auto', ...)` and the proposed rule "
        "(kernels/auto_rule.py) for a forward-only / a training call",
        f"wall time of the sweep: {meta.get('wall_s', 0):.0f} s",
        *(["--gluon-even-only: branches with w % r != 0 and short last segments ran the Triton "
           "kernels (gluon_fwd.UNEVEN_BLOCKS, TAIL_SEGMENTS, TAIL_BATCHES and gluon_bwd.TAIL_SEGMENTS off; "
           "on by default since 2026-11-29)"]
          if meta.get("gluon_even_only") else []),
        *(["--gluon-bwd-tail: the Gluon backward also ran short last segments (gluon_bwd.TAIL_SEGMENTS; "
           "off by default before 2026-11-29's second session)"] if meta.get("gluon_bwd_tail") else []),
        *(["--gluon-split-phases: the Gluon backward ran every branch's dK/dV before its dQ "
           "(gluon_bwd.SPLIT_PHASES; off by default)"] if meta.get("gluon_split_phases") else []),
    ])
    lines += [
        "",
        "| row | B | N | H/Hkv | D | dtype | branches w; r | causal | impl | fwd ms | fwd TF/s | "
        "fwd % dense | fwd+bwd ms | fwd+bwd TF/s | fwd+bwd % dense | peak GiB | mem ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, res in enumerate(results):
        r = res["row"]
        if res.get("skipped"):
            lines.append(f"| {r['name']} | {r['batch']} | {r['seqlen']} | | | | | | skipped: {res['skipped']} "
                         "| | | | | | | | |")
            continue
        dfwd, dfb, mark = dense_reference(results, i)
        br = f"{','.join(map(str, r['seg']))}; {','.join(map(str, r['dil']))}"
        for impl, m in res["impls"].items():
            head = (f"| {r['name']} | {r['batch']} | {r['seqlen']} | {r['nheads']}/{r['nheads_kv']} | "
                    f"{r['headdim']} | {r['dtype']} | {br} | {r['causal']} | {impl} |")
            if "error" in m:
                lines.append(head + f" {m['error']} | | | | | | | |")
                continue
            pf = "" if impl == "dense" else _pct(m["fwd_tf"], dfwd)
            fb = m.get("fb_tf")
            pb = "" if impl == "dense" or fb is None else _pct(fb, dfb) + (mark if dfb else "")
            fbms = f"{m['fb_ms']:.2f}" if "fb_ms" in m else (m.get("note", "") if impl != "dense" else "fwd only")
            fbtf = f"{fb:.0f}" if fb is not None else (f"{dfb:.0f}{mark}" if impl == "dense" and dfb else "")
            peak = f"{m['peak'] / 2**30:.2f}" if m.get("peak") is not None else ""
            ratio = f"{m['mem_ratio']:.2f}" if m.get("mem_ratio") is not None else ""
            lines.append(head + f" {m['fwd_ms']:.2f} | {m['fwd_tf']:.0f} | {pf} | {fbms} | {fbtf} | {pb} | "
                         f"{peak} | {ratio} |")
    if peers_res:
        name, pres = peers_res["row"], peers_res["results"]
        hi = next(i for i, res in enumerate(results) if res["row"]["name"] == name)
        dfwd, dfb, _ = dense_reference(results, hi)
        ours = results[hi]["impls"]
        lines += ["", f"## Peers on `{name}` (same shape, same run)", "",
                  "| impl | fwd ms | fwd TF/s | fwd % dense | fwd+bwd ms | fwd+bwd TF/s | fwd+bwd % dense | "
                  "mem ratio | note |", "|---|---|---|---|---|---|---|---|---|"]
        for impl, m in list(ours.items()) + list(pres.items()):
            if impl == "dense":
                continue
            if "error" in m:
                lines.append(f"| {impl} | {m['error']} | | | | | | | |")
                continue
            note = m.get("note", "")
            if "block_density" in m:
                note = (note + "; " if note else "") + (f"block mask density {m['block_density']:.3f}, "
                                                        f"setup+compile {m['setup_s']:.0f} s")
            fb = m.get("fb_tf")
            fbms = f"{m['fb_ms']:.2f}" if "fb_ms" in m else ""
            fbtf = "" if fb is None else f"{fb:.0f}"
            lines.append(
                f"| {impl} | {m['fwd_ms']:.2f} | {m['fwd_tf']:.0f} | {_pct(m['fwd_tf'], dfwd)} | "
                f"{fbms} | {fbtf} | {_pct(fb, dfb)} | {_ratio(m)} | {note} |"
            )
    rep, _, _ = rule_report([r for r in results if not r.get("skipped")])
    lines += ["", "## auto: library pick and proposed rule vs the fastest impl per row", "", rep]
    return "\n".join(lines) + "\n"


def summary(results, peers_res) -> str:
    """The short table printed last."""
    lines = ["row                            dense f/fb   torch f/fb  triton f/fb   best/dense fb  auto lib/rule(fb)"]
    for i, res in enumerate(results):
        r = res["row"]
        if res.get("skipped"):
            lines.append(f"{r['name']:30} skipped ({res['skipped']})")
            continue
        dfwd, dfb, mark = dense_reference(results, i)
        cell = lambda m: "   n/a   " if not m else "   err   " if "error" in m else f"{m['fwd_tf']:4.0f}/{m.get('fb_tf') or 0:4.0f}"  # noqa: E731
        im = res["impls"]
        best = max(((m.get("fb_tf") or 0) for k, m in im.items() if k != "dense" and "error" not in m), default=0)
        dense = cell(im.get("dense")) if "error" not in im.get("dense", {}) else "   err   "
        if dfb and not im.get("dense", {}).get("fb_tf"):
            dense = f"{dfwd:4.0f}/{dfb:4.0f}{mark}"
        lines.append(f"{r['name']:30} {dense:11} {cell(im.get('torch')):11} {cell(im.get('triton')):11}  "
                     f"{_pct(best, dfb) + mark:>12}   {res['auto_library']}/{res['auto_rule_fb']}")
    if peers_res:
        for impl, m in peers_res["results"].items():
            lines.append(f"peer {impl:25} {'':11} {_fmt(m)}")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names, series = [], {}
    done = [(i, res) for i, res in enumerate(results) if not res.get("skipped")]
    for i, res in done:
        dfwd, dfb, _ = dense_reference(results, i)
        names.append(res["row"]["name"])
        for impl in ("torch", "triton"):
            m = res["impls"].get(impl, {})
            for key, d in (("fwd_tf", dfwd), ("fb_tf", dfb)):
                v = m.get(key)
                series.setdefault(f"{impl} {'fwd' if key == 'fwd_tf' else 'fwd+bwd'}", []).append(
                    v / d if (v and d) else 0.0)
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(names)), 5))
    width = 0.8 / max(1, len(series))
    for s_i, (label, vals) in enumerate(series.items()):
        ax.bar([x + s_i * width for x in range(len(names))], vals, width, label=label)
    ax.axhline(0.5, color="gray", lw=0.8, ls="--")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))])
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("fraction of dense SDPA TF/s (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for NAME.md, NAME.json, NAME.png")
    p.add_argument("--name", default="sweep", help="results file stem, e.g. sweep_h100_2026-11-23")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny sizes (checks the script)")
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per measurement (default 3, 2 for big calls; --tiny: 1)")
    p.add_argument("--budget-s", type=float, default=250.0, help="start no row after this many seconds")
    p.add_argument("--impls", type=lambda x: x.split(","), default=["torch", "triton"],
                   help="comma-separated library impls to time (default torch,triton; dense SDPA always)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--gluon-even-only", action="store_true",
                   help="A/B: branches with w %% r != 0 and N %% w != 0 run the Triton kernels, as before "
                        "2026-11-29 (gluon_fwd.UNEVEN_BLOCKS, TAIL_SEGMENTS, TAIL_BATCHES and "
                        "gluon_bwd.TAIL_SEGMENTS off)")
    p.add_argument("--gluon-bwd-tail", action="store_true",
                   help="A/B: the Gluon backward also takes N %% w != 0 at batch 1 (gluon_bwd.TAIL_SEGMENTS; "
                        "on by default since 2026-11-29: kept for the committed A/B commands)")
    p.add_argument("--gluon-split-phases", action="store_true",
                   help="A/B: the Gluon backward runs every branch's dK/dV before its dQ, freeing dk's and "
                        "dv's float32 accumulators first (gluon_bwd.SPLIT_PHASES, off by default)")
    p.add_argument("--plan", action="store_true", help="print rows and estimated GPU seconds; run nothing")
    p.add_argument("--rule-report", metavar="JSON", help="print the rule evaluation of a sweep's JSON")
    p.add_argument("--emit-table", metavar="JSON", help="print MEASURED for kernels/auto_rule.py")
    args = p.parse_args(argv)

    if args.rule_report or args.emit_table:
        with open(args.rule_report or args.emit_table) as f:
            data = json.load(f)
        done = [r for r in data["rows"] if not r.get("skipped")]
        print(rule_report(done)[0] if args.rule_report else emit_table(done))
        return
    if args.iters is None:
        args.iters = 1 if args.tiny else 3
    rows = ROWS
    if args.rows:
        try:
            want = rows_named(args.rows.split(","))
        except ValueError as e:
            sys.exit(str(e))
        rows = [r for r in ROWS + AB_ROWS if r in want]  # in priority order
    if args.plan:
        tot = 0.0
        for r in rows:
            e = estimate_s(r, args.iters)
            tot += e
            print(f"{r.name:30} B={r.batch} N={r.seqlen:>8} {r.nheads:>2}/{r.nheads_kv:<2} D={r.headdim:<3} "
                  f"{r.dtype} w={r.seg} r={r.dil} causal={r.causal}  ~{e:5.1f} s")
        print(f"total ~{tot:.0f} s of timed work (+ Triton compiles, + peers)")
        return
    if args.tiny:
        rows = [tiny_row(r) for r in rows]
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            sys.exit("sweep.py needs a CUDA GPU (or --tiny on the CPU)")
        dev = torch.device("cuda")
    meta = run_info(dev, command_line("python3"))  # command, device, versions, date
    if args.gluon_even_only:
        from dilated_attention.kernels import gluon_bwd, gluon_fwd

        gluon_fwd.UNEVEN_BLOCKS = gluon_fwd.TAIL_SEGMENTS = gluon_fwd.TAIL_BATCHES = False
        gluon_bwd.TAIL_SEGMENTS = False
        meta["gluon_even_only"] = True
    if args.gluon_bwd_tail:
        from dilated_attention.kernels import gluon_bwd

        gluon_bwd.TAIL_SEGMENTS = True
        meta["gluon_bwd_tail"] = True
    if args.gluon_split_phases:
        from dilated_attention.kernels import gluon_bwd

        gluon_bwd.SPLIT_PHASES = True
        meta["gluon_split_phases"] = True
    if dev.type == "cpu":
        meta["device"] = f"CPU (--tiny): {meta['device']}"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    timer = Timer(dev)
    t_start = time.perf_counter()
    results: list[dict] = []
    peers_res = None

    def write():
        meta["wall_s"] = time.perf_counter() - t_start
        if not args.out:
            return
        with open(os.path.join(args.out, args.name + ".json"), "w") as f:
            json.dump(dict(meta=meta, rows=results, peers=peers_res), f, indent=1)
        with open(os.path.join(args.out, args.name + ".md"), "w") as f:
            f.write(markdown(results, peers_res, meta))

    torch.manual_seed(0)
    for r in rows:
        el = time.perf_counter() - t_start
        est = estimate_s(r, args.iters) if dev.type == "cuda" else 0.0
        if el + est > args.budget_s:
            results.append({"row": r._asdict(), "skipped": f"at {el:.0f} s, ~{est:.0f} s more would pass "
                                                            f"the budget of {args.budget_s:.0f} s"})
            continue
        print(f"[{el:6.1f} s] {r.name}", flush=True)
        results.append(run_row(r, dev, timer, args))
        write()
        # the peers right after the headline row, so that a budget cut drops the lowest-priority
        # rows, never the peers
        if r.name == HEADLINE and not args.no_peers:
            print(f"[{time.perf_counter() - t_start:6.1f} s] peers on {HEADLINE}", flush=True)
            peers_res = {"row": HEADLINE, "results": run_peers(r, dev, timer, args)}
            write()
    write()
    done = [res for res in results if not res.get("skipped")]
    if args.out:
        png = plot(results, os.path.join(args.out, args.name + ".png"))
        print(f"wrote {args.out}/{args.name}.md, .json{', .png' if png else ''}")
    print()
    print(rule_report(done)[0].splitlines()[-1])
    print(f"wall {time.perf_counter() - t_start:.0f} s")
    print(summary(results, peers_res))


if __name__ == "__main__":
    main()
