"""Fixed cost per call (issue 23): every row of the issue's table, with dense SDPA in the same run.

Rows (GPU sizes; ``--tiny`` shrinks every one of them so that the script runs on the CPU):

- decode: 1 new token, 32 q / 8 kv heads x 128, bf16, LongNet branches w 2048..32768 r 1..16,
  cache 4K / 32K / 128K, through ``dilated_attention_with_kvcache`` and through
  ``dilated_attention(q_one_row, k, v, ...)``, eager, against SDPA of the row over the cache;
- training: N = 4096 and 16384, batch 1, 8 heads x 64, branches (512, 1024, 2048; 1, 2, 4),
  causal, ``impl="auto"``: forward and forward+backward against causal SDPA;
- host: per call, the profiler's CPU self time (all host-side work) next to its device time,
  for the decode and training calls above (``torch.profiler``);
- end to end: LongNet ``base`` training steps (bf16 autocast, fwd+bwd) at 8K x 4 and 16K x 2,
  eager and ``torch.compile``, dilated (branches 2048,4096,8192 / 1,2,4 and 2048..16384 / 1..8)
  against the same model with dense attention (one branch w = N, r = 1: the same fused kernel),
  tokens/s. The step is a training loop's: ``model(x, y, return_logits=False)`` (as
  ``LongNetLM.forward`` asks of training loops; before the thirty-third session (2026-11-29) these rows also computed the
  unused (B, N, V) logits, ~3 GiB and a 2.5 TFLOP GEMM per step, in both arms), backward, AdamW.

Wall time per call is the median of back-to-back calls (CUDA events around each call on the
GPU, ``time.perf_counter`` on the CPU). Writes a markdown results file (command, device,
torch/triton versions, date) and prints a short table::

    python benchmarks/bench_overhead.py                       # GPU, writes results/overhead_<gpu>_<date>.md
    python benchmarks/bench_overhead.py --tiny --out /tmp/o.md  # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pathlib
import sys

import torch
import torch.nn.functional as F

import dilated_attention as da
from dilated_attention.models.longnet import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, device_name, median_ms, results_header, training_calls, utc_now  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------ timing
def time_call(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median microseconds of one call of ``fn`` (back to back, host and device together): the
    shared timer (``common.median_ms``: CUDA events on the GPU, ``time.perf_counter`` on the CPU)."""
    return median_ms(fn, device, warmup, iters) * 1e3


