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

from .argtypes import (
    device_arg,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    positive_int_list,
    unit_float,
)
from .data import IGNORE, ByteText, RetrievalTask
from .distributed import shard_sequence
from .models.longnet import LongNetConfig, LongNetLM
from .models.parallelize import parallelize
from .timing import device_name

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


# flags whose default comes from the preset (the help text lists each preset's value)
_PRESET_KEYS = (
    "local_window", "seq_len", "num_pairs", "min_distance", "max_distance", "eval_distances",
    "batch_size", "steps", "lr", "warmup", "eval_every", "eval_samples", "device", "dtype",
)


def _preset_help(text: str, key: str) -> str:
    def show(v):
        return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)

    vals = ", ".join(f"{name} {show(p[key])}" for name, p in sorted(TRAIN_PRESETS.items()))
    return f"{text} (default: the preset's: {vals})"


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``dilated-attention train`` (and ``python -m dilated_attention.train``);
    unset flags take the preset's value. Types reject bad single values; :func:`check_train_args`
    checks what depends on several flags."""
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
    p.add_argument("--local-window", type=positive_int, help=_preset_help("window w of --attention local", "local_window"))
    p.add_argument(
        "--impl", default="auto", choices=("auto", "reference", "torch", "triton"),
        help="dilated attention implementation",
    )
    _add_task_arguments(p)
    _add_optimizer_arguments(p)
    _add_run_arguments(p)


def _add_task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-file", help="train a byte-level LM on this file instead of retrieval")
    p.add_argument("--seq-len", type=positive_int, help=_preset_help("tokens per sequence", "seq_len"))
    p.add_argument("--num-pairs", type=positive_int, help=_preset_help("retrieval: key-value pairs per sequence", "num_pairs"))
    p.add_argument("--min-distance", type=positive_int,
                   help=_preset_help("retrieval: shortest planted distance (train)", "min_distance"))
    p.add_argument("--max-distance", type=positive_int,
                   help=_preset_help("retrieval: longest planted distance (train; at most --seq-len)", "max_distance"))
    p.add_argument(
        "--eval-distances", type=positive_int_list,
        help=_preset_help("retrieval: comma-separated distances for accuracy-vs-distance", "eval_distances"),
    )


def _add_optimizer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=positive_int, help=_preset_help("sequences per optimizer step", "batch_size"))
    p.add_argument("--steps", type=positive_int, help=_preset_help("optimizer steps in total", "steps"))
    p.add_argument("--lr", type=positive_float, help=_preset_help("peak learning rate", "lr"))
    p.add_argument("--min-lr-ratio", type=unit_float, default=0.1, help="cosine floor, times --lr (0 to 1)")
    p.add_argument("--warmup", type=nonnegative_int, help=_preset_help("linear warmup steps", "warmup"))
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=positive_float, default=1.0, help="gradient-norm clip")
    p.add_argument("--eval-every", type=positive_int, help=_preset_help("optimizer steps between evaluations", "eval_every"))
    p.add_argument("--eval-samples", type=positive_int, help=_preset_help("sequences per eval point", "eval_samples"))


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--save-every", type=nonnegative_int, default=0, help="checkpoint period (0: eval points and end)"
    )
    p.add_argument("--out-dir", default="runs/train", help="where logs, checkpoint and plot go")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT_DIR/ckpt.pt (with the model, data and --seed settings it was written with)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an OUT_DIR that holds an earlier run, deleting its checkpoint and logs",
    )
    p.add_argument(
        "--stop-at",
        type=positive_int,
        help="save and stop after this step (the schedule still "
        "runs to --steps): for time-limited jobs, continue with --resume",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data and initialisation")
    p.add_argument("--device", type=device_arg,
                   help=_preset_help("cpu / cuda; cpu when the preset's is cuda and there is no GPU", "device"))
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help=_preset_help("autocast dtype on GPU (parameters stay float32)", "dtype"),
    )
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads on CPU (default: torch's)")
    p.add_argument(
        "--checkpoint-activations", action="store_true", help="recompute activations in the backward"
    )
    p.add_argument(
        "--nccl-nvls", choices=("on", "off"), default=None,
        help="sequence-parallel on GPUs: set NCCL_NVLS_ENABLE (NVLink SHARP) for this process before "
        "the process group starts (default: leave the environment as it is; pass off on machines "
        "without NVLink multicast)",
    )
    p.add_argument("--no-progress", action="store_true", help="plain prints instead of tqdm")
    p.add_argument("--no-plot", action="store_true", help="do not write loss.png")


def _given(args: argparse.Namespace, key: str, s: dict) -> str:
    """How a value is named in an error: the flag the user gave, or the preset that chose it."""
    flag = "--" + key.replace("_", "-")
    if getattr(args, key, None) is not None:
        return f"{flag} {s[key]}"
    return f"{s[key]} (the {args.preset} preset's {flag})"


def check_train_args(args: argparse.Namespace) -> None:
    """Every check that needs more than one flag, before anything runs or is written.

    Raises ``ValueError`` (or ``FileExistsError`` / ``FileNotFoundError``) with one line naming
    the flags and the fix; the command line turns it into exit status 2."""
    check_out_dir(args.out_dir, args.resume, getattr(args, "overwrite", False))
    if args.resume and not os.path.exists(os.path.join(args.out_dir, "ckpt.pt")):
        raise FileNotFoundError(
            f"--resume: no checkpoint at {os.path.join(args.out_dir, 'ckpt.pt')}; start without "
            "--resume or point --out-dir at an earlier run"
        )
    s = _settings(args, quiet=True)
    if args.impl == "triton" and s["device"] == "cpu":
        raise ValueError("--impl triton needs a CUDA GPU (the device is cpu); use --impl auto or torch")
    if args.text_file:
        _check_text_file(args.text_file, s["seq_len"])
    else:
        _check_retrieval(args, s)
    world = _dist_env()[0]
    if world > 1 and s["seq_len"] % world != 0:
        raise ValueError(
            f"sequence-parallel training over {world} ranks: --seq-len {s['seq_len']} is not "
            f"divisible by the world size {world}; use a multiple of {world} "
            f"(e.g. {s['seq_len'] - s['seq_len'] % world or world})"
        )


def _check_text_file(path: str, seq_len: int) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--text-file {path}: no such file")
    need = 2 * (seq_len + 1)  # one training and one validation crop (data.ByteText)
    size = os.path.getsize(path)
    if size < need:
        raise ValueError(
            f"--text-file {path} has {size} bytes; --seq-len {seq_len} needs at least {need} "
            "(a training and a validation crop): use a longer file or a smaller --seq-len"
        )


def _check_retrieval(args: argparse.Namespace, s: dict) -> None:
    pairs, keys = s["num_pairs"], RetrievalTask.num_keys
    if pairs > keys:
        raise ValueError(f"--num-pairs {pairs} > {keys}: the task has {keys} distinct keys")
    need = 5 * pairs  # planted block (2P) + question tail (3P)
    if s["min_distance"] < need:
        raise ValueError(
            f"min distance {_given(args, 'min_distance', s)} < 5 x num pairs = {need}: "
            "use a larger --min-distance or fewer --num-pairs"
        )
    if s["seq_len"] < s["min_distance"]:
        raise ValueError(
            f"--seq-len {s['seq_len']} is shorter than the min distance "
            f"{_given(args, 'min_distance', s)}: use --seq-len >= {s['min_distance']} "
            "or a smaller --min-distance"
        )
    if args.max_distance is not None and args.max_distance > s["seq_len"]:
        raise ValueError(f"--max-distance {args.max_distance} > --seq-len {s['seq_len']}: a distance fits in a sequence")
    if s["min_distance"] > s["max_distance"]:
        raise ValueError(
            f"min distance {_given(args, 'min_distance', s)} > max distance "
            f"{_given(args, 'max_distance', s)}: give --min-distance <= --max-distance"
        )
    if args.eval_distances is not None:  # given: every one must fit (the preset's are cut)
        long = [d for d in args.eval_distances if d > s["seq_len"]]
        if long:
            raise ValueError(
                f"--eval-distances {long} > --seq-len {s['seq_len']}: a distance fits in a sequence"
            )
    bad = [d for d in s["eval_distances"] if d < need]
    if bad:
        raise ValueError(f"--eval-distances {bad} < 5 x num pairs = {need}: the planted block must fit")


def _settings(args: argparse.Namespace, quiet: bool = False) -> dict:
    """The preset's values overridden by every flag that was given."""
    s = dict(TRAIN_PRESETS[args.preset])
    s["model"] = dict(s["model"])
    for key in _PRESET_KEYS:
        val = getattr(args, key, None)
        if val is not None:
            s[key] = val
    if s["device"] == "cuda" and not torch.cuda.is_available():
        if not quiet:
            print("no CUDA device: running on cpu", file=sys.stderr)
        s["device"], s["dtype"] = "cpu", "float32"
    if getattr(args, "max_distance", None) is None:  # the preset's, cut to the sequence
        s["max_distance"] = min(s["max_distance"], s["seq_len"])
    if getattr(args, "eval_distances", None) is None:  # the preset's, cut to the sequence
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


