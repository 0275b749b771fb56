"""Real text, no download: byte-level LongNet on the Python standard library's own source.

Corpus: ``dilated_attention.data.stdlib_source_files`` (every ``*.py`` under
``sysconfig.get_paths()["stdlib"]`` outside test / site-packages directories, sorted; a file is
in validation when ``crc32(relative path) % 20 == 0``), concatenated per split. The files depend
on the Python version, which the report records.

Trains the same model with ``dilated`` attention and with ``local`` attention (one branch of
the smallest segment length, r = 1) for the same wall-clock budget each, then scores fixed
validation crops of N bytes: bits per byte overall and by position bucket in the context (does
the model use context beyond its local window?). Writes ``OUT.md`` and ``OUT.json``::

    PYTHONPATH=src python benchmarks/train_stdlib_bytes.py --max-minutes 4 \\
        --out benchmarks/results/stdlib_bytes_64k_h100
    PYTHONPATH=src python benchmarks/train_stdlib_bytes.py --tiny --out /tmp/stdlib   # CPU check

Schedule: AdamW (betas 0.9/0.95, weight decay 0.01 on matrices), linear warmup then constant
rate (a capped run's length is not known in advance), clipping at 1.0, bf16 autocast on GPU,
activation checkpointing per block.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from dilated_attention.data import StdlibBytes
from dilated_attention.models.longnet import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import results_header, run_info  # noqa: E402

SETTINGS = {
    # one GPU: N = 64K; branches up to the whole context, 8 heads so every offset of r = 8 has one
    "gpu": dict(seq_len=65536, batch=2, dim=256, n_layer=4, n_head=8, ffn_dim=1024,
                segments=(1024, 4096, 16384, 65536), rates=(1, 2, 4, 8), lr=1e-3, warmup=50,
                val_seqs=8, max_minutes=4.0, device="cuda", dtype="bfloat16"),
    # CPU check: seconds
    "tiny": dict(seq_len=1024, batch=2, dim=32, n_layer=2, n_head=4, ffn_dim=64,
                 segments=(32, 128, 1024), rates=(1, 2, 4), lr=2e-3, warmup=5,
                 val_seqs=2, max_minutes=0.1, device="cpu", dtype="float32"),
}  # fmt: skip


def buckets(n: int, window: int) -> list[tuple[int, int]]:
    """Position buckets: [0, window), then powers of 4 times the window, up to n."""
    edges = [0, window]
    while edges[-1] * 4 < n:
        edges.append(edges[-1] * 4)
    edges.append(n)
    return list(zip(edges[:-1], edges[1:], strict=True))


@torch.no_grad()
def evaluate(model, data: StdlibBytes, s: dict, device, autocast) -> dict:
    """Bits per byte over the validation crops, overall and per position bucket."""
    model.eval()
    n = s["seq_len"]
    total = torch.zeros(n, dtype=torch.float64)
    count = 0
    for x, y in data.val_batches(s["val_seqs"]):
        x, y = x.to(device), y.to(device)
        with autocast:
            h = model.hidden_states(x)  # (1, N, E)
            logits = model.lm_head(h)  # (1, N, 256): 256-byte vocabulary, small
        nll = F.cross_entropy(logits.float()[0], y[0], reduction="none")  # (N,)
        total += nll.double().cpu()
        count += 1
    per_pos = total / count / math.log(2)  # bits per byte at each position
    out = {"bpb": float(per_pos.mean())}
    for a, b in buckets(n, min(s["segments"])):
        out[f"bpb[{a},{b})"] = float(per_pos[a:b].mean())
    model.train()
    return out


def train_one(s: dict, attention: str, data: StdlibBytes, seed: int) -> dict:
    device = torch.device(s["device"])
    cfg = LongNetConfig(
        vocab_size=256, dim=s["dim"], n_layer=s["n_layer"], n_head=s["n_head"],
        ffn_dim=s["ffn_dim"], segment_lengths=s["segments"], dilation_rates=s["rates"],
        max_seq_len=s["seq_len"], checkpoint_activations=True, impl=s["impl"],
    ).with_attention(attention, s["seq_len"], min(s["segments"]))  # fmt: skip
    torch.manual_seed(seed)
    model = LongNetLM(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s["lr"], betas=(0.9, 0.95), fused=device.type == "cuda",
    )  # fmt: skip
    amp = getattr(torch, s["dtype"])
    autocast = torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32)
    cap = s["max_minutes"] * 60.0
    t0 = time.perf_counter()
    step, losses = 0, []
    while time.perf_counter() - t0 < cap:
        for g in opt.param_groups:
            g["lr"] = s["lr"] * min(1.0, (step + 1) / s["warmup"])
        if s["pack"]:  # each source file in a crop is its own document
            x, y, cu, mx = data.packed_batch(s["batch"], seed, step)
            x, y = x.to(device), y.to(device)
            with autocast:
                _, loss = model(x, y, return_logits=False, cu_seqlens=cu.to(device), max_seqlen=mx)
        else:
            x, y = data.batch(s["batch"], seed, step)
            x, y = x.to(device), y.to(device)
            with autocast:
                _, loss = model(x, y, return_logits=False)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            losses.append((step, round(loss.item() / math.log(2), 4)))
    train_s = time.perf_counter() - t0
    ev = evaluate(model, data, s, device, autocast)
    return {"attention": attention, "seed": seed, "params": model.num_params(), "steps": step,
            "train_s": round(train_s, 1), "tokens": step * s["batch"] * s["seq_len"],
            "branches": [list(cfg.segment_lengths), list(cfg.dilation_rates)],
            "train_bpb_curve": losses, **ev}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path prefix: OUT.md, OUT.json")
    p.add_argument("--tiny", action="store_true", help="CPU check in seconds")
    p.add_argument("--max-minutes", type=float, help="training wall clock per model")
    p.add_argument("--attention", default="dilated,local")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--val-seqs", type=int)
    p.add_argument("--impl", default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--pack", action="store_true",
        help="train on packed documents: each source file in a crop is its own sequence (no byte "
        "attends to or predicts a byte of another file; dilated_attention_varlen)",
    )
    args = p.parse_args(argv)
    s = dict(SETTINGS["tiny" if args.tiny else "gpu"], impl=args.impl, pack=args.pack)
    for key in ("max_minutes", "seq_len", "batch", "val_seqs"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if s["device"] == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: running on cpu in float32", file=sys.stderr)
        s["device"], s["dtype"] = "cpu", "float32"
    if args.threads:
        torch.set_num_threads(args.threads)
    data = StdlibBytes(s["seq_len"])
    dev = torch.device(s["device"])
    env = {
        **run_info(dev),  # command, device, versions, date
        "stdlib_root": data.root, "train_files": len(data.train_files),
        "val_files": len(data.val_files), "train_bytes": len(data.train_data),
        "val_bytes": len(data.val_data),
    }  # fmt: skip
    runs = []
    for attention in args.attention.split(","):
        print(f"run: {attention}", flush=True)
        runs.append(train_one(s, attention, data, args.seed))
        print(f"  {runs[-1]['steps']} steps, val bpb {runs[-1]['bpb']:.4f}", flush=True)
    bk = [k for k in runs[0] if k.startswith("bpb[")]
    lines = results_header("Byte-level LM on the Python standard library: dilated vs local attention", info=env, extra=[
        f"the corpus depends on the python version ({env['versions']['python']})",
        f"corpus: {env['train_files']} train files ({env['train_bytes']} bytes), "
        f"{env['val_files']} validation files ({env['val_bytes']} bytes) under "
        f"`{env['stdlib_root']}` (rule: `dilated_attention.data.stdlib_source_files`)",
        f"model: dim {s['dim']}, {s['n_layer']} layers, {s['n_head']} heads, ffn "
        f"{s['ffn_dim']}; dilated w = {list(s['segments'])}, r = {list(s['rates'])}; local "
        f"w = {min(s['segments'])}; N = {s['seq_len']}, batch {s['batch']}, lr {s['lr']}, "
        f"warmup {s['warmup']}, {s['dtype']}, {s['max_minutes']} min of training each"
        + ("; training crops packed (each file its own document)" if s["pack"] else ""),
        f"validation: {s['val_seqs']} fixed crops of N bytes; bits per byte by position "
        "in the context (the first bucket is inside the local window)",
    ])
    lines += [
        "",
        "| attention | steps | train s | tokens | val bpb | " + " | ".join(bk) + " |",
        "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in bk) + " |",
    ]
    for r in runs:
        lines.append(
            f"| {r['attention']} | {r['steps']} | {r['train_s']} | {r['tokens']} | "
            f"{r['bpb']:.4f} | " + " | ".join(f"{r[k]:.4f}" for k in bk) + " |"
        )
    md = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(md)
    with open(args.out + ".json", "w") as f:
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
        json.dump({"settings": settings, "env": env, "runs": runs}, f, indent=1)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
