"""End-to-end training throughput: dilated vs dense attention in the same LongNet LM.

One training step = forward + backward + AdamW step of ``LongNetLM`` (batch 1, bf16 autocast,
activation checkpointing of every block, the chunked LM head + loss of ``LongNetLM.forward``
with ``return_logits=False``, every position scored as in language modelling). For each preset
(``small``, ``base``; their own vocabularies, 256 and 50304) and N (32K, 128K, 512K) it reports
tokens/s, seconds per step and peak GPU memory (``torch.cuda.max_memory_allocated`` over the
timed steps) for ``--attention dilated`` (the preset's branches) and ``dense`` (one branch
w >= N, r = 1: exact causal attention through the dense path, SDPA) and the dilated speedup.
A configuration that runs out of memory is reported as ``OOM``; a dense configuration whose
estimated time (from the previous N, attention part scaled by N^2, the rest by N) would break the
time budget is reported as ``skipped (est. X s/step)``.

Fraction of step time in attention: the same step is timed again with every attention call
replaced by a pass-through that returns ``v`` (same shapes, same projections, norms, FFN, head,
loss, checkpointing and optimizer); ``attn_frac = 1 - t_passthrough / t_step``. This is the step
time that attention (forward, its recomputation under checkpointing, backward) adds, which a
profiler's kernel sums would split across many small kernels.

    PYTHONPATH=src python benchmarks/bench_train.py --out benchmarks/results/train_throughput_h100
    PYTHONPATH=src python benchmarks/bench_train.py --tiny --threads 1 --out /tmp/bench_train

Writes ``OUT.md`` and ``OUT.json``; prints the table last. About 4 minutes on one H100
(``--budget-s`` bounds it: configurations after the budget are reported as skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch
from torch import nn

from dilated_attention.models.longnet import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import results_header, run_info, time_fn  # noqa: E402


class PassThrough(nn.Module):
    """Stands in for DilatedAttention: returns v (repeated over GQA groups), no attention cost."""

    def forward(self, q, k, v, is_causal=False):
        rep = q.shape[2] // v.shape[2]
        return v if rep == 1 else v.repeat_interleave(rep, dim=2)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, opt, n: int, vocab: int, device, autocast, warmup: int, steps: int):
    """Seconds per training step (mean over ``steps`` after ``warmup``) and peak bytes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, n + 1), generator=g).to(device)
    inp, tgt = x[:, :-1], x[:, 1:]

    def one():
        with autocast:
            _, loss = model(inp, tgt, return_logits=False)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(warmup):
        one()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dt = time_fn(one, device, 0, steps)  # the shared loop timer: mean seconds per step
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dt, peak


def run_config(preset: str, n: int, attention: str, args, device, autocast) -> dict:
    cfg = LongNetConfig.preset(preset, checkpoint_activations=True, impl=args.impl)
    if args.tiny:
        cfg = dataclasses.replace(cfg, max_seq_len=n)
    cfg = cfg.with_attention(attention, n)
    row = {"preset": preset, "N": n, "attention": attention}
    model = opt = None
    try:
        torch.manual_seed(0)
        model = LongNetLM(cfg).to(device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        dt, peak = time_steps(model, opt, n, cfg.vocab_size, device, autocast, args.warmup,
                              args.steps)  # fmt: skip
        row.update(step_s=dt, tokens_per_s=n / dt, peak_gib=peak / 2**30 if peak else None)
        for layer in model.layers:
            layer.attn.attention = PassThrough()
        dt0, _ = time_steps(model, opt, n, cfg.vocab_size, device, autocast, 1, args.steps)
        row["attn_frac"] = max(0.0, 1.0 - dt0 / dt)
        row["params"] = model.num_params()
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _fmt(row: dict) -> list[str]:
    if "status" in row:
        return [row["status"]] + [""] * 4
    peak = f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "n/a"
    return [f"{row['tokens_per_s'] / 1e3:.1f}K", f"{row['step_s']:.3f}", peak,
            f"{row['attn_frac']:.2f}", row.get("speedup", "")]  # fmt: skip


def markdown(rows: list[dict], env: dict) -> str:
    lines = results_header("End-to-end training step: dilated vs dense attention", info=env, extra=[
        f"one step = fwd + bwd + AdamW, batch 1, {env['dtype']} autocast, activation "
        f"checkpointing per block, chunked LM head + loss, impl `{env['impl']}`; "
        f"{env['warmup']} warm-up step(s), mean of {env['steps']} timed",
        "attn frac = 1 - (step time with attention replaced by a pass-through) / (step time)",
    ])
    lines += [
        "",
        "| preset | N | attention | tokens/s | s/step | peak GiB | attn frac | dilated / dense |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['preset']} | {r['N']} | {r['attention']} | "
        lines.append(head + " | ".join(_fmt(r)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path prefix: OUT.md, OUT.json")
    p.add_argument("--presets", default="small,base")
    p.add_argument("--lengths", default="32768,131072,524288")
    p.add_argument("--attention", default="dilated,dense")
    p.add_argument("--impl", default="auto")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=220.0, help="skip what would exceed it")
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny preset, N = 128, 256")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.presets, args.lengths = "tiny", "128,256"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    env = {
        **run_info(device),  # command, device, versions, date
        "dtype": str(dtype), "impl": args.impl, "warmup": args.warmup, "steps": args.steps,
    }  # fmt: skip
    t_start = time.perf_counter()
    rows: list[dict] = []
    lengths = [int(v) for v in args.lengths.split(",")]
    for preset in args.presets.split(","):
        prev: dict[str, dict] = {}
        for n in lengths:
            by_att = {}
            for attention in args.attention.split(","):
                spent = time.perf_counter() - t_start
                last = prev.get(attention)
                est = None
                if last is not None and "step_s" in last:
                    scale, f = n / last["N"], last["attn_frac"]
                    est = last["step_s"] * ((1 - f) * scale + f * scale * scale)
                # a config costs about (warmup + 2 * steps + 1) steps
                need = (args.warmup + 2 * args.steps + 1) * est if est is not None else 0.0
                if spent + need > args.budget_s:
                    why = f"est. {est:.1f} s/step" if est is not None else "time budget"
                    row = {"preset": preset, "N": n, "attention": attention,
                           "status": f"skipped ({why})"}  # fmt: skip
                elif last is not None and last.get("status") == "OOM":
                    row = {"preset": preset, "N": n, "attention": attention,
                           "status": "OOM"}  # a shorter N already did not fit  # fmt: skip
                else:
                    row = run_config(preset, n, attention, args, device, autocast)
                print(f"{preset} N={n} {attention}: " + " ".join(_fmt(row)), flush=True)
                rows.append(row)
                by_att[attention] = row
                prev[attention] = row if "status" not in row or row["status"] == "OOM" else last
            d, e = by_att.get("dilated", {}), by_att.get("dense", {})
            if "tokens_per_s" in d and "tokens_per_s" in e:
                d["speedup"] = f"{d['tokens_per_s'] / e['tokens_per_s']:.2f}x"
            elif "tokens_per_s" in d and "status" in e:
                d["speedup"] = f"dense {e['status']}"
            with open(args.out + ".json", "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)
            with open(args.out + ".md", "w") as f:
                f.write(markdown(rows, env))
    print()
    print(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