def _init_sp(device: torch.device, local_rank: int, nccl_nvls: str | None = None):
    """Join (or reuse) the default process group; returns (group, device, owns_group).

    ``nccl_nvls`` ("on" / "off", from ``--nccl-nvls``) sets ``NCCL_NVLS_ENABLE`` before the
    group starts; None leaves the environment alone."""
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        # torch._dynamo (the optimizer's constructor imports it) keeps references to the default
        # group when it is first imported after the group exists: destroy_process_group() then
        # leaves the group alive, its destructor runs in the interpreter's shutdown, and gloo
        # can abort a rank there after a finished run (SIGABRT). Imported first, it keeps none.
        import torch._dynamo as _dynamo  # noqa: F401  (binds no local "torch")
        if nccl_nvls is not None:  # the user asked (--nccl-nvls): NCCL reads it at group start
            os.environ["NCCL_NVLS_ENABLE"] = "1" if nccl_nvls == "on" else "0"
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


def _save(path: str, model, opt, step: int, cfg: LongNetConfig, s: dict, history: list,
          seed: int | None = None) -> None:  # fmt: skip
    tmp = path + ".tmp"
    torch.save({
        "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
        "config": dataclasses.asdict(cfg), "settings": s, "history": history,
        "rng": torch.get_rng_state(), "seed": seed,
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


# What a run writes into --out-dir; a directory holding any of them holds an earlier run.
RUN_FILES = ("ckpt.pt", "log.jsonl", "log.csv", "config.json", "summary.json", "loss.png")


def check_out_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a directory that holds an earlier run unless told what to do with it.

    Raises ``FileExistsError`` (a run is there, neither flag given) or ``ValueError`` (both flags).
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other; give one of them")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out-dir {out_dir} is a file, not a directory; choose another --out-dir")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):  # the deepest folder that exists: it must be one, writable
        parent = os.path.dirname(parent)
    if not os.path.exists(out_dir) and (not os.path.isdir(parent) or not os.access(parent, os.W_OK)):
        why = "is a file" if not os.path.isdir(parent) else "is not writable"
        raise ValueError(f"--out-dir {out_dir} cannot be created: {parent} {why}; choose another --out-dir")
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
    the number of ranks. Bad flag combinations raise before anything is written
    (:func:`check_train_args`).
    """
    check_train_args(args)
    s = _settings(args)
    world, rank, local_rank = _dist_env()
    if getattr(args, "overwrite", False) and rank == 0:
        for name in RUN_FILES:
            path = os.path.join(args.out_dir, name)
            if os.path.exists(path):
                os.remove(path)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(s["device"])
    group, owns_group = None, False
    if world > 1:
        group, device, owns_group = _init_sp(device, local_rank, getattr(args, "nccl_nvls", None))
    try:
        return _train(args, s, device, group, rank, world)
    finally:
        if owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


@dataclasses.dataclass
class _Run:
    """What the steps of one training run share."""

    args: argparse.Namespace
    s: dict
    device: torch.device
    group: object
    rank: int
    world: int
    data: object = None
    cfg: LongNetConfig | None = None
    model: LongNetLM | None = None
    params: list = dataclasses.field(default_factory=list)
    opt: torch.optim.Optimizer | None = None
    autocast: object = None
    start: int = 0
    history: list = dataclasses.field(default_factory=list)
    step_times: list = dataclasses.field(default_factory=list)  # seconds per step (no eval, no save)
    last_eval: dict = dataclasses.field(default_factory=dict)

    @property
    def main_rank(self) -> bool:
        return self.rank == 0

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.args.out_dir, "ckpt.pt")


def _train(args, s: dict, device: torch.device, group, rank: int, world: int) -> int:
    """setup -> (step, eval, checkpoint, log) per step -> summary."""
    run = _Run(args, s, device, group, rank, world)
    _setup(run)
    t0 = time.perf_counter()
    # time_s: training time since the run started, across resumes (the time stopped not counted)
    t_before = float(run.history[-1].get("time_s", 0.0)) if run.history else 0.0
    log = None
    if run.main_rank:
        # rewritten from the checkpoint's history (not appended to): steps logged after the
        # checkpoint by the interrupted run are run again, and were logged twice
        log = open(os.path.join(args.out_dir, "log.jsonl"), "w")
        for rec in run.history:
            log.write(json.dumps(rec) + "\n")
        log.flush()
    bar = _Progress(s["steps"], run.start, args.no_progress, enabled=run.main_rank)
    run.model.train()
    try:
        for step in range(run.start, s["steps"]):
            rec = _train_step(run, step)
            rec["time_s"] = t_before + time.perf_counter() - t0
            done = step + 1
            if done % s["eval_every"] == 0 or done == s["steps"]:
                _eval_step(run, rec, bar)
            run.history.append(rec)
            _log_step(run, rec, log)
            stop = args.stop_at is not None and done >= args.stop_at
            if stop or (args.save_every and done % args.save_every == 0) or done % s["eval_every"] == 0 or done == s["steps"]:
                _checkpoint(run, done)
            bar.update(step, f"loss {rec['loss']:.3f} lr {rec['lr']:.2e}")
            if stop:
                break
    finally:
        bar.close()
        if log is not None:
            log.close()
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)  # every rank finished its steps (rank 0 wrote the checkpoint)
    if run.main_rank:
        _write_summary(run, t_before + time.perf_counter() - t0)
    return 0


def _setup(run: _Run) -> None:
    """Data, model (the same initialisation on every rank), optimizer, the resumed state, and
    config.json."""
    args, s = run.args, run.s
    if run.main_rank:
        os.makedirs(args.out_dir, exist_ok=True)
    run.data, vocab = _make_data(args, s)
    cfg = LongNetConfig.preset(args.preset, **{**s["model"], "vocab_size": vocab})
    run.cfg = dataclasses.replace(
        cfg.with_attention(args.attention, s["seq_len"], s["local_window"]),
        impl=args.impl,
        checkpoint_activations=args.checkpoint_activations or cfg.checkpoint_activations,
    )
    torch.manual_seed(args.seed)
    run.model = LongNetLM(run.cfg).to(run.device)
    run.params = list(run.model.parameters())  # shared (tied) parameters once
    if run.group is not None:
        import torch.distributed as dist

        parallelize(run.model, run.group)
        for p in run.params:  # the same seed gives the same init; make sure of it
            dist.broadcast(p.data, src=0, group=run.group)
    run.opt = _make_optimizer(run.model, args.weight_decay, s["lr"], run.device)
    if args.resume:
        _resume(run)
    amp_dtype = getattr(torch, s["dtype"])
    run.autocast = torch.autocast(run.device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32)
    if run.main_rank:
        _write_config(run)


def _make_data(args, s: dict):
    """(task, vocabulary size): bytes of --text-file, else synthetic retrieval."""
    if args.text_file:
        return ByteText(args.text_file, s["seq_len"]), 256
    data = RetrievalTask(
        seq_len=s["seq_len"],
        num_pairs=s["num_pairs"],
        min_distance=s["min_distance"],
        max_distance=s["max_distance"],
    )
    vocab = s["model"].get("vocab_size", LongNetConfig.preset(args.preset).vocab_size)
    if vocab < data.vocab_size:
        raise ValueError(f"model vocab {vocab} < task vocab {data.vocab_size}")
    return data, vocab


def _make_optimizer(model, weight_decay: float, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )


class ResumeError(ValueError):
    """``--resume`` cannot continue the run in ``--out-dir`` (an unreadable checkpoint, or one
    written with another model or data); the command line exits 2 with its one line."""


# settings that shape the data a step sees: a resumed run with others would not continue the run
_RESUME_SETTINGS = ("seq_len", "batch_size", "num_pairs", "min_distance", "max_distance")


def _resume(run: _Run) -> None:
    try:
        ck = torch.load(run.ckpt_path, map_location=run.device, weights_only=False)
        saved_cfg, saved_s = ck["config"], ck.get("settings", {})
        missing = [k for k in ("model", "optimizer", "step", "history", "rng") if k not in ck]
        if missing:
            raise KeyError(f"no {', '.join(missing)}")
    except Exception as e:  # a truncated or foreign file: what torch.load / the keys raise
        raise ResumeError(
            f"--resume: cannot read the checkpoint {run.ckpt_path} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); start without --resume or use another --out-dir"
        ) from e
    cfg = dataclasses.asdict(run.cfg)
    diffs = [f"{k} {saved_cfg.get(k)!r} -> {cfg.get(k)!r}" for k in sorted({*cfg, *saved_cfg})
             if saved_cfg.get(k) != cfg.get(k)]  # fmt: skip
    diffs += [f"{k} {saved_s[k]!r} -> {run.s.get(k)!r}" for k in _RESUME_SETTINGS
              if k in saved_s and saved_s[k] != run.s.get(k)]  # fmt: skip
    if ck.get("seed") is not None and ck["seed"] != run.args.seed:  # the batches of every step
        diffs.append(f"seed {ck['seed']!r} -> {run.args.seed!r}")
    if diffs:
        raise ResumeError(
            f"--resume: {run.ckpt_path} was written with other model or data settings "
            f"({'; '.join(diffs)}); give the flags of that run, or use another --out-dir"
        )
    run.model.load_state_dict(ck["model"])
    run.opt.load_state_dict(ck["optimizer"])
    run.start, run.history = ck["step"], ck["history"]
    torch.set_rng_state(ck["rng"])
    if run.main_rank:
        print(f"resumed from {run.ckpt_path} at step {run.start}")


def _write_config(run: _Run) -> None:
    args, s, cfg, model = run.args, run.s, run.cfg, run.model
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(
            {
                "model": dataclasses.asdict(cfg),
                "settings": s,
                "args": vars(args),
                "params": model.num_params(),
                "torch": torch.__version__,
                "world_size": run.world,
                "device": str(run.device),
                "device_name": device_name(run.device),
            },
            f,
            indent=1,
            default=str,
        )
    task = "text" if args.text_file else "retrieval"
    sp = f", sequence-parallel over {run.world} ranks" if run.world > 1 else ""
    print(
        f"{args.attention} LongNet ({args.preset}): {model.num_params() / 1e6:.2f}M params, "
        f"branches w={list(cfg.segment_lengths)} r={list(cfg.dilation_rates)}, task={task}, "
        f"N={s['seq_len']}, batch={s['batch_size']}, steps={s['steps']}, device={run.device}{sp}",
        flush=True,
    )


def _train_step(run: _Run, step: int) -> dict:
    """One optimizer step on the global batch of ``step`` (this rank's shard); its log record."""
    s, args, group = run.s, run.args, run.group
    ts = time.perf_counter()
    lr = _lr_at(step, s, args.min_lr_ratio)
    for g in run.opt.param_groups:
        g["lr"] = lr
    x, y = run.data.batch(s["batch_size"], args.seed, step)  # the global batch, every rank
    count = max(1, int((y != IGNORE).sum()))  # scored targets in the global batch
    x, y = _shard(x, group), _shard(y, group)
    x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
    loss = _lm_loss(run.model, x, y, count, run.autocast)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    if group is not None:
        _allreduce_grads(run.params, group)
    gnorm = torch.nn.utils.clip_grad_norm_(run.params, args.grad_clip)
    run.opt.step()
    loss_val = _allreduce_sum(loss.detach().clone(), group).item()  # syncs the step
    run.step_times.append(time.perf_counter() - ts)
    return {"step": step + 1, "loss": loss_val, "lr": lr, "grad_norm": float(gnorm), "step_s": run.step_times[-1]}


def _eval_step(run: _Run, rec: dict, bar: _Progress) -> None:
    """Evaluate into ``rec`` and print the eval line."""
    rec.update(evaluate(run.model, run.data, run.s, run.args.seed, run.device, run.autocast, run.group))
    run.last_eval = {k: v for k, v in rec.items() if k.startswith(("acc", "val_"))}
    bar.write(f"step {rec['step']}: loss {rec['loss']:.4f} " + " ".join(f"{k} {v:.3f}" for k, v in run.last_eval.items()))


def _log_step(run: _Run, rec: dict, log) -> None:
    if run.main_rank:
        log.write(json.dumps(rec) + "\n")
        log.flush()


def _checkpoint(run: _Run, done: int) -> None:
    if run.main_rank:
        _save(run.ckpt_path, run.model, run.opt, done, run.cfg, run.s, run.history, run.args.seed)


def _write_summary(run: _Run, train_time_s: float) -> None:
    """log.csv, summary.json (throughput, final loss, last eval) and the plot."""
    args, s, history = run.args, run.s, run.history
    keys = sorted({k for h in history for k in h}, key=lambda k: (k != "step", k))
    with open(os.path.join(args.out_dir, "log.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(history)
    # Throughput over this process's steps, leaving out the first ones (allocator warm-up, kernel
    # autotuning and compilation): tokens of the global batch per second of step time.
    tokens_per_step = s["batch_size"] * s["seq_len"]  # global, over all ranks
    skip = min(5, len(run.step_times) // 4)
    timed = run.step_times[skip:]
    tok_s = tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else None
    summary = {
        "attention": args.attention,
        "preset": args.preset,
        "steps": s["steps"],
        "train_time_s": train_time_s,
        "final_loss": history[-1]["loss"] if history else None,
        "params": run.model.num_params(),
        "world_size": run.world,
        "tokens_per_step": tokens_per_step,
        "step_s": sum(timed) / len(timed) if timed else None,
        "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / run.world if tok_s is not None else None,
        "throughput_steps_skipped": skip,
        **run.last_eval,
    }
    if isinstance(run.data, RetrievalTask):
        summary["chance"] = run.data.chance
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.join(args.out_dir, "loss.png")
    if not args.no_plot and _plot(history, png, f"{args.attention} ({args.preset})"):
        print(f"plot: {png}")
    print(json.dumps(summary))


def build_parser(prog: str = "dilated-attention train") -> argparse.ArgumentParser:
    """The one parser of ``python -m dilated_attention.train`` (``dilated-attention train`` adds
    the same flags to its subcommand)."""
    from .argtypes import HelpFormatter, Parser

    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_train_arguments(parser)
    return parser


def parse_and_check(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, then :func:`check_train_args`; a bad value exits 2 with one line (parser.error)."""
    args = parser.parse_args(argv)
    check_or_exit(args, parser)
    return args


def check_or_exit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        check_train_args(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))


def run_or_exit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """:func:`run_train`; a :class:`ResumeError` (found once the checkpoint is read) exits 2 with
    one line, as the checks before the run do."""
    try:
        return run_train(args)
    except ResumeError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    """``python -m dilated_attention.train``: the same flags and checks as ``dilated-attention train``."""
    parser = build_parser()
    return run_or_exit(parse_and_check(parser, argv), parser)


if __name__ == "__main__":
    sys.exit(main())
