"""The one timing and report helper of the benchmark scripts.

- ``median_ms(fn, device, warmup, iters)``: CUDA events around each call on a GPU,
  ``time.perf_counter`` on the CPU; the median in milliseconds (the same timer as
  ``dilated-attention bench``: it lives in ``dilated_attention.timing``).
- ``results_header(title, device, ...)``: the top of a results file (command, device, versions,
  date); ``torchrun_header(...)`` adds the process group (world size, backend, NCCL version and
  ``NCCL_*`` environment) for the torchrun scripts.
- the torchrun plumbing: ``setup`` (process group), ``sync``, ``reset_peak``, ``peak_gib`` and
  ``time_fn`` (the mean over a loop, the slowest rank's).

Scripts import it as ``from common import ...``: they run as ``python benchmarks/X.py``, which
puts ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from dilated_attention.timing import (  # noqa: F401  (re-exported for the scripts)
    command_line,
    device_name,
    median_ms,
    results_header,
    run_info,
    utc_now,
    versions,
)


def eager_decoder(model, prompt: torch.Tensor, capacity: int):
    """``generate(decode="eager")``'s loop, one token per call: ``setup_cache(B, capacity)``, the
    prompt (B, T) prefilled, then ``one()`` runs a greedy step (``model._decode_step(B, T,
    "eager")`` and ``_sample``). Returns ``(one, state)``, ``state = [next position, next token
    (B, 1)]``. Call under ``torch.no_grad()``."""
    from dilated_attention.models.longnet import _sample

    b, t = prompt.shape
    model.setup_cache(b, capacity)
    last = model._hidden_last(prompt, 0)
    step = model._decode_step(b, t, "eager")
    state = [t, _sample(last, 0.0, None)]

    def one():
        last = step(state[1], state[0])
        state[1] = _sample(last, 0.0, None)
        state[0] += 1

    return one, state


def setup(device: str):
    # before the group exists: torch._dynamo, imported later, would keep references to the group
    # past destroy_process_group (see dilated_attention.train._init_sp)
    import torch._dynamo as _dynamo  # noqa: F401

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        # the other ranks wait at a barrier while rank 0 runs the one-GPU baseline: long timeout
        dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                                timeout=datetime.timedelta(minutes=30))
        return torch.device("cuda", local)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("WORLD_SIZE", "1")))))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev) -> float | None:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    return None


def time_fn(fn, dev, warmup, iters, group=None):
    """Mean seconds per call over a loop of ``iters`` calls; with a group, the max over its ranks
    (after a barrier). A loop mean, not a per-call median: the ranks must run the same calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    if group is not None:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    dt = (time.perf_counter() - t0) / iters
    if group is not None:
        t = torch.tensor([dt], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        dt = float(t.item())
    return dt


def torchrun_header(title: str, dev: torch.device, world: int, extra=()) -> list[str]:
    """results_header for a torchrun script: the launch command, the device count and backend,
    the NCCL version and the ``NCCL_*`` environment the run saw."""
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else "-"
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    return results_header(
        title, dev, command=command_line(f"torchrun --nproc_per_node={world}"),
        extra=[f"ranks: {world}; backend {dist.get_backend()}; NCCL {nccl}", f"NCCL env: {env}", *extra],
    )


# --- checkpoints that come back from a device call ------------------------------------------
# A device call returns files of at most 16 MiB each (and at most 8 of them), so a run that
# pauses in one call and resumes in the next saves its state split into files of at most
# SPLIT_BYTES of tensor data: ``PATH`` (the structure, every tensor replaced by a reference, and
# the first share of the tensors) and ``PATH.1``, ``PATH.2``, ... (the rest).

SPLIT_BYTES = 15 * 2**20


def training_calls(n: int, heads: int, headdim: int, dtype, seg, dil, device, impl: str) -> dict:
    """The four callables the overhead benchmarks time for one causal training call of length n
    (batch 1): ``fwd`` / ``fb`` (forward, forward + backward) through ``dilated_attention`` with
    ``impl``, and ``dense_fwd`` / ``dense_fb`` through SDPA on the same data, (B, H, N, D) views."""
    import torch.nn.functional as F

    import dilated_attention as da

    q, k, v = (torch.randn(1, n, heads, headdim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(1, n, heads, headdim, device=device, dtype=dtype)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)

    def fwd():
        with torch.no_grad():
            return da.dilated_attention(q, k, v, seg, dil, causal=True, impl=impl)

    def fb():
        out = da.dilated_attention(q, k, v, seg, dil, causal=True, impl=impl)
        torch.autograd.grad(out, (q, k, v), do)

    def dense_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def dense_fb():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(out, (qt, kt, vt), dot)

    return {"fwd": fwd, "fb": fb, "dense_fwd": dense_fwd, "dense_fb": dense_fb}


def _split_files(path: str, n: int) -> list[str]:
    return [path] + [f"{path}.{i}" for i in range(1, n)]


def save_split(obj, path: str, max_bytes: int = SPLIT_BYTES) -> list[str]:
    """``torch.save`` ``obj`` (nested dicts, lists and tuples of tensors and plain values) as
    files of at most ``max_bytes`` of tensor data each (a tensor larger than that is cut into
    flat pieces). Every file is written under a temporary name first, then renamed; the files of
    one save share a random tag that :func:`load_split` checks. Files of an earlier save with
    more parts are removed. Returns the paths written."""
    pieces: list[torch.Tensor] = []

    def strip(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().to("cpu").contiguous()
            step = max(1, max_bytes // max(1, t.element_size()))
            flat = t.reshape(-1)
            idx = []
            for a in range(0, max(1, flat.numel()), step):
                idx.append(len(pieces))
                pieces.append(flat[a : a + step].clone())
            return {"__split_tensor__": idx, "shape": list(t.shape), "dtype": str(t.dtype)}
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(strip(v) for v in o)
        return o

    skeleton = strip(obj)
    files: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(pieces):
        nb = t.numel() * t.element_size()
        if files[-1] and size + nb > max_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nb
    tag = os.urandom(8).hex()
    paths = _split_files(path, len(files))
    for k, (p, ids) in enumerate(zip(paths, files, strict=True)):
        body = {"tag": tag, "part": k, "pieces": {i: pieces[i] for i in ids}}
        if k == 0:
            body.update(skeleton=skeleton, n_files=len(files))
        torch.save(body, p + ".tmp")
    for p in reversed(paths):  # the first file (the skeleton) last
        os.replace(p + ".tmp", p)
    k = len(files)
    while os.path.exists(f"{path}.{k}"):  # parts of an earlier, larger save
        os.remove(f"{path}.{k}")
        k += 1
    return paths


def load_split(path: str, map_location="cpu"):
    """The object saved by :func:`save_split` (tensors on ``map_location``)."""
    head = torch.load(path, map_location="cpu", weights_only=False)
    pieces = dict(head["pieces"])
    for p in _split_files(path, head["n_files"])[1:]:
        body = torch.load(p, map_location="cpu", weights_only=False)
        if body["tag"] != head["tag"]:
            raise ValueError(f"{p} is from another save than {path} (interrupted write?)")
        pieces.update(body["pieces"])

    def build(o):
        if isinstance(o, dict) and "__split_tensor__" in o:
            flat = torch.cat([pieces[i] for i in o["__split_tensor__"]])
            return flat.reshape(o["shape"]).to(map_location)
        if isinstance(o, dict):
            return {k: build(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(build(v) for v in o)
        return o

    return build(head["skeleton"])


def split_files(path: str) -> list[str]:
    """The files of the checkpoint at ``path`` (to copy or carry them together)."""
    head = torch.load(path, map_location="cpu", weights_only=False)
    return _split_files(path, head["n_files"])


def write_report(text: str, out: str | None, topic: str, device: torch.device, info: dict) -> str:
    """Write a markdown report to ``out``, or to ``benchmarks/results/<topic>_<gpu>_<date>.md``
    (gpu: the last word of the device name, lower case, or "cpu"), print it and the path."""
    import pathlib

    if out:
        path = pathlib.Path(out)
    else:
        tag = "cpu" if device.type == "cpu" else info["device"].split()[-1].lower().replace("-", "")
        path = pathlib.Path(__file__).resolve().parent / "results" / f"{topic}_{tag}_{utc_now()[:10]}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return str(path)
