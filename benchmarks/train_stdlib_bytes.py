"""Real text, no download: byte-level LongNet on the Python standard library's own source.

Corpus: ``dilated_attention.data.stdlib_source_files`` (every ``*.py`` under
``sysconfig.get_paths()["stdlib"]`` outside test / site-packages directories, sorted; a file is
in validation when ``crc32(relative path) % 20 == 0``), concatenated per split. The files depend
on the Python version, which the report records.

Trains the same model with each attention given (``dilated``: the preset's branches; ``dense``:
one branch w >= N, r = 1; ``local``: one branch of the smallest segment length, r = 1) for the
same training time each, then scores the held-out files (``val = "files"``: every validation
file from its first byte, each its own document, ``StdlibBytes.val_packed``; the first setting,
``val = "crops"``, scored crops of the concatenated split): bits per byte overall, by position
bucket in the file (does the model use context beyond its local window?) and as a curve over
log-spaced position bins, at every eval; the report names the best eval (lowest bits per byte:
the early-stopping point, since a 20-minute run passes over the ~10 MB split a hundred times and
more). Writes ``OUT.md``, ``OUT.json`` and ``OUT.png`` (bits per byte against position at the
best eval and against training time, every run on one figure; needs matplotlib)::

    # issue 25, item 4: presets h100-32k (dilated, dense, local) and h100-128k (dilated, local)
    PYTHONPATH=src python benchmarks/train_stdlib_bytes.py --preset h100-32k --attention dilated \\
        --out benchmarks/results/stdlib_32k_dilated_h100
    PYTHONPATH=src python benchmarks/train_stdlib_bytes.py --tiny --out /tmp/stdlib   # CPU check
    # one report and one figure from runs made in separate calls
    PYTHONPATH=src python benchmarks/train_stdlib_bytes.py --merge a.json,b.json,c.json --out all

The training-time cap (``--max-minutes``) counts the time of the training steps only, summed
over every call of a paused and resumed run: not the evals (reported as ``eval_s``), not the
checkpoint writes, and not one untimed warm-up step per call (forward + backward on the next
batch, gradients dropped: kernel compilation and autotuning; reported as ``setup_s``). The same
rule for every attention. Evals happen every ``eval_every_min`` minutes of training time, so
where a run was paused does not change when it is evaluated.

Pause and resume (a run longer than one device call): ``--pause-after-minutes M --checkpoint
PATH`` stops after M minutes of this call's wall clock (setup and evals included) and saves
everything (model, optimizer, step, training time, RNG, the record so far) as ``PATH`` plus
``PATH.1``, ``PATH.2`` (``common.save_split``: files of at most 15 MiB, which a device call can
return); the checkpoint is also rewritten after every eval, so a killed call loses at most one
eval interval. ``--resume PATH`` continues (batches are a pure function of (seed, step), so the
data position is the step); a finished run's checkpoint says so and resuming it only rewrites the
report.

Schedule: AdamW (betas 0.9/0.95, the preset's weight decay on matrices), linear warmup, then constant
or (``schedule="cosine"``) cosine to ``min_lr_ratio`` over the cap (training time, or steps when
``--max-steps`` is set), clipping at 1.0, bf16 autocast on GPU.
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

from dilated_attention.data import IGNORE, StdlibBytes
from dilated_attention.models.longnet import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, load_split, results_header, run_info, save_split, utc_now  # noqa: E402

PRESETS = {
    # issue 25 item 4: N = 32K, dilated vs dense vs local, 20 minutes of training each. Branches
    # up to the whole context, 8 heads so every offset of r = 8 has one (head dim 32); 3.2M
    # parameters; 128K bytes a step. Activations fit without checkpointing (~10 GB est.).
    # Validation: every validation file from its first byte (val="files": position = position
    # in the file). Regularised (dropout 0.1, weight decay 0.1) and trained on packed files:
    # the first H100 run (dropout 0, weight decay 0.01, crops across files) saw 82 passes over
    # the 9.7 MB split in 8 minutes and its validation loss rose after 4 minutes
    # (stdlib_bytes_32k_h100_2026-11-25_overfit.md).
    "h100-32k": dict(seq_len=32768, batch=4, dim=256, n_layer=4, n_head=8, ffn_dim=1024,
                     segments=(1024, 4096, 16384, 32768), rates=(1, 2, 4, 8), local_window=1024,
                     lr=1e-3, warmup=100, schedule="cosine", min_lr_ratio=0.1, dropout=0.1,
                     weight_decay=0.1, pack=True, val="files",
                     checkpoint_activations=False, val_seqs=16, eval_every_min=2.0,
                     eval_every_steps=None, max_minutes=20.0, max_steps=None,
                     attentions="dilated,dense,local", device="cuda", dtype="bfloat16"),
    # issue 25 item 4: N = 131072, dilated vs local. The geometry of train_retrieval's
    # h100-128k recipe (w x4 and r x2 per branch, 16 heads of dim 16 so every offset of r = 16
    # has one), the same width as h100-32k (3.2M parameters); batch 1 = 128K bytes a step.
    # Validation and regularisation as h100-32k (no validation file is longer than ~106K bytes
    # on python 3.11: the last bucket may be thin or empty; the report gives its byte count).
    # 14 minutes of training each (the issue names no time for 128K): two device calls.
    "h100-128k": dict(seq_len=131072, batch=1, dim=256, n_layer=4, n_head=16, ffn_dim=1024,
                      segments=(1024, 4096, 16384, 65536, 131072), rates=(1, 2, 4, 8, 16),
                      local_window=1024, lr=1e-3, warmup=100, schedule="cosine", min_lr_ratio=0.1,
                      dropout=0.1, weight_decay=0.1, pack=True, val="files",
                      checkpoint_activations=False, val_seqs=8, eval_every_min=2.5,
                      eval_every_steps=None, max_minutes=14.0, max_steps=None,
                      attentions="dilated,local", device="cuda", dtype="bfloat16"),
    # the first GPU setting (N = 64K, 4 minutes, dilated vs local, one eval at the end)
    "h100-64k": dict(seq_len=65536, batch=2, dim=256, n_layer=4, n_head=8, ffn_dim=1024,
                     segments=(1024, 4096, 16384, 65536), rates=(1, 2, 4, 8), local_window=1024,
                     lr=1e-3, warmup=50, schedule="constant", min_lr_ratio=0.1, dropout=0.0,
                     weight_decay=0.01, pack=False, val="crops",
                     checkpoint_activations=True, val_seqs=8, eval_every_min=None,
                     eval_every_steps=None, max_minutes=4.0, max_steps=None,
                     attentions="dilated,local", device="cuda", dtype="bfloat16"),
    # CPU check: seconds
    "tiny": dict(seq_len=1024, batch=2, dim=32, n_layer=2, n_head=4, ffn_dim=64,
                 segments=(32, 128, 1024), rates=(1, 2, 4), local_window=32, lr=2e-3, warmup=5,
                 schedule="cosine", min_lr_ratio=0.1, dropout=0.0, weight_decay=0.1, pack=True,
                 val="files", checkpoint_activations=True,
                 val_seqs=2, eval_every_min=None, eval_every_steps=None, max_minutes=0.1,
                 max_steps=None, attentions="dilated,local", device="cpu", dtype="float32"),
}  # fmt: skip
SETTINGS = PRESETS  # the old name

# settings a resumed run must share with its checkpoint
RESUME_KEYS = ("seq_len", "batch", "dim", "n_layer", "n_head", "ffn_dim", "segments", "rates",
               "local_window", "lr", "warmup", "schedule", "min_lr_ratio", "dropout", "val_seqs",
               "eval_every_min", "eval_every_steps", "max_minutes", "max_steps", "pack",
               "weight_decay", "val")  # fmt: skip


def buckets(n: int, window: int) -> list[tuple[int, int]]:
    """Position buckets: [0, window), then powers of 4 times the window, up to n."""
    edges = [0, window]
    while edges[-1] * 4 < n:
        edges.append(edges[-1] * 4)
    edges.append(n)
    return list(zip(edges[:-1], edges[1:], strict=True))


def position_bins(n: int, per_octave: int = 4) -> list[tuple[int, int]]:
    """Log-spaced bins of positions 0..n-1 (single positions at the start) for the curve."""
    edges = {0, n}
    k = 0
    while (e := round(2 ** (k / per_octave))) < n:
        edges.add(e)
        k += 1
    edges = sorted(edges)
    return list(zip(edges[:-1], edges[1:], strict=True))


def val_starts(data: StdlibBytes, num_seqs: int) -> list[int]:
    """The offsets of the validation crops of ``StdlibBytes.val_batches`` (for the report)."""
    hi = len(data.val_data) - data.seq_len - 1
    return [round(i * hi / max(1, num_seqs - 1)) for i in range(num_seqs)]


def _jsonable(s: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}


def bucket_counts(data: StdlibBytes, s: dict) -> dict:
    """The number of scored bytes per position bucket of the validation (for the report)."""
    n = s["seq_len"]
    if s["val"] == "crops":
        return {f"[{a},{b})": s["val_seqs"] * (b - a) for a, b in buckets(n, s["local_window"])}
    pos = torch.cat([p[y[0] != IGNORE] for _, y, _, _, p in data.val_packed(n)])
    return {f"[{a},{b})": int(((pos >= a) & (pos < b)).sum()) for a, b in buckets(n, s["local_window"])}


@torch.no_grad()
def evaluate(model, data: StdlibBytes, s: dict, device, autocast) -> dict:
    """Bits per byte on the validation split: overall, per position bucket, and as a curve over
    :func:`position_bins` (``curve``: [lo, hi, bpb] rows; empty bins left out).

    ``val = "files"``: every validation file from its first byte, cut to N bytes, packed whole
    into rows (``StdlibBytes.val_packed``; each file its own document), so position p is the
    p-th byte of a file and the model sees only that file; each byte counts once. ``val =
    "crops"`` (the first setting): ``val_seqs`` fixed crops of N bytes of the concatenated
    split, position = position in the crop (crops cross file boundaries)."""
    model.eval()
    n = s["seq_len"]
    total = torch.zeros(n, dtype=torch.float64)
    count = torch.zeros(n, dtype=torch.float64)
    if s["val"] == "files":
        rows = [(x, y, {"cu_seqlens": cu.to(device), "max_seqlen": mx}, pos)
                for x, y, cu, mx, pos in data.val_packed(n)]  # fmt: skip
    else:
        rows = [(x, y, {}, torch.arange(n)) for x, y in data.val_batches(s["val_seqs"])]
    for x, y, kw, pos in rows:
        x, y = x.to(device), y.to(device)
        with autocast:
            h = model.hidden_states(x, **kw)  # (1, N, E)
            logits = model.lm_head(h)  # (1, N, 256): 256-byte vocabulary, small
        nll = F.cross_entropy(logits.float()[0], y[0], reduction="none").double().cpu()  # (N,)
        keep = (y[0] != IGNORE).cpu() & (pos >= 0)
        total.index_add_(0, pos[keep], nll[keep])
        count.index_add_(0, pos[keep], torch.ones_like(nll[keep]))
    ln2 = math.log(2)

    def mean(a, b):
        c = float(count[a:b].sum())
        return float(total[a:b].sum()) / c / ln2 if c else float("nan")

    out = {"bpb": mean(0, n)}
    for a, b in buckets(n, s["local_window"]):
        out[f"bpb[{a},{b})"] = mean(a, b)
    out["curve"] = [[a, b, round(mean(a, b), 5)] for a, b in position_bins(n) if count[a:b].sum() > 0]
    model.train()
    return out


def best_eval(r: dict) -> dict:
    """The eval with the lowest validation bits per byte (the run's early-stopping point)."""
    return min(r["evals"], key=lambda ev: ev["bpb"])


def build(s: dict, attention: str, device, seed: int):
    cfg = LongNetConfig(
        vocab_size=256, dim=s["dim"], n_layer=s["n_layer"], n_head=s["n_head"],
        ffn_dim=s["ffn_dim"], segment_lengths=s["segments"], dilation_rates=s["rates"],
        max_seq_len=s["seq_len"], checkpoint_activations=s["checkpoint_activations"],
        impl=s["impl"], dropout=s["dropout"],
    ).with_attention(attention, s["seq_len"], s["local_window"])  # fmt: skip
    torch.manual_seed(seed)
    model = LongNetLM(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s["lr"], betas=(0.9, 0.95), fused=device.type == "cuda",
    )  # fmt: skip
    return model, opt


def lr_factor(s: dict, step: int, train_s: float) -> float:
    """Linear warmup over ``warmup`` steps, then constant or cosine to ``min_lr_ratio`` over the
    run (its steps when ``max_steps`` is set, else its training-time cap)."""
    f = min(1.0, (step + 1) / s["warmup"])
    if s["schedule"] == "cosine":
        frac = step / s["max_steps"] if s["max_steps"] else train_s / (60.0 * s["max_minutes"])
        lo = s["min_lr_ratio"]
        f *= lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
    return f


def _rng_state(device) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}  # fmt: skip


