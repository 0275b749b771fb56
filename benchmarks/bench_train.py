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

Issue 25 item 5, ``small`` at 512K and 1M beside dense (about 5 minutes on one H100, est.)::

    PYTHONPATH=src python benchmarks/bench_train.py --presets small \\
        --lengths 131072,524288,1048576 --dense-steps 1 --search-dense --search-probes 2 \\
        --budget-s 420 --out benchmarks/results/train_throughput_1m_h100

``--dense-steps`` times dense with fewer steps than dilated (a dense step at 1M is a minute or
more). ``--search-dense``: when dense runs out of memory at a length, the largest length that
fits is searched between the last one that fitted and that one (bisection on multiples of
``--search-grain``, at most ``--search-probes`` probes of one untimed step each) and then timed
like the others (row marked ``largest dense``).
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


def _config(preset: str, n: int, attention: str, args) -> LongNetConfig:
    cfg = LongNetConfig.preset(preset, checkpoint_activations=True, impl=args.impl)
    if args.tiny:
        cfg = dataclasses.replace(cfg, max_seq_len=n)
    return cfg.with_attention(attention, n)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _steps(attention: str, args) -> int:
    return args.dense_steps if attention == "dense" and args.dense_steps else args.steps


def run_config(preset: str, n: int, attention: str, args, device, autocast) -> dict:
    cfg = _config(preset, n, attention, args)
    row = {"preset": preset, "N": n, "attention": attention}
    model = opt = None
    steps = _steps(attention, args)
    try:
        torch.manual_seed(0)
        model = LongNetLM(cfg).to(device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        dt, peak = time_steps(model, opt, n, cfg.vocab_size, device, autocast, args.warmup, steps)
        row.update(step_s=dt, tokens_per_s=n / dt, peak_gib=peak / 2**30 if peak else None,
                   timed_steps=steps)  # fmt: skip
        for layer in model.layers:
            layer.attn.attention = PassThrough()
        dt0, _ = time_steps(model, opt, n, cfg.vocab_size, device, autocast, 1, steps)
        row["attn_frac"] = max(0.0, 1.0 - dt0 / dt)
        row["params"] = model.num_params()
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    finally:
        del model, opt
        _free(device)
    return row


def fits(preset: str, n: int, attention: str, args, device, autocast) -> bool:
    """Whether one training step of this configuration runs without running out of memory."""
    cfg = _config(preset, n, attention, args)
    model = opt = None
    try:
        torch.manual_seed(0)
        model = LongNetLM(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        time_steps(model, opt, n, cfg.vocab_size, device, autocast, 0, 1)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, opt
        _free(device)


def largest_fitting(lo: int, hi: int, probe, grain: int, probes: int) -> int | None:
    """The largest multiple of ``grain`` in (lo, hi) for which ``probe(n)`` is True, by bisection
    with at most ``probes`` calls, assuming ``probe`` is True at ``lo`` (or lo = 0) and False at
    ``hi``; None when no probed length fits."""
    best = None
    a, b = lo // grain, -(-hi // grain)  # in grains: a fits (or is 0), b does not
    for _ in range(probes):
        if b - a <= 1:
            break
        m = (a + b) // 2
        if probe(m * grain):
            a, best = m, m * grain
        else:
            b = m
    return best


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
        f"{env['warmup']} warm-up step(s), mean of {env['steps']} timed "
        f"({env.get('dense_steps', env['steps'])} for dense)"
        + (f"; GPU memory {env['gpu_mem_gib']} GiB" if env.get("gpu_mem_gib") else ""),
        "attn frac = 1 - (step time with attention replaced by a pass-through) / (step time)",
    ])
    lines += [
        "",
        "| preset | N | attention | tokens/s | s/step | peak GiB | attn frac | dilated / dense |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        att = r["attention"] + (f" ({r['note']})" if r.get("note") else "")
        head = f"| {r['preset']} | {r['N']} | {att} | "
        lines.append(head + " | ".join(_fmt(r)) + " |")
    return "\n".join(lines) + "\n"


def write(out: str, rows: list[dict], env: dict) -> None:
    with open(out + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(rows, env))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path prefix: OUT.md, OUT.json")
    p.add_argument("--presets", default="small,base")
    p.add_argument("--lengths", default="32768,131072,524288")
    p.add_argument("--attention", default="dilated,dense")
    p.add_argument("--impl", default="auto")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dense-steps", type=int, help="timed steps for dense (default --steps)")
    p.add_argument("--search-dense", action="store_true",
                   help="where dense runs out of memory, find and time the largest length that fits")
    p.add_argument("--search-grain", type=int, default=65536, help="--search-dense: lengths are multiples of it")
    p.add_argument("--search-probes", type=int, default=4, help="--search-dense: at most so many probes")
    p.add_argument("--budget-s", type=float, default=220.0, help="skip what would exceed it")
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny preset, N = 128, 256")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.presets = "tiny"
        args.lengths = "128,256" if args.lengths == p.get_default("lengths") else args.lengths
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    env = {
        **run_info(device),  # command, device, versions, date
        "dtype": str(dtype), "impl": args.impl, "warmup": args.warmup, "steps": args.steps,
        "dense_steps": args.dense_steps or args.steps,
        "gpu_mem_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        if device.type == "cuda" else None,
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
                # a config costs (warmup + steps) steps and (1 + steps) pass-through steps
                k = _steps(attention, args)
                need = 0.0
                if est is not None:
                    need = (args.warmup + k) * est + (1 + k) * est * (1 - last["attn_frac"])
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
            write(args.out, rows, env)
        if args.search_dense and "dense" in args.attention.split(","):
            dense = [r for r in rows if r["preset"] == preset and r["attention"] == "dense"]
            ok = [r["N"] for r in dense if "step_s" in r]
            oom = [r["N"] for r in dense if r.get("status") == "OOM" and r["N"] > max(ok, default=0)]
            if oom:
                lo, hi = max(ok, default=0), min(oom)
                print(f"{preset} dense: largest length that fits in ({lo}, {hi})?", flush=True)
                best = largest_fitting(
                    lo, hi, lambda n, pr=preset: fits(pr, n, "dense", args, device, autocast),
                    args.search_grain, args.search_probes,
                )  # fmt: skip
                row = {"preset": preset, "N": best, "attention": "dense",
                       "status": f"nothing in ({lo}, {hi}) fits"}  # fmt: skip
                if best is not None:
                    row = run_config(preset, best, "dense", args, device, autocast)
                row["note"] = "largest dense"
                print(f"{preset} N={best} dense (largest that fits): " + " ".join(_fmt(row)),
                      flush=True)  # fmt: skip
                rows.append(row)
                write(args.out, rows, env)
    print()
    print(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
