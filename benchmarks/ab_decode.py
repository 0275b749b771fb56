"""Same-process A/B of eager calls: direct launch of the compiled kernels vs Triton's launch (issue 23).

One process, interleaved rounds (A, B, C, A, B, C, ...), so that the host's run-to-run drift
(20-35% between runs on the H100 host, ``results/overhead_direct_launch_h100_2026-11-25.md``)
cancels out of the comparison:

- ``direct``: ``flags.set_direct_launch(True)``: the configuration's plan (one dict lookup),
  the compiled kernels launched through their C launchers (``kernels/direct_launch.py``);
- ``jit``: ``flags.set_direct_launch(False)``: every argument built per call, four fresh buffers,
  Triton's ``kernel[grid](...)`` (the path measured at 148-210 us on 2026-11-25);
- ``dense``: SDPA of the row over the whole cache (kv heads repeated, as ``bench_overhead.py``).

Both routes to the decode kernels: ``dilated_attention_with_kvcache`` (``cache_seqlens`` a device
tensor) and ``dilated_attention(q_one_row, k, v, ...)``. 1 new token, bf16, 32 q / 8 kv heads x
128, LongNet branches w 2048..32768 r 1..16, causal, caches 4K / 32K / 128K / 1M.

Per round and arm: the median over ``--iters`` back-to-back calls of the shared timer
(``dilated_attention.timing.median_ms``: CUDA events around each call, so host time counts when
the host is the bottleneck), and the mean per call of a loop of ``--iters`` calls with one
synchronisation at the end (what a decode loop sees). Reported: the median over rounds and the
spread (min-max). Then the direct path once more under ``torch.cuda.set_sync_debug_mode("error")``
(any host synchronisation raises) and whether the plans found their launchers.

Training rows (``--no-train`` skips them): N = 4096 and 16384, batch 1, 8 heads x 64, branches
(512, 1024, 2048; 1, 2, 4), causal, ``impl="triton"``, forward under no_grad and forward+backward,
the same switch (the training launches through ``direct_launch.DirectKernel`` or Triton's),
against causal SDPA.

    python benchmarks/ab_decode.py --out $OUT/ab_decode.md      # H100: about a minute
    python benchmarks/ab_decode.py --tiny --out /tmp/ab.md      # CPU smoke run (interpreter)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import dilated_attention as da
from dilated_attention import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, results_header, run_info, training_calls, utc_now  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def loop_us(fn, iters: int, device: torch.device) -> float:
    """Mean microseconds per call of ``iters`` back-to-back calls, one synchronisation at the end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters * 1e6


def arm(direct: bool | None, fn):
    """``fn`` with the A/B switch set for its duration (None: the switch does not matter)."""
    if direct is None:
        return fn

    def run():
        flags.set_direct_launch(direct)
        try:
            return fn()
        finally:
            flags.set_direct_launch(None)

    return run


def configs(tiny: bool) -> dict:
    if tiny:
        return dict(dtype=torch.float32, heads=(4, 2, 16), seg=(16, 32, 64), dil=(1, 2, 4), caches=(64, 256),
                    train=(64,), train_heads=(2, 16), train_seg=(16, 32), train_dil=(1, 2))  # fmt: skip
    return dict(dtype=torch.bfloat16, heads=(32, 8, 128), seg=(2048, 4096, 8192, 16384, 32768),
                dil=(1, 2, 4, 8, 16), caches=(4096, 32768, 131072, 1048576),
                train=(4096, 16384), train_heads=(8, 64), train_seg=(512, 1024, 2048), train_dil=(1, 2, 4))  # fmt: skip


