"""``dilated-attention train``: train a LongNet LM on synthetic long-range retrieval or bytes.

The command line lives in ``cli.py``; this file provides :func:`add_train_arguments` (the flags of
the ``train`` subcommand) and :func:`run_train` (the loop): AdamW, linear warmup then cosine decay,
gradient clipping, periodic eval (retrieval accuracy per distance, or validation loss on text),
checkpoint + ``--resume``, a JSON-lines and a CSV log, and a loss plot.

Sequence parallelism: launched by ``torchrun`` with ``WORLD_SIZE > 1`` (or called inside an
initialised process group), all ranks form one sequence-parallel group (:func:`parallelize`). Every
rank builds the same model from ``--seed`` and generates the same global batch (batches are a pure
function of ``(seed, step)``), takes its contiguous shard of the sequence (:func:`~.distributed.shard_sequence`) and
computes ``sum of its token losses / global token count``; after backward the gradients are summed
over the ranks, which is exactly the gradient of the single-process loss (the attention backward
already routes the K/V gradients of other ranks' queries to the owner). Eval is sequence-parallel
too; logs, checkpoints, progress and plots are written by rank 0 only.

``--attention dense`` / ``local`` train a model of the same size whose attention is one branch
``w >= N, r = 1`` (dense) or ``w = --local-window, r = 1`` (local), as baselines.

Outputs in ``--out-dir``: ``config.json``, ``log.jsonl``, ``log.csv``, ``ckpt.pt``,
``summary.json``, ``loss.png`` (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time

import torch

from .data import IGNORE, ByteText, RetrievalTask
from .distributed import shard_sequence
from .models.longnet import LongNetConfig, LongNetLM
from .models.parallelize import parallelize

# A training preset = a model preset + the task and optimisation settings that go with it.
# "tiny": CPU, a few minutes on 2 cores. "small"/"base": one GPU, 32K-token sequences.
TRAIN_PRESETS: dict[str, dict] = {
    "tiny": dict(
        model=dict(),
        seq_len=256,
        batch_size=32,
        steps=600,
        lr=3e-3,
        warmup=20,
        local_window=32,
        num_pairs=1,
        min_distance=8,
        max_distance=256,
        eval_distances=(16, 64, 128, 256),
        eval_every=100,
        eval_samples=256,
        device="cpu",
        dtype="float32",
    ),
    "small": dict(
        model=dict(vocab_size=128, max_seq_len=32768),
        seq_len=32768,
        batch_size=8,
        steps=900,
        lr=2e-3,
        warmup=50,
        local_window=1024,
        num_pairs=1,
        min_distance=64,
        max_distance=32768,
        eval_distances=(512, 2048, 8192, 16384, 32768),
        eval_every=300,
        eval_samples=32,
        device="cuda",
        dtype="bfloat16",
    ),
    "base": dict(
        model=dict(vocab_size=128, max_seq_len=32768),
        seq_len=32768,
        batch_size=2,
        steps=5000,
        lr=6e-4,
        warmup=200,
        local_window=2048,
        num_pairs=8,
        min_distance=64,
        max_distance=32768,
        eval_distances=(1024, 4096, 16384, 32768),
        eval_every=500,
        eval_samples=32,
        device="cuda",
        dtype="bfloat16",
    ),
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``dilated-attention train``; unset flags take the preset's value."""
    p = parser
    p.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(TRAIN_PRESETS),
        help="model + task preset (tiny: CPU minutes; small/base: one GPU, 32K tokens)",
    )
    p.add_argument(
        "--attention",
        default="dilated",
        choices=("dilated", "dense", "local"),
        help="dilated (the preset's branches) or a same-size baseline",
    )
    p.add_argument("--local-window", type=int, help="window w of --attention local")
    p.add_argument(
        "--impl", default="auto", choices=("auto", "reference", "torch", "triton"),
        help="dilated attention implementation",
    )
    p.add_argument("--text-file", help="train a byte-level LM on this file instead of retrieval")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--num-pairs", type=int, help="retrieval: key-value pairs per sequence")
    p.add_argument("--min-distance", type=int, help="retrieval: shortest planted distance (train)")
    p.add_argument("--max-distance", type=int, help="retrieval: longest planted distance (train)")
    p.add_argument(
        "--eval-distances",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="retrieval: comma-separated distances for accuracy-vs-distance",
    )
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, help="optimizer steps in total")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, times --lr")
    p.add_argument("--warmup", type=int, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--eval-every", type=int, help="optimizer steps between evaluations")
    p.add_argument("--eval-samples", type=int, help="sequences per eval point")
    p.add_argument(
        "--save-every", type=int, default=0, help="checkpoint period (0: eval points and end)"
    )
    p.add_argument("--out-dir", default="runs/train", help="where logs, checkpoint and plot go")
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an OUT_DIR that holds an earlier run, deleting its checkpoint and logs",
    )
    p.add_argument(
        "--stop-at",
        type=int,
        help="save and stop after this step (the schedule still "
        "runs to --steps): for time-limited jobs, continue with --resume",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data and initialisation")
    p.add_argument("--device", help="cpu / cuda (default: the preset's, cpu if no GPU)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="autocast dtype on GPU (parameters stay float32)",
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads on CPU")
    p.add_argument(
        "--checkpoint-activations", action="store_true", help="recompute activations in the backward"
    )
    p.add_argument("--no-progress", action="store_true", help="plain prints instead of tqdm")
    p.add_argument("--no-plot", action="store_true", help="do not write loss.png")


def _settings(args: argparse.Namespace) -> dict:
    """The preset's values overridden by every flag that was given."""
    s = dict(TRAIN_PRESETS[args.preset])
    s["model"] = dict(s["model"])
    for key in (
        "local_window",
        "seq_len",
        "num_pairs",
        "min_distance",
        "max_distance",
        "eval_distances",
        "batch_size",
        "steps",
        "lr",
        "warmup",
        "eval_every",
        "eval_samples",
        "device",
        "dtype",
    ):
        val = getattr(args, key, None)
        if val is not None:
            s[key] = val
    if s["device"] == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: running on cpu", file=sys.stderr)
        s["device"], s["dtype"] = "cpu", "float32"
    s["max_distance"] = min(s["max_distance"], s["seq_len"])
    s["eval_distances"] = tuple(d for d in s["eval_distances"] if d <= s["seq_len"])
    return s


def _lr_at(step: int, s: dict, min_ratio: float) -> float:
    """Linear warmup to lr, then cosine to min_ratio * lr at the last step."""
    lr, warm, total = s["lr"], s["warmup"], s["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class _Progress:
    """tqdm when installed and wanted, else a print every ~5% of the run; silent when disabled."""

    def __init__(self, total: int, initial: int, plain: bool, enabled: bool = True):
        self.bar = None
        self.enabled = enabled
        if enabled and not plain:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True)
            except ImportError:
                pass
        self.total, self.every = total, max(1, total // 20)

    def update(self, step: int, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(msg)
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            print(f"step {step + 1}/{self.total} {msg}", flush=True)

    def write(self, msg: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------ sequence parallelism


def _dist_env() -> tuple[int, int, int]:
    """(world_size, rank, local_rank): of the initialised default group, else of torchrun's env."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        return world, rank, int(os.environ.get("LOCAL_RANK", rank))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    return world, rank, int(os.environ.get("LOCAL_RANK", rank))


def _init_sp(device: torch.device, local_rank: int):
    """Join (or reuse) the default process group; returns (group, device, owns_group)."""
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        # NVLink SHARP (multicast) is off unless asked for: not every machine supports it.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        owns = True
    return dist.group.WORLD, device, owns


def _lm_loss(model, x, y, count: int, autocast) -> torch.Tensor:
    """Sum of the token losses of (x, y) (this rank's shard, or all) over ``count``: the global
    number of scored targets. Summed over the ranks this is the single-process mean loss."""
    with autocast:
        # chunked head + loss: no (B, T, V) logits tensor (LongNetLM.forward)
        _, loss = model(x, y, return_logits=False, loss_reduction="sum")
    return loss / count


def _allreduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(t, group=group)
    return t


def _allreduce_grads(params: list, group) -> None:
    """Sum the gradients over the sequence-parallel ranks (one flat all-reduce)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _allreduce_sum(torch.cat([g.reshape(-1) for g in grads]), group)
    off = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[off : off + n].view_as(p)
        off += n


def _shard(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else shard_sequence(x, group).contiguous()


@torch.no_grad()
def evaluate(model, data, s: dict, seed: int, device, autocast, group=None) -> dict:
    """Retrieval: accuracy per distance and over random distances. Text: validation loss.

    With ``group`` (sequence-parallel model) every rank scores its shard and the counts are summed.
    """
    was_training = model.training
    model.eval()
    bs = s["batch_size"]
    nb = max(1, math.ceil(s["eval_samples"] / bs))
    out = {}
    # Eval batches use steps >= 10**9 of seed + 1: never the training batches. Every distance
    # gets the same sequences (filler, keys, values) with only the planted block moved: a
    # paired comparison in which distance is the only variable.
    if isinstance(data, RetrievalTask):
        for d in (None, *s["eval_distances"]):
            counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, total
            for i in range(nb):
                x, y = data.batch(bs, seed + 1, 10**9 + i, distance=d)
                x, y = _shard(x, group).to(device), _shard(y, group).to(device)
                with autocast:
                    h = model.hidden_states(x)  # (B, T, E); logits only at the scored rows
                    mask = y != IGNORE
                    logits = model.lm_head(h[mask]).float()  # (M, V)
                c = int((logits.argmax(-1) == y[mask]).sum())
                t = int(mask.sum())
                counts += torch.tensor([c, t], dtype=torch.float64, device=device)
            correct, total = _allreduce_sum(counts, group).tolist()
            out["acc" if d is None else f"acc@{d}"] = correct / max(total, 1.0)
    else:
        losses = []
        for i in range(nb):
            x, y = data.batch(bs, seed + 1, 10**9 + i, split="val")
            count = max(1, int((y != IGNORE).sum()))
            x, y = _shard(x, group).to(device), _shard(y, group).to(device)
            loss = _lm_loss(model, x, y, count, autocast)
            losses.append(_allreduce_sum(loss.detach(), group).item())
        out["val_loss"] = sum(losses) / len(losses)
        out["val_bpb"] = out["val_loss"] / math.log(2)
    model.train(was_training)
    return out


def _save(path: str, model, opt, step: int, cfg: LongNetConfig, s: dict, history: list) -> None:
    tmp = path + ".tmp"
    torch.save({
        "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
        "config": dataclasses.asdict(cfg), "settings": s, "history": history,
        "rng": torch.get_rng_state(),
    }, tmp)  # fmt: skip
    os.replace(tmp, path)  # never leave a half-written checkpoint


def load_checkpoint(path: str, map_location="cpu"):
    """(model, checkpoint dict) from a ``ckpt.pt`` written by :func:`run_train`."""
    ck = torch.load(path, map_location=map_location, weights_only=False)
    model = LongNetLM(LongNetConfig(**ck["config"]))
    model.load_state_dict(ck["model"])
    return model, ck


def _plot(history: list, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [h for h in history if any(k.startswith("acc") or k == "val_loss" for k in h)]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        ax[0].plot(*zip(*train, strict=True), lw=0.8)
    ax[0].set(xlabel="step", ylabel="train loss (answer tokens)", title=title)
    keys = {k for h in evals for k in h if k.startswith("acc") or k == "val_loss"}
    for key in sorted(keys, key=lambda k: int(k.split("@")[1]) if "@" in k else -1):
        pts = [(h["step"], h[key]) for h in evals if key in h]
        ax[1].plot(*zip(*pts, strict=True), marker="o", label=key)
    ax[1].set(xlabel="step", ylabel="eval")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


# What a run writes into --out-dir; a directory holding any of them holds an earlier run.
RUN_FILES = ("ckpt.pt", "log.jsonl", "log.csv", "config.json", "summary.json", "loss.png")


def check_out_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a directory that holds an earlier run unless told what to do with it.

    Raises ``FileExistsError`` (a run is there, neither flag given) or ``ValueError`` (both flags).
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other; give one of them")
    if resume or overwrite:
        return
    found = [n for n in RUN_FILES if os.path.exists(os.path.join(out_dir, n))]
    if found:
        raise FileExistsError(
            f"--out-dir {out_dir} already holds a run ({', '.join(found)}); pass --resume to "
            "continue it, --overwrite to replace it, or choose another --out-dir"
        )


def run_train(args: argparse.Namespace) -> int:
    """Train as the flags say; returns 0 on success.

    Under ``torchrun`` (``WORLD_SIZE > 1``) or in an initialised process group, all ranks train
    one model sequence-parallel (see the module docstring); ``--seq-len`` must be divisible by
    the number of ranks.
    """
    check_out_dir(args.out_dir, args.resume, getattr(args, "overwrite", False))
    s = _settings(args)
    world, rank, local_rank = _dist_env()
    if getattr(args, "overwrite", False) and rank == 0:
        for name in RUN_FILES:
            path = os.path.join(args.out_dir, name)
            if os.path.exists(path):
                os.remove(path)
    if world > 1 and s["seq_len"] % world != 0:
        raise ValueError(
            f"sequence-parallel training over {world} ranks: --seq-len {s['seq_len']} is not "
            f"divisible by the world size {world}; use a multiple of {world} "
            f"(e.g. {s['seq_len'] - s['seq_len'] % world or world})"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(s["device"])
    group, owns_group = None, False
    if world > 1:
        group, device, owns_group = _init_sp(device, local_rank)
    try:
        return _train(args, s, device, group, rank, world)
    finally:
        if owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(args, s: dict, device: torch.device, group, rank: int, world: int) -> int:
    main_rank = rank == 0
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    if main_rank:
        os.makedirs(args.out_dir, exist_ok=True)

    if args.text_file:
        data = ByteText(args.text_file, s["seq_len"])
        vocab = 256
    else:
        data = RetrievalTask(
            seq_len=s["seq_len"],
            num_pairs=s["num_pairs"],
            min_distance=s["min_distance"],
            max_distance=s["max_distance"],
        )
        vocab = s["model"].get("vocab_size", LongNetConfig.preset(args.preset).vocab_size)
        if vocab < data.vocab_size:
            raise ValueError(f"model vocab {vocab} < task vocab {data.vocab_size}")
    cfg = LongNetConfig.preset(args.preset, **{**s["model"], "vocab_size": vocab})
    cfg = dataclasses.replace(
        cfg.with_attention(args.attention, s["seq_len"], s["local_window"]),
        impl=args.impl,
        checkpoint_activations=args.checkpoint_activations or cfg.checkpoint_activations,
    )

    torch.manual_seed(args.seed)
    model = LongNetLM(cfg).to(device)
    params = list(model.parameters())  # shared (tied) parameters once
    if group is not None:
        import torch.distributed as dist

        parallelize(model, group)
        for p in params:  # the same seed gives the same init; make sure of it
            dist.broadcast(p.data, src=0, group=group)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=s["lr"],
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    start, history = 0, []
    if args.resume:
        if not os.path.exists(ckpt_path):
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        if ck["config"] != dataclasses.asdict(cfg):
            raise ValueError(
                f"--resume: {ckpt_path} was written with another model config; use another --out-dir"
            )
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start, history = ck["step"], ck["history"]
        torch.set_rng_state(ck["rng"])
        if main_rank:
            print(f"resumed from {ckpt_path} at step {start}")

    amp_dtype = getattr(torch, s["dtype"])
    autocast = torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32)
    tokens_per_step = s["batch_size"] * s["seq_len"]  # global, over all ranks
    if main_rank:
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump(
                {
                    "model": dataclasses.asdict(cfg),
                    "settings": s,
                    "args": vars(args),
                    "params": model.num_params(),
                    "torch": torch.__version__,
                    "world_size": world,
                    "device": str(device),
                    "device_name": _device_name(device),
                },
                f,
                indent=1,
                default=str,
            )
        task = "text" if args.text_file else "retrieval"
        sp = f", sequence-parallel over {world} ranks" if world > 1 else ""
        print(
            f"{args.attention} LongNet ({args.preset}): {model.num_params() / 1e6:.2f}M params, "
            f"branches w={list(cfg.segment_lengths)} r={list(cfg.dilation_rates)}, task={task}, "
            f"N={s['seq_len']}, batch={s['batch_size']}, steps={s['steps']}, device={device}{sp}",
            flush=True,
        )

    log_jsonl = None
    if main_rank:
        log_jsonl = open(os.path.join(args.out_dir, "log.jsonl"), "a" if args.resume else "w")
    bar = _Progress(s["steps"], start, args.no_progress, enabled=main_rank)
    model.train()
    t0 = time.perf_counter()
    last = {}
    step_times = []  # seconds per optimizer step of this process (no eval, no checkpoint)
    try:
        for step in range(start, s["steps"]):
            ts = time.perf_counter()
            lr = _lr_at(step, s, args.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = data.batch(s["batch_size"], args.seed, step)  # the global batch, every rank
            count = max(1, int((y != IGNORE).sum()))  # scored targets in the global batch
            x, y = _shard(x, group), _shard(y, group)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = _lm_loss(model, x, y, count, autocast)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if group is not None:
                _allreduce_grads(params, group)
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            loss_val = _allreduce_sum(loss.detach().clone(), group).item()  # syncs the step
            step_times.append(time.perf_counter() - ts)
            rec = {
                "step": step + 1,
                "loss": loss_val,
                "lr": lr,
                "grad_norm": float(gnorm),
                "step_s": step_times[-1],
                "time_s": time.perf_counter() - t0,
            }
            done = step + 1
            if done % s["eval_every"] == 0 or done == s["steps"]:
                rec.update(evaluate(model, data, s, args.seed, device, autocast, group))
                last = {k: v for k, v in rec.items() if k.startswith(("acc", "val_"))}
                bar.write(
                    f"step {done}: loss {rec['loss']:.4f} "
                    + " ".join(f"{k} {v:.3f}" for k, v in last.items())
                )
            history.append(rec)
            if main_rank:
                log_jsonl.write(json.dumps(rec) + "\n")
                log_jsonl.flush()
                if (
                    (args.save_every and done % args.save_every == 0)
                    or done % s["eval_every"] == 0
                    or done == s["steps"]
                ):
                    _save(ckpt_path, model, opt, done, cfg, s, history)
            bar.update(step, f"loss {rec['loss']:.3f} lr {lr:.2e}")
            if args.stop_at is not None and done >= args.stop_at:
                if main_rank:
                    _save(ckpt_path, model, opt, done, cfg, s, history)
                break
    finally:
        bar.close()
        if log_jsonl is not None:
            log_jsonl.close()
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)  # every rank finished its steps (rank 0 wrote the checkpoint)
    if not main_rank:
        return 0

    keys = sorted({k for h in history for k in h}, key=lambda k: (k != "step", k))
    with open(os.path.join(args.out_dir, "log.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(history)
    # Throughput over this process's steps, leaving out the first ones (allocator warm-up, kernel
    # autotuning and compilation): tokens of the global batch per second of step time.
    skip = min(5, len(step_times) // 4)
    timed = step_times[skip:]
    tok_s = tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else None
    summary = {
        "attention": args.attention,
        "preset": args.preset,
        "steps": s["steps"],
        "train_time_s": time.perf_counter() - t0,
        "final_loss": history[-1]["loss"] if history else None,
        "params": model.num_params(),
        "world_size": world,
        "tokens_per_step": tokens_per_step,
        "step_s": sum(timed) / len(timed) if timed else None,
        "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / world if tok_s is not None else None,
        "throughput_steps_skipped": skip,
        **last,
    }
    if isinstance(data, RetrievalTask):
        summary["chance"] = data.chance
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if not args.no_plot and _plot(
        history, os.path.join(args.out_dir, "loss.png"), f"{args.attention} ({args.preset})"
    ):
        print(f"plot: {os.path.join(args.out_dir, 'loss.png')}")
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dilated_attention.train`` (the same flags as ``dilated-attention train``)."""
    parser = argparse.ArgumentParser(
        prog="dilated-attention train", description=__doc__.split("\n\n")[0]
    )
    add_train_arguments(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