def _set_rng_state(state: dict, device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one(s: dict, attention: str, data: StdlibBytes, seed: int, *, log=print, progress=None,
              resume: str | None = None, checkpoint: str | None = None,
              pause_s: float | None = None, pause_steps: int | None = None) -> dict:
    """One capped run; returns its record. ``progress(rec)`` after every eval; ``pause_s`` /
    ``pause_steps``: stop after so many seconds of this call (wall clock, setup and evals
    included) / so many steps of this call, saving to ``checkpoint``; ``resume``: continue from
    a checkpoint (module docstring)."""
    t_call = time.perf_counter()
    device = torch.device(s["device"])
    model, opt = build(s, attention, device, seed)
    amp = getattr(torch, s["dtype"])
    autocast = torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32)
    cap = s["max_minutes"] * 60.0
    corpus = {"train_bytes": len(data.train_data), "val_bytes": len(data.val_data)}
    rec = {"attention": attention, "seed": seed, "params": model.num_params(),
           "branches": [list(model.cfg.segment_lengths), list(model.cfg.dilation_rates)],
           "evals": [], "train_bpb_curve": [], "calls": []}  # fmt: skip
    st = {"step": 0, "train_s": 0.0, "eval_s": 0.0, "done": False,
          "next_eval_s": 60.0 * s["eval_every_min"] if s["eval_every_min"] else None}  # fmt: skip
    if resume:
        ck = load_split(resume, map_location=device)
        if (ck["attention"], ck["seed"]) != (attention, seed):
            raise ValueError(f"checkpoint {resume} is for {ck['attention']} seed {ck['seed']}, "
                             f"not {attention} seed {seed}")  # fmt: skip
        want = _jsonable({k: s[k] for k in RESUME_KEYS})
        diff = {k: (ck["settings"].get(k), want[k]) for k in RESUME_KEYS
                if ck["settings"].get(k) != want[k]}  # fmt: skip
        if diff:
            raise ValueError(f"checkpoint {resume} has other settings (checkpoint, now): {diff}")
        if ck["corpus"] != corpus:
            raise ValueError(f"checkpoint {resume} was trained on another corpus: {ck['corpus']} "
                             f"!= {corpus} (another python version?)")  # fmt: skip
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        rec, st = ck["rec"], ck["state"]
        rec.pop("paused", None)
        _set_rng_state(ck["rng"], device)
        log(f"  [{attention}] resumed at step {st['step']}, {st['train_s']:.0f} s of training")
    call = {"date": utc_now(), "command": command_line(), "start_step": st["step"],
            "start_train_s": round(st["train_s"], 1)}  # fmt: skip
    rec["calls"].append(call)

    def save():
        if checkpoint:
            save_split({"attention": attention, "seed": seed, "settings": _jsonable(
                {k: s[k] for k in RESUME_KEYS}), "corpus": corpus, "model": model.state_dict(),
                "opt": opt.state_dict(), "rec": rec, "state": st, "rng": _rng_state(device)},
                checkpoint)  # fmt: skip

    def get_batch(step):
        if s["pack"]:  # each source file in a crop is its own document
            x, y, cu, mx = data.packed_batch(s["batch"], seed, step)
            return x.to(device), y.to(device), {"cu_seqlens": cu.to(device), "max_seqlen": mx}
        x, y = data.batch(s["batch"], seed, step)
        return x.to(device), y.to(device), {}

    def finish_call():
        call.update(end_step=st["step"], end_train_s=round(st["train_s"], 1),
                    wall_s=round(time.perf_counter() - t_call, 1))  # fmt: skip
        if device.type == "cuda":
            call["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)

    def do_eval():
        te = time.perf_counter()
        ev = evaluate(model, data, s, device, autocast)
        st["eval_s"] += time.perf_counter() - te
        ev = {"step": st["step"], "train_s": round(st["train_s"], 1),
              "tokens": st["step"] * s["batch"] * s["seq_len"], **ev}  # fmt: skip
        rec["evals"].append(ev)
        rec.update({k: v for k, v in ev.items() if k.startswith("bpb")})
        log(f"  [{attention}] step {st['step']} train {st['train_s'] / 60:.1f} min: val bpb "
            + " ".join(f"{k[3:] or 'all'} {v:.4f}" for k, v in ev.items() if k.startswith("bpb")))

    if st["done"]:
        log(f"  [{attention}] already finished at step {st['step']}: nothing to train")
        finish_call()
        return rec

    # untimed warm-up: forward + backward of the next batch, gradients dropped (compilation and
    # autotuning happen here, in every call, for every attention; the RNG is put back)
    rng = _rng_state(device)
    x, y, kw = get_batch(st["step"])
    with autocast:
        _, loss = model(x, y, return_logits=False, **kw)
    loss.backward()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    _set_rng_state(rng, device)
    call["setup_s"] = round(time.perf_counter() - t_call, 1)

    seg0, base = time.perf_counter(), st["train_s"]  # training time = base + time since seg0
    while True:
        tt = base + time.perf_counter() - seg0
        if tt >= cap or (s["max_steps"] and st["step"] >= s["max_steps"]):
            break
        ne, es = st["next_eval_s"], s["eval_every_steps"]
        due = (ne is not None and tt >= ne) or (
            es and st["step"] > 0 and st["step"] % es == 0
            and (not rec["evals"] or rec["evals"][-1]["step"] != st["step"]))  # fmt: skip
        if due:
            _sync(device)
            st["train_s"] = base + time.perf_counter() - seg0
            if ne is not None:
                while st["next_eval_s"] <= st["train_s"]:
                    st["next_eval_s"] += 60.0 * s["eval_every_min"]
            do_eval()
            save()
            if progress is not None:
                progress(rec)
            seg0, base = time.perf_counter(), st["train_s"]
            continue
        if (pause_s is not None and time.perf_counter() - t_call >= pause_s) or (
            pause_steps is not None and st["step"] - call["start_step"] >= pause_steps
        ):
            _sync(device)
            st["train_s"] = base + time.perf_counter() - seg0
            rec.update(paused=True, steps=st["step"], train_s=round(st["train_s"], 1),
                       eval_s=round(st["eval_s"], 1))  # fmt: skip
            finish_call()
            save()
            log(f"  [{attention}] paused at step {st['step']}, {st['train_s']:.0f} s of "
                f"training -> {checkpoint}")
            return rec
        step = st["step"]
        lr = s["lr"] * lr_factor(s, step, tt)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, kw = get_batch(step)
        with autocast:
            _, loss = model(x, y, return_logits=False, **kw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        st["step"] += 1
        if st["step"] % 10 == 0 or st["step"] == 1:
            rec["train_bpb_curve"].append((st["step"], round(loss.item() / math.log(2), 4)))
    _sync(device)
    st["train_s"] = base + time.perf_counter() - seg0
    if not rec["evals"] or rec["evals"][-1]["step"] != st["step"]:
        do_eval()
    st["done"] = True
    step = st["step"]
    rec.update(steps=step, train_s=round(st["train_s"], 1), eval_s=round(st["eval_s"], 1),
               tokens=step * s["batch"] * s["seq_len"],
               epochs=round(step * s["batch"] * s["seq_len"] / corpus["train_bytes"], 2))  # fmt: skip
    finish_call()
    save()
    if progress is not None:
        progress(rec)
    return rec


def markdown(s: dict, runs: list[dict], env: dict) -> str:
    title = "Byte-level LM on the Python standard library: " + " vs ".join(
        dict.fromkeys(r["attention"] for r in runs))
    lines = results_header(title, info=env, extra=[
        f"the corpus depends on the python version ({env['versions']['python']})",
        f"corpus: {env['train_files']} train files ({env['train_bytes']} bytes), "
        f"{env['val_files']} validation files ({env['val_bytes']} bytes) under "
        f"`{env['stdlib_root']}` (rule: `dilated_attention.data.stdlib_source_files`)",
        f"preset `{s.get('preset')}`: dim {s['dim']}, {s['n_layer']} layers, {s['n_head']} heads, "
        f"ffn {s['ffn_dim']}, dropout {s['dropout']}, weight decay {s['weight_decay']}; dilated w = {list(s['segments'])}, "
        f"r = {list(s['rates'])}; dense w >= N, r = 1; local w = {s['local_window']}, r = 1; "
        f"N = {s['seq_len']}, batch {s['batch']}, lr {s['lr']} ({s['schedule']}"
        + (f" to {s['min_lr_ratio']} x" if s["schedule"] == "cosine" else "")
        + f"), warmup {s['warmup']}, {s['dtype']}, activation checkpointing "
        f"{s['checkpoint_activations']}; cap {s['max_minutes']} min of training time each"
        + (f" or {s['max_steps']} steps" if s["max_steps"] else "")
        + ("; training crops packed (each file its own document)" if s["pack"] else ""),
        "training time: the training steps only, summed over the calls of a paused run (evals, "
        "checkpoint writes and one untimed warm-up step per call left out: `eval s`, `setup s`)",
        (f"validation: {s['val_seqs']} fixed crops of N bytes at offsets {env.get('val_starts')} "
         "of the validation split (the same for every attention); bits per byte by position "
         "in the context (crops cross file boundaries; the first bucket is inside the local window)"
         if s["val"] == "crops" else
         f"validation: every validation file from its first byte (cut to N bytes), each its own "
         f"document (packed whole into {env.get('val_rows')} rows of N); bits per byte by position "
         f"in the file, the model seeing only that file (the first bucket is inside the local "
         f"window); scored bytes per bucket: {env.get('bucket_bytes')}"),
        "best = the eval with the lowest validation bits per byte (the early-stopping point); "
        "last = the final eval",
    ])  # fmt: skip
    done = [r for r in runs if r["evals"]]
    bk = [k for k in done[0]["evals"][-1] if k.startswith("bpb[")] if done else []
    lines += [
        "",
        "| attention | seed | params | steps | train min | eval s | setup s | calls | epochs | "
        "last val bpb | best val bpb (train min) | " + " | ".join(f"best {k}" for k in bk) + " |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
        + " | ".join("---" for _ in bk) + " |",
    ]
    for r in done:
        last, best = r["evals"][-1], best_eval(r)
        state = " (paused)" if r.get("paused") else ("" if "epochs" in r else " (in progress)")
        setup = sum(c.get("setup_s", 0.0) for c in r["calls"])
        lines.append(
            f"| {r['attention']}{state} | {r['seed']} | {r['params'] / 1e6:.2f}M | "
            f"{r.get('steps', last['step'])} | {r.get('train_s', last['train_s']) / 60:.1f} | "
            f"{r.get('eval_s', '')} | {setup:.0f} | {len(r['calls'])} | {r.get('epochs', '')} | "
            f"{last['bpb']:.4f} | {best['bpb']:.4f} ({best['train_s'] / 60:.1f}) | "
            + " | ".join(f"{best[k]:.4f}" for k in bk) + " |"
        )
    lines += ["", "## Every eval", ""]
    for r in done:
        lines += [
            f"### {r['attention']}, seed {r['seed']}",
            "",
            "| step | train min | bytes seen | val bpb | " + " | ".join(bk) + " |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in bk) + " |",
        ]
        for ev in r["evals"]:
            lines.append(
                f"| {ev['step']} | {ev['train_s'] / 60:.1f} | {ev['tokens']} | {ev['bpb']:.4f} | "
                + " | ".join(f"{ev[k]:.4f}" for k in bk) + " |"
            )
        calls = "; ".join(
            f"{c['date']}: steps {c['start_step']}-{c.get('end_step', '?')}, setup "
            f"{c.get('setup_s', '?')} s, wall {c.get('wall_s', '?')} s"
            + (f", peak {c['peak_gib']} GiB" if "peak_gib" in c else "")
            for c in r["calls"]
        )  # fmt: skip
        lines += ["", f"calls: {calls}", ""]
    return "\n".join(lines) + "\n"


def plot(s: dict, runs: list[dict], path: str) -> bool:
    """Bits per byte against position (best eval of each run, log-spaced bins) and validation
    bits per byte against training time, every run on one figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [r for r in runs if r["evals"]]
    if not runs:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        best = best_eval(r)
        rows = [row for row in best["curve"] if row[0] > 0]  # position 0 has no context
        lab = f"{r['attention']} seed {r['seed']} (best: {best['train_s'] / 60:.0f} min, {best['step']} steps)"
        ax1.plot([math.sqrt(a * b) for a, b, _ in rows], [v for _, _, v in rows], lw=1.2, label=lab)
        ax2.plot([ev["train_s"] / 60 for ev in r["evals"]], [ev["bpb"] for ev in r["evals"]],
                 marker="o", ms=3, label=f"{r['attention']} seed {r['seed']}")  # fmt: skip
    ax1.axvline(s["local_window"], color="gray", ls=":", lw=0.8, label="local window")
    where = "file" if s.get("val", "crops") == "files" else "context"
    ax1.set(xscale="log", xlabel=f"position in the {where} (bytes)", ylabel="bits per byte",
            title=f"held-out stdlib files, N = {s['seq_len']}")  # fmt: skip
    ax2.set(xlabel="training time (min)", ylabel="validation bits per byte", title="during training")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: str, s: dict, env: dict, runs: list[dict], with_plot: bool = True) -> bool:
    with open(out + ".json", "w") as f:
        json.dump({"settings": _jsonable(s), "env": env, "runs": runs}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(s, runs, env))
    return with_plot and plot(s, runs, out + ".png")


def merge(paths: list[str], out: str) -> int:
    """One report and one figure from the JSON files of runs made in separate calls."""
    reps = [json.load(open(p)) for p in paths]
    s = reps[0]["settings"]
    for p, rep in zip(paths[1:], reps[1:], strict=True):
        other = {k: rep["settings"].get(k) for k in ("seq_len", "val_seqs", "local_window", "val")}
        if other != {k: s.get(k) for k in other}:
            raise ValueError(f"{p}: settings {other} differ from {paths[0]}'s")
    runs = [r for rep in reps for r in rep["runs"]]
    env = dict(reps[-1]["env"], command=" ; ".join(rep["env"]["command"] for rep in reps))
    write_report(out, s, env, runs)
    print(markdown(s, runs, env))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path prefix: OUT.md, OUT.json, OUT.png")
    p.add_argument("--preset", default="h100-64k", choices=sorted(PRESETS))
    p.add_argument("--tiny", action="store_true", help="--preset tiny: a CPU check in seconds")
    p.add_argument("--attention", help="comma list of dilated,dense,local (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, help="training-time cap per run")
    p.add_argument("--max-steps", type=int, help="step cap per run (and the cosine's length)")
    p.add_argument("--eval-every-min", type=float, help="eval every so many training minutes")
    p.add_argument("--eval-every-steps", type=int, help="eval every so many steps")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--val-seqs", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dropout", type=float)
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices")
    p.add_argument("--val", choices=("files", "crops"),
                   help="validation: whole files by position in the file, or crops of the split")
    p.add_argument("--impl", default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--pack", action=argparse.BooleanOptionalAction, default=None,
        help="train on packed documents: each source file in a crop is its own sequence (no byte "
        "attends to or predicts a byte of another file; dilated_attention_varlen); default: the "
        "preset's",
    )  # fmt: skip
    p.add_argument("--pause-after-minutes", type=float,
                   help="stop this call after so many minutes (its wall clock), saving to --checkpoint")
    p.add_argument("--pause-after-steps", type=int, help="stop this call after so many steps")
    p.add_argument("--checkpoint", help="save the run here (after every eval and at a pause)")
    p.add_argument("--resume", help="a checkpoint to continue from")
    p.add_argument("--merge", help="comma list of OUT.json files: one report and figure, no training")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge.split(","), args.out)
    preset = "tiny" if args.tiny else args.preset
    s = dict(PRESETS[preset], preset=preset, impl=args.impl)
    for key in ("max_minutes", "max_steps", "eval_every_min", "eval_every_steps", "seq_len",
                "batch", "val_seqs", "lr", "dropout", "weight_decay", "val", "pack"):  # fmt: skip
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    attentions = (args.attention or s["attentions"]).split(",")
    pausing = args.pause_after_minutes is not None or args.pause_after_steps is not None
    if (pausing or args.resume) and len(attentions) != 1:
        p.error("--pause-after-* / --resume take one --attention")
    if pausing and not args.checkpoint:
        p.error("--pause-after-* needs --checkpoint PATH")
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
        "val_bytes": len(data.val_data), "bucket_bytes": bucket_counts(data, s),
    }  # fmt: skip
    if s["val"] == "crops":
        env["val_starts"] = val_starts(data, s["val_seqs"])
    else:
        env["val_rows"] = len(data.val_packed(s["seq_len"]))
    runs: list[dict] = []

    def write(extra=None):  # after every eval (no plot) and every run: a killed call keeps its results
        write_report(args.out, s, env, runs + ([extra] if extra is not None else []), extra is None)

    for attention in attentions:
        print(f"run: {attention}", flush=True)
        runs.append(train_one(
            s, attention, data, args.seed, log=lambda m: print(m, flush=True), progress=write,
            resume=args.resume, checkpoint=args.checkpoint,
            pause_s=None if args.pause_after_minutes is None else 60 * args.pause_after_minutes,
            pause_steps=args.pause_after_steps,
        ))  # fmt: skip
        r = runs[-1]
        print(f"  {r['steps']} steps, {r['train_s']:.0f} s of training"
              + (", paused" if r.get("paused") else "")
              + (f", val bpb {r['bpb']:.4f}" if "bpb" in r else ""), flush=True)  # fmt: skip
        write()
    print()
    print(markdown(s, runs, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