def measure(n, h, hkv, d, dt, seg, dil, device, args) -> tuple[list[dict], str | None]:
    """The rows of one cache length (both routes) and the host-sync check's note."""
    q = torch.randn(1, 1, h, d, device=device, dtype=dt)
    k, v = (torch.randn(1, n, hkv, d, device=device, dtype=dt) for _ in range(2))
    lens = torch.full((1,), n, dtype=torch.int32, device=device)
    qt = q.transpose(1, 2)
    kx, vx = (x.transpose(1, 2).repeat_interleave(h // hkv, 1) for x in (k, v))

    impl = "auto" if device.type == "cuda" else "triton"  # the CPU run: the kernels in the interpreter

    def kv():
        return da.dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=True, impl=impl)

    def front():
        return da.dilated_attention(q, k, v, seg, dil, causal=True, impl=impl)

    def dense():
        return F.scaled_dot_product_attention(qt, kx, vx)

    arms = {
        ("kvcache", "direct"): arm(True, kv), ("kvcache", "jit"): arm(False, kv),
        ("dilated_attention", "direct"): arm(True, front), ("dilated_attention", "jit"): arm(False, front),
        ("dense", "sdpa"): dense,
    }  # fmt: skip
    ev = {a: [] for a in arms}
    lp = {a: [] for a in arms}
    note = None
    with torch.no_grad():
        for fn in arms.values():  # compile and build plans outside the timed rounds
            for _ in range(2):
                fn()
        for _ in range(args.rounds):
            for a, fn in arms.items():
                ev[a].append(median_ms(fn, device, args.warmup, args.iters) * 1e3)
                lp[a].append(loop_us(fn, args.iters, device))
        if device.type == "cuda":  # the direct path with any host synchronisation an error
            torch.cuda.synchronize()
            flags.set_direct_launch(True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    kv()
                    front()
                note = "no host sync"
            except RuntimeError as e:
                note = f"HOST SYNC: {str(e).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
                flags.set_direct_launch(None)
            torch.cuda.synchronize()
    rows = []
    for route in ("kvcache", "dilated_attention"):
        rows.append(dict(cache=n, route=route, direct_ev=ev[(route, "direct")], jit_ev=ev[(route, "jit")],
                         direct_loop=lp[(route, "direct")], jit_loop=lp[(route, "jit")],
                         dense_ev=ev[("dense", "sdpa")], dense_loop=lp[("dense", "sdpa")]))  # fmt: skip
    return rows, note


def measure_train(n, cfg, device, args) -> list[dict]:
    """Training calls (batch 1, causal, impl='triton'): forward (no grad) and forward+backward,
    direct launch vs Triton's launch, against causal SDPA."""
    h, d = cfg["train_heads"]
    seg, dil, dt = list(cfg["train_seg"]), list(cfg["train_dil"]), cfg["dtype"]
    c = training_calls(n, h, d, dt, seg, dil, device, "triton")
    fwd, fb, dfwd, dfb = c["fwd"], c["fb"], c["dense_fwd"], c["dense_fb"]

    arms = {
        ("fwd", "direct"): arm(True, fwd), ("fwd", "jit"): arm(False, fwd), ("fwd", "sdpa"): dfwd,
        ("fwd+bwd", "direct"): arm(True, fb), ("fwd+bwd", "jit"): arm(False, fb), ("fwd+bwd", "sdpa"): dfb,
    }  # fmt: skip
    ev = {a: [] for a in arms}
    lp = {a: [] for a in arms}
    for fn in arms.values():
        for _ in range(2):
            fn()
    for _ in range(args.rounds):
        for a, fn in arms.items():
            ev[a].append(median_ms(fn, device, args.warmup, args.iters) * 1e3)
            lp[a].append(loop_us(fn, args.iters, device))
    return [
        dict(cache=f"train N={n}", route=what, direct_ev=ev[(what, "direct")], jit_ev=ev[(what, "jit")],
             direct_loop=lp[(what, "direct")], jit_loop=lp[(what, "jit")], dense_ev=ev[(what, "sdpa")],
             dense_loop=lp[(what, "sdpa")])
        for what in ("fwd", "fwd+bwd")
    ]  # fmt: skip


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (runs on the CPU under TRITON_INTERPRET=1)")
    p.add_argument("--iters", type=int, default=100, help="calls per round and arm")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-train", action="store_true", help="skip the training rows")
    p.add_argument("--caches", default=None, help="comma-separated cache lengths (default 4K,32K,128K,1M)")
    p.add_argument("--out", default=None, help="markdown file (default results/ab_decode_<gpu>_<date>.md)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    info = run_info(device, None if argv is None else " ".join(["python", sys.argv[0], *argv]))
    cfg = configs(args.tiny)
    caches = [int(x) for x in args.caches.split(",")] if args.caches else cfg["caches"]
    h, hkv, d = cfg["heads"]
    seg, dil, dt = list(cfg["seg"]), list(cfg["dil"]), cfg["dtype"]

    from dilated_attention.kernels import direct_launch, triton_decode

    rows, sync_notes = [], []
    for n in caches:
        r, note = measure(n, h, hkv, d, dt, seg, dil, device, args)
        rows += r
        if note is not None:
            sync_notes.append(f"cache {n}: {note}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_train:
        for n in cfg["train"]:
            rows += measure_train(n, cfg, device, args)

    plans = list(triton_decode._PLANS.values())
    with_launchers = sum(p.split_go is not None for p in plans)
    from dilated_attention.kernels import triton_launch

    train_keys = [p for dk in (triton_launch._FWD_FOLDED, triton_launch._FWD, triton_launch._DELTA,
                               triton_launch._DKDV, triton_launch._DQ) for p in dk.plans.values()]  # fmt: skip
    with_launchers_train = sum(bool(p) for p in train_keys)
    reason = direct_launch.unavailable_reason()
    lines = results_header(
        f"Decode A/B, plans with direct launch vs Triton's launch: {info['device']}", info=info,
        extra=[
            f"1 new token, {h} q / {hkv} kv heads x {d}, {str(dt).removeprefix('torch.')}, branches {tuple(seg)} / "
            f"{tuple(dil)}, causal, impl={'auto' if device.type == 'cuda' else 'triton'!r}, eager, torch.no_grad",
            f"{args.rounds} interleaved rounds of {args.iters} back-to-back calls per arm; median over rounds (min-max)",
            "events: median per call of CUDA events around each call (host time counts when host-bound); "
            "loop: mean per call of the loop, one synchronisation at the end",
            f"direct launch: {'available' if reason is None else 'UNAVAILABLE: ' + reason}; "
            f"decode plans with launchers: {with_launchers} of {len(plans)}; training launch keys with "
            f"launchers: {with_launchers_train} of {len(train_keys)}",
        ],
    )  # fmt: skip
    lines += ["- training rows: batch 1, causal, impl='triton', branches "
              f"{cfg['train_seg']} / {cfg['train_dil']}, {cfg['train_heads'][0]} heads x {cfg['train_heads'][1]}; "
              "direct = the training launches through DirectKernel, jit = Triton's launch (same switch)"]
    lines += ["", "| cache | route | direct events us | jit events us | dense SDPA events us | direct loop us | jit loop us | dense loop us | jit / direct |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ratio = statistics.median(r["jit_ev"]) / statistics.median(r["direct_ev"])
        lines.append(
            f"| {r['cache']} | {r['route']} | {_spread(r['direct_ev'])} | {_spread(r['jit_ev'])} | "
            f"{_spread(r['dense_ev'])} | {_spread(r['direct_loop'])} | {_spread(r['jit_loop'])} | "
            f"{_spread(r['dense_loop'])} | {ratio:.2f}x |"
        )
    if sync_notes:
        lines += ["", "Host synchronisation check (`torch.cuda.set_sync_debug_mode(\"error\")`, direct path, both routes):", ""]
        lines += [f"- {s}" for s in sync_notes]
    text = "\n".join(lines) + "\n"
    if args.out:
        out = pathlib.Path(args.out)
    else:
        tag = "cpu" if device.type == "cpu" else info["device"].split()[-1].lower().replace("-", "")
        out = HERE / "results" / f"ab_decode_{tag}_{utc_now()[:10]}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"direct launch: {'available' if reason is None else reason}; decode plans with launchers "
          f"{with_launchers}/{len(plans)}, training keys {with_launchers_train}/{len(train_keys)}")
    for s in sync_notes:
        print(s)
    print("cache    route              direct_us  jit_us  dense_us  (events, median of rounds)")
    for r in rows:
        print(f"{r['cache']:>8} {r['route']:<18} {statistics.median(r['direct_ev']):>8.1f} "
              f"{statistics.median(r['jit_ev']):>7.1f} {statistics.median(r['dense_ev']):>8.1f}")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