def host_device_us(fn, iters: int, device: torch.device) -> tuple[float, float | None]:
    """(CPU self time, device time) per call in microseconds, from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events) / iters
    dev = None
    if device.type == "cuda":
        dev = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / iters
    return cpu, dev


# ------------------------------------------------------------------------------------ rows
def decode_rows(cfg, device, iters, warmup):
    h, hkv, d, dt = cfg["decode_heads"] + (cfg["dtype"],)
    seg, dil = cfg["decode_seg"], cfg["decode_dil"]
    rows = []
    for n in cfg["decode_caches"]:
        q = torch.randn(1, 1, h, d, device=device, dtype=dt)
        k, v = (torch.randn(1, n, hkv, d, device=device, dtype=dt) for _ in range(2))
        lens = torch.full((1,), n, dtype=torch.int32, device=device)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kx, vx = (x.repeat_interleave(h // hkv, 1) for x in (kt, vt))

        def kv():
            return da.dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=True)

        def front():
            return da.dilated_attention(q, k, v, seg, dil, causal=True)

        def dense():
            return F.scaled_dot_product_attention(qt, kx, vx)

        with torch.no_grad():
            r = {"cache": n, "kvcache_us": time_call(kv, iters, warmup, device),
                 "dilated_attention_us": time_call(front, iters, warmup, device),
                 "dense_us": time_call(dense, iters, warmup, device)}
            r["host_us"], r["device_us"] = host_device_us(kv, max(3, iters // 4), device)
        rows.append(r)
    return rows


def training_rows(cfg, device, iters, warmup):
    h, d, dt = cfg["train_heads"], cfg["train_headdim"], cfg["dtype"]
    seg, dil = cfg["train_seg"], cfg["train_dil"]
    rows = []
    for n in cfg["train_lengths"]:
        c = training_calls(n, h, d, dt, seg, dil, device, "auto")
        fwd, fb, dfwd, dfb = c["fwd"], c["fb"], c["dense_fwd"], c["dense_fb"]

        r = {"N": n, "fwd_us": time_call(fwd, iters, warmup, device),
             "fb_us": time_call(fb, iters, warmup, device),
             "dense_fwd_us": time_call(dfwd, iters, warmup, device),
             "dense_fb_us": time_call(dfb, iters, warmup, device)}
        r["fwd_host_us"], r["fwd_device_us"] = host_device_us(fwd, max(3, iters // 4), device)
        r["fb_host_us"], r["fb_device_us"] = host_device_us(fb, max(3, iters // 4), device)
        rows.append(r)
    return rows


def e2e_rows(cfg, device, steps, warmup, compile_backend, modes=("eager", "compile"), lengths=None):
    rows = []
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    for n, batch, seg, dil in cfg["e2e"]:
        if lengths and n not in lengths:
            continue
        for attention in ("dilated", "dense"):
            for mode in modes:
                base = LongNetConfig.preset(cfg["e2e_preset"], max_seq_len=n)
                base = dataclasses.replace(base, segment_lengths=seg, dilation_rates=dil)
                mcfg = base.with_attention(attention, n)
                row = {"N": n, "batch": batch, "attention": attention, "mode": mode}
                model = opt = None
                try:
                    torch.manual_seed(0)
                    model = LongNetLM(mcfg).to(device).train()
                    run = torch.compile(model, backend=compile_backend) if mode == "compile" else model
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                    x = torch.randint(0, mcfg.vocab_size, (batch, n + 1), device=device)
                    inp, tgt = x[:, :-1], x[:, 1:]

                    def step(run=run, opt=opt, inp=inp, tgt=tgt):
                        with amp:
                            _, loss = run(inp, tgt, return_logits=False)
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)

                    us = time_call(step, steps, warmup, device)
                    row["step_ms"] = us / 1e3
                    row["tokens_per_s"] = batch * n / (us / 1e6)
                except torch.OutOfMemoryError:
                    row["status"] = "OOM"
                finally:
                    del model, opt
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                # as it goes: a run cut short by a timeout keeps the rows it finished
                print(f"| e2e | {n}x{batch} {attention} {mode} | {_f(row.get('step_ms'), 2)} ms | "
                      f"{row.get('status') or _f(row.get('tokens_per_s'), 0)} tok/s |", flush=True)
    return rows


# ------------------------------------------------------------------------------------ report
def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(env, dec, tr, e2e) -> str:
    lines = results_header(f"Fixed cost per call: {env['device']}", env["torch_device"], env["command"],
                           ["wall time per call: median of back-to-back calls (us)"])
    lines += ["", "## decode (1 new token, eager)", "",
             "| cache | dilated_attention_with_kvcache | dilated_attention | dense SDPA | host (profiler CPU self) | device |",
             "|---|---|---|---|---|---|"]
    for r in dec:
        lines.append(f"| {r['cache']} | {_f(r['kvcache_us'])} | {_f(r['dilated_attention_us'])} | "
                     f"{_f(r['dense_us'])} | {_f(r['host_us'])} | {_f(r['device_us'])} |")
    lines += ["", "## training call (causal, impl=auto)", "",
              "| N | fwd | dense fwd | fwd+bwd | dense fwd+bwd | fwd host / device | fwd+bwd host / device |",
              "|---|---|---|---|---|---|---|"]
    for r in tr:
        lines.append(f"| {r['N']} | {_f(r['fwd_us'])} | {_f(r['dense_fwd_us'])} | {_f(r['fb_us'])} | "
                     f"{_f(r['dense_fb_us'])} | {_f(r['fwd_host_us'])} / {_f(r['fwd_device_us'])} | "
                     f"{_f(r['fb_host_us'])} / {_f(r['fb_device_us'])} |")
    lines += ["", "(host = the profiler's CPU self time per call, all host-side work; device = "
              "kernel time per call)", "", "## end to end (training step, bf16 autocast)", "",
              "| N x batch | attention | mode | step ms | tokens/s |", "|---|---|---|---|---|"]
    for r in e2e:
        lines.append(f"| {r['N']} x {r['batch']} | {r['attention']} | {r['mode']} | "
                     f"{_f(r.get('step_ms'), 2)} | {r.get('status') or _f(r.get('tokens_per_s'), 0)} |")
    return "\n".join(lines) + "\n"


def configs(tiny: bool) -> dict:
    if tiny:
        return dict(dtype=torch.float32, decode_heads=(4, 2, 16), decode_seg=(16, 32, 64),
                    decode_dil=(1, 2, 4), decode_caches=(64, 256), train_heads=2, train_headdim=16,
                    train_seg=(16, 32, 64), train_dil=(1, 2, 4), train_lengths=(64, 256),
                    e2e_preset="tiny", e2e=[(128, 2, (32, 64), (1, 2))])
    return dict(dtype=torch.bfloat16, decode_heads=(32, 8, 128),
                decode_seg=(2048, 4096, 8192, 16384, 32768), decode_dil=(1, 2, 4, 8, 16),
                decode_caches=(4096, 32768, 131072), train_heads=8, train_headdim=64,
                train_seg=(512, 1024, 2048), train_dil=(1, 2, 4), train_lengths=(4096, 16384),
                e2e_preset="base",
                e2e=[(8192, 4, (2048, 4096, 8192), (1, 2, 4)),
                     (16384, 2, (2048, 4096, 8192, 16384), (1, 2, 4, 8))])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (runs on the CPU)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--e2e-steps", type=int, default=10)
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--only-e2e", action="store_true", help="the end-to-end rows only (no decode or training-call rows)")
    p.add_argument("--e2e-modes", default="eager,compile", help="end-to-end modes, comma-separated (eager, compile)")
    p.add_argument("--e2e-lengths", default="", help="end-to-end sequence lengths to run, comma-separated (default all)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; aot_eager with --tiny)")
    p.add_argument("--out", default=None, help="markdown file (default results/overhead_<gpu>_<date>.md)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # per-call host cost; no thread-pool wake-ups on a shared CPU
    cfg = configs(args.tiny)
    backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    name = device_name(device)
    if device.type == "cpu":
        name = f"CPU ({name}, {os.cpu_count()} cores)"
    env = dict(device=name, torch_device=device,
               command=command_line() if argv is None else " ".join(["python", sys.argv[0], *argv]))
    if args.only_e2e and args.no_e2e:
        p.error("--only-e2e and --no-e2e leave nothing to measure")
    dec = [] if args.only_e2e else decode_rows(cfg, device, args.iters, args.warmup)
    tr = [] if args.only_e2e else training_rows(cfg, device, args.iters, args.warmup)
    modes = tuple(m for m in args.e2e_modes.split(",") if m)
    if not modes or set(modes) - {"eager", "compile"}:
        p.error(f"--e2e-modes {args.e2e_modes!r}: a comma-separated list of eager, compile")
    lengths = {int(x) for x in args.e2e_lengths.split(",") if x}
    e2e = [] if args.no_e2e else e2e_rows(cfg, device, args.e2e_steps, 2, backend, modes, lengths)
    text = markdown(env, dec, tr, e2e)
    if args.out:
        out = pathlib.Path(args.out)
    else:
        tag = "cpu" if device.type == "cpu" else name.split()[-1].lower().replace("-", "")
        out = HERE / "results" / f"overhead_{tag}_{utc_now()[:10]}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if dec:
        print("decode        cache  kvcache_us  dilated_attention_us  dense_us")
    for r in dec:
        print(f"| decode | {r['cache']:>7} | {_f(r['kvcache_us']):>9} | {_f(r['dilated_attention_us']):>9} | {_f(r['dense_us']):>9} |")
    for r in tr:
        print(f"| training | N={r['N']:>6} | fwd {_f(r['fwd_us'])} (dense {_f(r['dense_fwd_us'])}) | "
              f"fwd+bwd {_f(r['fb_us'])} (dense {_f(r['dense_fb_us'])}) |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
