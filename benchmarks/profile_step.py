"""Where a LongNet training step's time goes, eager against compiled (issue 23, item 5).

The model and shapes of ``ab_rotary.py``'s end-to-end rows (LongNet ``base``, the branches
(2048, 4096, 8192)/(1, 2, 4) at N 8192 x 4 and (2048, ..., 16384)/(1, 2, 4, 8) at N 16384 x 2,
bf16 autocast, fwd + bwd + AdamW (``torch.optim.AdamW``'s defaults, as there), the fused rotary
kernel on), profiled with ``torch.profiler`` after warm-up, one step per arm:

- ``eager``: the model as a user runs it without compiling, with the library's defaults (since
  2026-11-27: ``LongNetConfig.fused_loss=True``, the LM loss and its gradients in one pass over
  the head, ``models/linear_ce.py``, each chunk in the Triton kernel of ``kernels/triton_ce.py``
  -- its torch code with ``--torch-ce``; the models' LayerNorms as the Triton kernels of
  ``kernels/triton_layernorm.py`` -- ``nn.LayerNorm`` with ``--torch-layernorm``);
- ``eager plain``: the same model as it ran before those defaults (``fused_loss=False``, the
  checkpointed cross-entropy chunks; ``nn.LayerNorm``), to show what they save (``--no-plain``
  skips it);
- ``compiled``: ``torch.compile(model)`` (inductor; the optimizer step stays eager, as in
  ``ab_rotary.py``);
- ``dense``: the same model with ``LongNetConfig.with_attention("dense", n)`` (one branch
  w = N, r = 1: the same fused kernel, which ``auto`` picks there), eager: the baseline a user
  compares with; ``--dense-compile`` adds it compiled (``dense compiled``).

Per arm: the wall time per step (median of ``--iters`` unprofiled steps, CUDA events), the
summed GPU kernel time of the profiled step (kernels, memsets and memcpys; the user annotations
that the profiler mirrors on the GPU timeline -- the ``mod:*`` / ``da:*`` labels, the phases,
``Optimizer.step#...`` -- are spans around kernels and left out), the GPU busy time (union of
the kernel intervals) and the idle rest (inside the profiled step: per origin of the kernel that
ended each gap, whether the GPU waited for the host to launch it, the largest gaps and what the
host was doing when they opened), the number of kernels and of memsets / memcpys, the host's issue time (until
the step's Python returns, before the final synchronisation) and the host synchronisations
(``nonzero`` / ``item``). Then the kernels grouped into categories (attention = the Triton
dilated kernels or SDPA's, GEMMs, layernorm, rotary, casts, GELU, dropout, other elementwise,
cross-entropy, grad accumulation, optimizer, memset / fill, memcpy, embedding, reduction,
other), eager next to compiled and dense; the eager kernels by origin (the module or phase that
launched them: forward modules are labelled through hooks, backward kernels inherit the label
of the forward op that made their autograd node); and the top 25 kernels of each arm.

With ``--tiny`` (CPU): the tiny preset, CPU ops (leaf aten ops that do work: views and
allocations left out) stand for the kernels, CPU self time for their time.

``--census N``: one eager ``base``-shaped step (12 layers, 768 wide, vocabulary 50304) at
N tokens x 1 on the current device (meant for the CPU: an op census, not a timing), with the
branches of the 8K row scaled down to N, the chunked cross-entropy cut into as many chunks as
at 8K x 4 (``--census-ce-chunks``, 25) and AdamW ``--adamw`` (``foreach``, the CUDA default,
unless told): the leaf aten ops per category and per origin, the host syncs.

    python benchmarks/profile_step.py --out $OUT/profile_step.md      # H100: ~3-4 minutes
    python benchmarks/profile_step.py --tiny --out /tmp/p.md           # CPU smoke run
    python benchmarks/profile_step.py --shapes 16384 --no-plain --dense-compile \
        --cprofile compiled,eager --out $OUT/p.md                       # one row, idle and host
    python benchmarks/profile_step.py --census 1024 --out /tmp/c.md    # CPU op census
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import importlib
import math
import os
import pathlib
import re
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

from dilated_attention import flags, timing
from dilated_attention.models import longnet
from dilated_attention.models.longnet import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, results_header, run_info, write_report  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
KERNELS_DIR = HERE.parent / "src" / "dilated_attention" / "kernels"
PHASES = ("forward", "backward", "optimizer", "zero_grad")


def configs(tiny: bool) -> dict:
    """The end-to-end rows of ``ab_rotary.py`` (same presets, shapes and branches)."""
    if tiny:
        return dict(preset="tiny", e2e=[(128, 2, (32, 64), (1, 2))])
    return dict(preset="base",
                e2e=[(8192, 4, (2048, 4096, 8192), (1, 2, 4)),
                     (16384, 2, (2048, 4096, 8192, 16384), (1, 2, 4, 8))])  # fmt: skip


# ------------------------------------------------------------------------------ categories

def _triton_names(filename: str) -> tuple[str, ...]:
    """The ``@triton.jit`` kernels of one file under kernels/ (read from the source, so that a
    renamed kernel is still found)."""
    try:
        src = (KERNELS_DIR / filename).read_text()
    except OSError:
        return ()
    return tuple(m.group(1) for m in re.finditer(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def (\w+)", src)
                 if m.group(1).endswith("kernel"))  # fmt: skip


ATTN_KERNELS = _triton_names("triton_kernels.py") + _triton_names("triton_decode.py")
ROTARY_KERNELS = _triton_names("triton_rotary.py") or ("_rotary_kernel",)
CE_KERNELS = _triton_names("triton_ce.py") or ("_ce_loss_grad_kernel",)
# record_function ranges (the labels below, the phases, the optimizer's own) that the profiler
# mirrors on the GPU timeline as user annotations: spans around kernels, not kernels
LABEL_PREFIXES = ("mod:", "da:", "Optimizer.", "ProfilerStep#")
SDPA_PAT = re.compile(r"flash|fmha|cudnn.*(attn|attention|sdpa)|scaled_dot_product|efficient_attention|sdpa",
                      re.I)  # fmt: skip
GEMM_PAT = re.compile(r"gemm|xmma|cutlass|cublas|nvjet|splitkreduce|s16816|wgmma|^aten::(mm|addmm|bmm|baddbmm|"
                      r"addmv|mv|_addmm_activation)$|triton_tem_", re.I)  # fmt: skip
# leaf aten ops that launch nothing (views, allocations, metadata): left out of the CPU census
NO_WORK = {
    "view", "_unsafe_view", "reshape", "as_strided", "empty", "empty_like", "empty_strided", "t",
    "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "detach", "detach_",
    "alias", "_reshape_alias", "resize_", "lift_fresh", "unbind", "split", "chunk", "narrow",
    "result_type", "contiguous", "flatten", "to", "type_as", "view_as", "expand_as", "new_empty",
    "new_empty_strided", "_has_compatible_shallow_copy_type", "is_same_size", "numpy_T", "clone_",
    "requires_grad_", "_to_dense", "lift", "set_", "size", "stride", "dim", "is_nonzero", "unflatten",
    "movedim", "split_with_sizes", "diagonal", "_conj", "as_strided_", "_local_scalar_dense_", "record_stream", "resolve_conj", "resolve_neg",
    "_unsafe_split", "unsafe_split", "_unsafe_index", "conj", "view_as_real", "empty_permuted",
}  # fmt: skip
# composite ops: not counted themselves, their children are (linear -> addmm, to -> _to_copy, ...)
COMPOSITE = {
    "linear", "matmul", "layer_norm", "cross_entropy_loss", "log_softmax", "nll_loss", "nll_loss_nd",
    "dropout", "feature_dropout", "softmax", "embedding", "embedding_backward", "clone", "einsum",
    "scaled_dot_product_attention", "chunk", "stack", "_has_compatible_shallow_copy_type", "gelu_",
    "where", "repeat_interleave", "index", "flatten", "unflatten",
}  # fmt: skip
SKIP = NO_WORK | COMPOSITE
HOST_SYNC = {"nonzero", "item", "_local_scalar_dense", "is_nonzero", "equal", "tolist"}

CATEGORIES = [
    "attention", "attention glue", "rotary", "gemm", "layernorm", "cast/copy", "gelu", "dropout",
    "residual/other elementwise", "cross-entropy", "grad accumulation", "optimizer", "memset/fill",
    "memcpy", "embedding", "reduction", "host sync", "other",
]  # fmt: skip


def _base_category(name: str) -> str:
    """The category of a kernel (CUDA, eager or Inductor's ``triton_*``) or a CPU aten op, by
    its name alone."""
    n = name.lower()
    op = n[6:] if n.startswith("aten::") else None
    if any(k.lower() in n for k in ATTN_KERNELS) or SDPA_PAT.search(n):
        return "attention"
    if any(k.lower() in n for k in ROTARY_KERNELS) or n.startswith("dilated_attention::rotary"):
        return "rotary"
    if any(k.lower() in n for k in CE_KERNELS) or n.startswith("dilated_attention::linear_ce"):
        return "cross-entropy"
    if n.startswith("dilated_attention::layer_norm"):
        return "layernorm"  # the compiled graphs' custom ops (on the CPU: their CPU ops' time)
    if n.startswith("memset"):
        return "memset/fill"
    if n.startswith("memcpy"):
        return "memcpy"
    if op is not None and op in HOST_SYNC:
        return "host sync"
    if re.search(r"multi_tensor_apply|fused_adam|_foreach_|adam", n):
        return "optimizer"
    if GEMM_PAT.search(n):
        return "gemm"
    if re.search(r"softmax|nll_loss|cross_entropy", n):
        return "cross-entropy"
    if re.search(r"layer_norm|layernorm|gammabeta", n):
        return "layernorm"
    if n.startswith("triton_") and "neg" in n and "cat" in n:
        return "rotary"  # Inductor's fused rotate-half
    if "gelu" in n:
        return "gelu"
    if re.search(r"dropout|bernoulli", n):
        return "dropout"
    if re.search(r"embedding|index_select|indexselect|indexing_backward|index_put|scatter|gather|index_add", n):
        return "embedding"
    if re.search(r"copy_kernel|_to_copy|aten::copy_|bfloat16_copy|direct_copy", n):
        return "cast/copy"
    if re.search(r"fill|zero_|aten::zeros", n):
        return "memset/fill"
    if re.search(r"reduce_kernel|reduction|triton_red_|triton_per_|aten::(sum|mean|amax|max|min|norm)$", n):
        return "reduction"
    if re.search(r"elementwise|triton_poi_|aten::", n):
        return "residual/other elementwise"
    return "other"


def category(name: str, origin: str) -> str:
    """``_base_category`` refined by where the kernel or op came from (eager: the module or phase
    that launched it), for the kinds whose name does not say what they are for."""
    base = _base_category(name)
    o = origin.lower()
    if o in ("optimizer", "zero_grad"):
        return "optimizer"  # AdamW's own ops, its per-parameter step.item() on CPU tensors included
    if base == "host sync":
        return base
    if "accumulategrad" in o:
        return "grad accumulation"
    generic = base in ("cast/copy", "residual/other elementwise", "reduction", "memset/fill", "other")
    if not generic:
        return base
    if "rotary" in o:
        return "rotary"
    if "op layer_norm" in o:
        return "layernorm"
    if "op linear_ce" in o:
        return "cross-entropy"
    if "op triton_" in o or "op decode" in o:
        return "attention glue"
    if "dilatedattention" in o or "eagerfused" in o or "sdpa" in o:
        return "attention glue"
    if "loss" in o or o == "ce" or o.endswith(" ce"):
        return "cross-entropy"
    if base == "cast/copy" or "tocopybackward" in o:
        return "cast/copy"
    return base


# ------------------------------------------------------------------------------ labelling

@contextlib.contextmanager
def origin_labels(model: torch.nn.Module):
    """Label the eager forward for the profiler: a ``record_function`` "mod:<Type>" around every
    module's forward, "da:rotary" around the rotation and "da:ce" / "da:loss" around the
    cross-entropy (the chunks' recomputation in backward included). Removed on exit (before a
    ``torch.compile`` of the same model sees them)."""
    handles, stack = [], []

    def pre(mod, _args):
        rf = record_function(f"mod:{type(mod).__name__}")
        rf.__enter__()
        stack.append(rf)

    def post(mod, _args, _out):
        stack.pop().__exit__(None, None, None)

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))

    def wrap(fn, label):
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        return inner

    saved = {"_ce_sum": longnet._ce_sum, "chunked_cross_entropy": longnet.chunked_cross_entropy}
    longnet._ce_sum = wrap(saved["_ce_sum"], "da:ce")
    longnet.chunked_cross_entropy = wrap(saved["chunked_cross_entropy"], "da:loss")
    rotaries = [m for m in model.modules() if isinstance(m, longnet.Rotary)]
    for r in rotaries:
        r.rotate = wrap(r.rotate, "da:rotary")  # an instance attribute over the method
        r.table = wrap(r.table, "da:rotary")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for k, v in saved.items():
            setattr(longnet, k, v)
        for r in rotaries:
            del r.rotate, r.table


# ------------------------------------------------------------------------------ analysis

def is_annotation(e) -> bool:
    """Whether a device-side profiler event is a user annotation (a ``record_function`` range
    mirrored on the GPU timeline: ``mod:*``, ``da:*``, the phases, ``Optimizer.step#...``) rather
    than a kernel, memset or memcpy: its time spans kernels that are counted on their own."""
    return bool(getattr(e, "is_user_annotation", False)) or e.name.startswith(LABEL_PREFIXES) or e.name in PHASES


def _origin_of(fe, fwd_origin: dict) -> str:
    """The innermost label above a profiler event: a module / loss / rotary label ("bwd " in
    front in backward: the chunks' recomputation), else, in backward, the forward label of the
    op that made the autograd node it runs in, else the node, else the phase."""
    chain = [fe, *_ancestors(fe)]
    in_bwd = any(p.name.startswith("autograd::engine::evaluate_function") for p in chain)
    for p in chain:  # inside one of the library's custom ops (compiled graphs call them): "op <name>"
        if p.name.startswith("dilated_attention::"):
            return ("bwd " if in_bwd else "") + "op " + p.name.split("::", 1)[1]
    for p in chain:
        if p.name.startswith(("mod:", "da:")):
            return ("bwd " if in_bwd else "") + p.name.split(":", 1)[1]
        if in_bwd and not p.name.startswith("aten::") and getattr(p, "sequence_nr", -1) >= 0:
            label = fwd_origin.get(p.sequence_nr)
            if label is not None:
                return "bwd " + label
    for p in chain:
        if p.name.startswith("autograd::engine::evaluate_function: "):
            return "bwd " + p.name.split(": ", 1)[1]
    for p in chain:
        if p.name in PHASES:
            return p.name
    return "unlabelled"


def _ancestors(fe):
    p = fe.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _fwd_origins(cpu_events) -> dict:
    """sequence_nr -> label of the forward ops (their innermost module / loss / rotary label).
    An op that makes no autograd node carries the number of the next node made: the last op
    (by start time) of a number is the one that made its node."""
    out = {}
    for fe in sorted(cpu_events, key=lambda e: e.time_range.start):
        seq = getattr(fe, "sequence_nr", -1)
        if seq < 0 or not fe.name.startswith("aten::"):
            continue
        for p in _ancestors(fe):
            if p.name.startswith("autograd::engine"):
                break
            if p.name.startswith(("mod:", "da:")):
                out[seq] = p.name.split(":", 1)[1]
                break
    return out


@dataclasses.dataclass
class Item:
    name: str
    origin: str
    us: float
    start: float
    end: float
    launch: float = math.nan  # host time of the runtime call that launched it (CUDA)


HOST_GROUPS = (("op ", "dilated_attention::"), ("graph ", "## Call CompiledFxGraph"),
               ("bwd node ", "autograd::engine::evaluate_function: "), ("phase ", PHASES))


def _in_group(name: str, match) -> bool:
    """Whether an event name belongs to a :data:`HOST_GROUPS` group (a tuple of names or a prefix)."""
    return name in match if isinstance(match, tuple) else name.startswith(match)


def host_spans(cpu_events) -> dict:
    """Host time (the profiler's CPU duration, its own overhead included) of the library's custom
    ops, Inductor's compiled graphs, the autograd nodes of the backward and the phases, each the
    outermost of its group: label -> [count, us]."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in cpu_events:
        if e.is_async:
            continue
        for label, match in HOST_GROUPS:
            if _in_group(e.name, match):
                if not any(_in_group(p.name, match) for p in _ancestors(e)):
                    name = e.name if isinstance(match, tuple) else e.name[len(match):]
                    rec = out[label + (name if label != "graph " else "(all)")]
                    rec[0] += 1
                    rec[1] += e.time_range.elapsed_us()
                break
    return dict(out)


def gaps(items: list[Item], cpu_events, top: int = 12) -> dict:
    """The GPU's idle time inside one profiled step, kernel to kernel: each gap (the start of a
    kernel after the latest end of those before it) is charged to the kernel that ends it, and
    is "host-late" when that kernel's launch call began after the gap had opened (the GPU waited
    for the host to issue it) and "queued" otherwise (launch latency, a stream wait). Per origin
    of the kernel that ends the gap; the largest gaps with the innermost host op that was running
    when each opened (a synchronisation shows here)."""
    out = dict(span_ms=0.0, idle_ms=0.0, host_late_ms=0.0, n=0, by_origin={}, largest=[])
    ordered = sorted(items, key=lambda i: i.start)
    if not ordered:
        return out
    by_origin = collections.defaultdict(lambda: [0, 0.0, 0.0])  # count, idle us, host-late us
    found = []
    last = ordered[0].end
    for it in ordered[1:]:
        gap = it.start - last
        if gap > 0:
            late = it.launch > last
            rec = by_origin[it.origin]
            rec[0] += 1
            rec[1] += gap
            rec[2] += gap if late else 0.0
            out["n"] += 1
            out["idle_ms"] += gap / 1e3
            out["host_late_ms"] += (gap if late else 0.0) / 1e3
            found.append((gap, last, it))
        last = max(last, it.end)
    out["span_ms"] = (last - ordered[0].start) / 1e3
    out["by_origin"] = dict(by_origin)
    spans = [e for e in cpu_events if not e.is_async]
    for gap, opened, it in sorted(found, key=lambda g: -g[0])[:top]:
        running = [e for e in spans if e.time_range.start <= opened <= e.time_range.end]
        inner = max(running, key=lambda e: e.time_range.start).name if running else "-"
        delay = it.launch - opened if it.launch == it.launch else math.nan
        out["largest"].append(dict(us=gap, kernel=re.sub(r"^void |<.*$|\(.*$", "", it.name)[:60],
                                   origin=it.origin, launch_after_us=delay, host_op=inner[:60]))
    return out


def analyse(events, device: torch.device) -> dict:
    """Kernels (CUDA) or leaf working aten ops (CPU) of one profiled step, with their origins."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    fwd_origin = _fwd_origins(cpu)
    # host synchronisations: nonzero / item outside the optimizer (AdamW's step counts are CPU
    # tensors unless capturable or fused), and on CUDA the runtime's synchronize calls
    syncs = sum(1 for e in cpu if e.name.startswith("aten::") and e.name[6:] in HOST_SYNC
                and not any(p.name.startswith("aten::") and p.name[6:] in HOST_SYNC for p in _ancestors(e))
                and not any(p.name in ("optimizer", "zero_grad") for p in _ancestors(e)))  # fmt: skip
    rt_syncs = sum(1 for e in cpu if "synchronize" in e.name.lower())
    top_ops = sum(1 for e in cpu if e.name.startswith("aten::")
                  and not any(p.name.startswith("aten::") for p in _ancestors(e)))  # fmt: skip
    items: list[Item] = []
    if device.type == "cuda":
        # a kernel's launch: the runtime call (cudaLaunchKernel, cuLaunchKernelEx, cudaMemsetAsync,
        # ...) of the same correlation id, nested in the op that made it; else the op linked to it
        runtime = {e.id: e for e in cpu if e.name.startswith("cu") and not e.name.startswith("cudnn")}
        by_id = {e.id: e for e in cpu if not e.is_async and not e.name.startswith("cu")}
        for e in events:
            if e.device_type != DeviceType.CUDA or is_annotation(e):
                continue  # annotations span kernels: summed with them they inflate the totals
            rt = runtime.get(e.id)
            src = rt or by_id.get(getattr(e, "linked_correlation_id", 0) or -1)
            origin = _origin_of(src, fwd_origin) if src is not None else "unattributed"
            launch = rt.time_range.start if rt is not None else math.nan
            items.append(Item(e.name, origin, e.time_range.elapsed_us(), e.time_range.start,
                              e.time_range.end, launch))  # fmt: skip
    else:
        for e in cpu:
            if not e.name.startswith("aten::") or e.name[6:] in SKIP:
                continue
            if any(p.name.startswith("aten::") and p.name[6:] not in SKIP for p in _ancestors(e)):
                continue  # inside a counted op (addmm's bias copy_, ...)
            items.append(Item(e.name, _origin_of(e, fwd_origin), e.cpu_time_total,
                              e.time_range.start, e.time_range.end))  # fmt: skip
    busy, last = 0.0, -math.inf
    for it in sorted(items, key=lambda i: i.start):  # union of the intervals
        if it.end > last:
            busy += it.end - max(it.start, last)
            last = it.end
    cats = collections.defaultdict(lambda: [0, 0.0])
    origins = collections.defaultdict(lambda: [0, 0.0])
    names = collections.defaultdict(lambda: [0, 0.0, ""])
    pairs = collections.defaultdict(lambda: [0, 0.0, ""])
    for it in items:
        c = category(it.name, it.origin)
        cats[c][0] += 1
        cats[c][1] += it.us
        origins[it.origin][0] += 1
        origins[it.origin][1] += it.us
        rec = names[it.name]
        rec[0] += 1
        rec[1] += it.us
        rec[2] = c
        short = re.sub(r"^void |<.*$|\(.*$", "", it.name)[:70]  # kernel names without templates
        rec = pairs[(it.origin, short)]
        rec[0] += 1
        rec[1] += it.us
        rec[2] = c
    memops = sum(1 for it in items if it.name.lower().startswith(("memset", "memcpy")))
    idle = gaps(items, cpu) if device.type == "cuda" else None
    return dict(idle=idle, host=host_spans(cpu),
        n=len(items), memops=memops, sum_ms=sum(i.us for i in items) / 1e3, busy_ms=busy / 1e3,
        cats=dict(cats), origins=dict(origins), names=dict(names), pairs=dict(pairs), syncs=syncs, rt_syncs=rt_syncs, top_ops=top_ops,
    )  # fmt: skip


# ------------------------------------------------------------------------------ the steps

def build(preset, n, batch, seg, dil, device, attention="dilated", adamw="default"):
    mcfg = dataclasses.replace(LongNetConfig.preset(preset, max_seq_len=n),
                               segment_lengths=seg, dilation_rates=dil)  # fmt: skip
    if attention != "dilated":
        mcfg = mcfg.with_attention(attention, n)
    torch.manual_seed(0)
    model = LongNetLM(mcfg).to(device).train()
    kw = {"foreach": True} if adamw == "foreach" else {"fused": True} if adamw == "fused" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    x = torch.randint(0, mcfg.vocab_size, (batch, n + 1), device=device)
    return model, opt, x[:, :-1], x[:, 1:]


def make_step(run, opt, inp, tgt, amp):
    def go():
        with record_function("forward"):
            with amp:
                _, loss = run(inp, tgt, return_logits=False)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
        with record_function("zero_grad"):
            opt.zero_grad(set_to_none=True)

    go.parts = (run, opt, inp, tgt, amp)
    return go


def phase_times(fn, device, iters: int) -> dict:
    """Unprofiled steps of ``fn`` (a :func:`make_step` step) with a host clock and a CUDA event at
    each phase boundary (``timing.phases_ms``): per phase the median host time and GPU time (the
    GPU finished the phase's work then, or the host recorded the event then, if later). A phase
    whose GPU time is about its host time kept the GPU waiting for the host."""
    if device.type != "cuda" or not hasattr(fn, "parts"):
        return {}
    run, opt, inp, tgt, amp = fn.parts
    state = {}

    def forward():
        with amp:
            state["loss"] = run(inp, tgt, return_logits=False)[1]

    def backward():
        state.pop("loss").backward()

    got = timing.phases_ms([forward, backward, opt.step, lambda: opt.zero_grad(set_to_none=True)], device, iters)
    out = {}
    for name, (host, gpu) in zip((*PHASES, "step"), got, strict=True):
        out[name + " host"], out[name + " gpu"] = host, gpu
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_one(fn, device, model=None) -> dict:
    """One profiled call of ``fn`` (after the caller's warm-up), analysed; with ``model``, its
    forward is labelled (eager only)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    labels = origin_labels(model) if model is not None else contextlib.nullcontext()
    _sync(device)
    for _ in range(2):  # the first profiled call pays the profiler's own start-up: keep the second
        with labels, torch.profiler.profile(activities=acts) as prof:
            fn()
            _sync(device)
        labels = origin_labels(model) if model is not None else contextlib.nullcontext()
    return analyse(prof.events(), device)


def issue_ms(fn, device, iters: int) -> float:
    """Median host time until ``fn`` returns (the GPU drained before each call)."""
    out = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(out)


def _where(file: str, line: int, name: str) -> str:
    """A cProfile function key, shortened: the path from the package or library root on."""
    for cut in ("site-packages/", "dist-packages/", "/src/", "/benchmarks/", "/lib/python3"):
        if cut in file:
            file = file.split(cut, 1)[1]
            break
    return f"{file}:{line}({name})" if file != "~" else name


def cprofile_steps(fn, device, steps: int, keep: int = 60) -> list[dict]:
    """cProfile over ``steps`` back-to-back calls of ``fn`` (the GPU drained before and after,
    not between): the functions with the most own time and the most time with callees."""
    import cProfile
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    _sync(device)
    rows = []
    for key, (_cc, nc, tt, ct, callers) in pstats.Stats(prof).stats.items():
        by = sorted(((_where(*c), v[1] if isinstance(v, tuple) else v) for c, v in callers.items()),
                    key=lambda cv: -cv[1])  # fmt: skip
        rows.append(dict(fn=_where(*key), calls=nc, tt=tt, ct=ct, callers=by[:5]))
    chosen = {id(r): r for k in ("tt", "ct") for r in sorted(rows, key=lambda r: -r[k])[:keep]}
    return list(chosen.values())


def run_arm(name, fn, device, args, model=None) -> dict:
    for _ in range(args.warmup):
        fn()
    res = profile_one(fn, device, model)
    res["wall_ms"] = median_ms(fn, device, 1, args.iters)
    res["issue_ms"] = issue_ms(fn, device, max(1, args.iters // 2))
    res["arm"] = name
    res["phases"] = phase_times(fn, device, args.iters)
    if name in args.cprofile:
        res["cprofile"] = cprofile_steps(fn, device, args.cprofile_steps)
        res["cprofile_steps"] = args.cprofile_steps
    return res


def e2e(cfg, device, dtype, args) -> list[dict]:
    shapes = []
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for n, batch, seg, dil in cfg["e2e"]:
        if args.shapes and n not in args.shapes:
            continue
        arms = {}
        model, opt, inp, tgt = build(cfg["preset"], n, batch, seg, dil, device, adamw=args.adamw)
        arms["eager"] = run_arm("eager", make_step(model, opt, inp, tgt, amp), device, args, model)
        if not args.no_plain:  # the step before the 2026-11-27 defaults: checkpointed loss, nn.LayerNorm
            fused, mode = model.cfg.fused_loss, flags.triton_layernorm_mode()
            model.cfg.fused_loss = False
            flags.set_triton_layernorm(False)
            try:
                arms["eager plain"] = run_arm("eager plain", make_step(model, opt, inp, tgt, amp),
                                              device, args, model)  # fmt: skip
            finally:
                model.cfg.fused_loss = fused
                flags.set_triton_layernorm({"on": True, "off": False}.get(mode))
        if not args.no_compile:
            cm = torch.compile(model, backend=args.compile_backend)
            arms["compiled"] = run_arm("compiled", make_step(cm, opt, inp, tgt, amp), device, args)
            if args.compiled_ab:  # the same compiled model (the custom ops read the switches per call)
                with settings(args.compiled_ab):
                    name = f"compiled [{','.join(f'{k}={v}' for k, v in args.compiled_ab)}]"
                    arms[name] = run_arm(name, make_step(cm, opt, inp, tgt, amp), device, args)
                arms["compiled"]["ab_rounds"] = ab_rounds(make_step(cm, opt, inp, tgt, amp), device, args)
            del cm
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.no_dense:
            model, opt, inp, tgt = build(cfg["preset"], n, batch, seg, dil, device, "dense", args.adamw)
            arms["dense"] = run_arm("dense", make_step(model, opt, inp, tgt, amp), device, args, model)
            if args.dense_compile:
                cm = torch.compile(model, backend=args.compile_backend)
                arms["dense compiled"] = run_arm("dense compiled", make_step(cm, opt, inp, tgt, amp), device, args)
                del cm
            del model, opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if not args.no_compile:
            torch._dynamo.reset()  # the next shape compiles afresh
        shapes.append(dict(shape=f"N{n} x {batch}", seg=seg, dil=dil, arms=arms))
    return shapes


def ab_rounds(fn, device, args) -> list[tuple[float, float]]:
    """``--ab-rounds`` rounds of (wall ms as set, wall ms with ``--compiled-ab``'s switches), each
    the median of ``--iters`` steps, the two arms alternating: a same-process A/B whose rounds
    share the machine's drift."""
    out = []
    for _ in range(args.ab_rounds):
        a = median_ms(fn, device, 1, args.iters)
        with settings(args.compiled_ab):
            b = median_ms(fn, device, 1, args.iters)
        out.append((a, b))
    return out


def ab_table(arms: dict) -> list[str]:
    """The interleaved rounds of :func:`ab_rounds` and the median ratio."""
    rounds = arms.get("compiled", {}).get("ab_rounds")
    if not rounds:
        return []
    lines = ["| round | compiled ms | with --compiled-ab ms | ratio |", "|---|---|---|---|"]
    for i, (a, b) in enumerate(rounds):
        lines.append(f"| {i} | {a:.3f} | {b:.3f} | {b / a:.4f} |")
    ratios = sorted(b / a for a, b in rounds)
    lines += ["", f"- median ratio (with --compiled-ab / as set) over {len(rounds)} rounds: "
                  f"{statistics.median(ratios):.4f} (min {ratios[0]:.4f}, max {ratios[-1]:.4f})"]  # fmt: skip
    return lines


def parse_settings(spec: str) -> list[tuple[str, int]]:
    """'gluon_fwd.DIRECT_LAUNCH=1,gluon_fwd.LIGHT_DESCRIPTORS=0' -> [(name, value), ...]: module
    switches of ``dilated_attention.kernels`` (ints; 0 / 1 for the boolean ones)."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        mod, _, attr = name.rpartition(".")
        if not mod or not value:
            raise SystemExit(f"--set / --compiled-ab: expected MODULE.NAME=VALUE, got {item!r}")
        m = importlib.import_module(f"dilated_attention.kernels.{mod}")
        if not hasattr(m, attr):
            raise SystemExit(f"--set / --compiled-ab: dilated_attention.kernels.{mod} has no {attr}")
        out.append((name, int(value)))
    return out


@contextlib.contextmanager
def settings(pairs: list[tuple[str, int]]):
    """The module switches of :func:`parse_settings` set (booleans as bools), restored on exit."""
    saved = []
    try:
        for name, value in pairs:
            mod, _, attr = name.rpartition(".")
            m = importlib.import_module(f"dilated_attention.kernels.{mod}")
            old = getattr(m, attr)
            saved.append((m, attr, old))
            setattr(m, attr, bool(value) if isinstance(old, bool) else value)
        yield
    finally:
        for m, attr, old in reversed(saved):
            setattr(m, attr, old)


def census(device, args) -> dict:
    """One eager base-shaped step at N = args.census x 1, the ops counted (see the docstring)."""
    n = args.census
    seg = tuple(max(1, n * w // 8192) for w in (2048, 4096, 8192))
    mcfg_v = LongNetConfig.preset("base").vocab_size
    rows = math.ceil(n / args.census_ce_chunks)
    saved = longnet.CE_CHUNK_ELEMENTS
    longnet.CE_CHUNK_ELEMENTS = rows * mcfg_v
    dtype = torch.bfloat16 if args.census_dtype == "bf16" else torch.float32
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    try:
        model, opt, inp, tgt = build("base", n, 1, seg, (1, 2, 4), device, adamw=args.adamw)
        model.cfg.fused_loss = not args.census_plain_loss
        fn = make_step(model, opt, inp, tgt, amp)
        fn()  # the optimizer's state exists from here on
        res = profile_one(fn, device, model)
    finally:
        longnet.CE_CHUNK_ELEMENTS = saved
    res.update(tokens=n, seg=seg, rows=rows, chunks=math.ceil(n / rows), dtype=args.census_dtype)
    return res


# ------------------------------------------------------------------------------ report

def _ms(x: float) -> str:
    return f"{x:.3f}"


def category_table(arms: dict, unit: str) -> list[str]:
    names = list(arms)
    head = "| category | " + " | ".join(f"{a} count | {a} {unit}" for a in names)
    if "eager" in arms and "compiled" in arms:
        head += " | eager - compiled " + unit
    lines = [head + " |", "|---" * (1 + 2 * len(names) + ("eager" in arms and "compiled" in arms)) + "|"]
    for c in CATEGORIES:
        vals = [arms[a]["cats"].get(c, [0, 0.0]) for a in names]
        if not any(v[0] for v in vals):
            continue
        row = f"| {c} | " + " | ".join(f"{v[0]} | {_ms(v[1] / 1e3)}" for v in vals)
        if "eager" in arms and "compiled" in arms:
            e, k = arms["eager"]["cats"].get(c, [0, 0.0]), arms["compiled"]["cats"].get(c, [0, 0.0])
            row += f" | {_ms((e[1] - k[1]) / 1e3)}"
        lines.append(row + " |")
    tot = [(arms[a]["n"], arms[a]["sum_ms"]) for a in names]
    row = "| **total** | " + " | ".join(f"{t[0]} | {_ms(t[1])}" for t in tot)
    if "eager" in arms and "compiled" in arms:
        row += f" | {_ms(arms['eager']['sum_ms'] - arms['compiled']['sum_ms'])}"
    return lines + [row + " |"]


def origin_table(res: dict, unit: str, top: int = 30) -> list[str]:
    lines = [f"| origin | count | {unit} |", "|---|---|---|"]
    for o, (c, us) in sorted(res["origins"].items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {o} | {c} | {_ms(us / 1e3)} |")
    return lines


def pair_table(res: dict, unit: str, top: int = 40) -> list[str]:
    """The (origin, kernel or op) pairs with the most launches: where the many small ones are."""
    lines = [f"| origin | kernel / op | category | count | {unit} |", "|---|---|---|---|---|"]
    for (o, name), (c, us, cat) in sorted(res["pairs"].items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:top]:
        shown = name.replace("|", "\\|")
        lines.append(f"| {o} | `{shown}` | {cat} | {c} | {_ms(us / 1e3)} |")
    return lines


def top_table(res: dict, unit: str, top: int = 25) -> list[str]:
    lines = [f"| kernel | category | count | total {unit} | mean us |", "|---|---|---|---|---|"]
    for name, (c, us, cat) in sorted(res["names"].items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        short = short.replace("|", "\\|")
        lines.append(f"| `{short}` | {cat} | {c} | {_ms(us / 1e3)} | {us / c:.1f} |")
    return lines


def idle_tables(arms: dict, top: int = 10) -> list[str]:
    """The idle time inside each arm's profiled step (:func:`gaps`): totals, per origin of the
    kernel that ended each gap, and the largest gaps."""
    arms = {a: r for a, r in arms.items() if r.get("idle")}
    if not arms:
        return []
    lines = ["| arm | span ms (first kernel to last) | idle ms in span | of it host-late ms | gaps |",
             "|---|---|---|---|---|"]  # fmt: skip
    for a, r in arms.items():
        g = r["idle"]
        lines.append(f"| {a} | {_ms(g['span_ms'])} | {_ms(g['idle_ms'])} | {_ms(g['host_late_ms'])} | {g['n']} |")
    for a, r in arms.items():
        g = r["idle"]
        lines += ["", f"{a}: idle by origin of the kernel that ended the gap", "",
                  "| origin | gaps | idle ms | host-late ms |", "|---|---|---|---|"]  # fmt: skip
        for o, (c, us, late) in sorted(g["by_origin"].items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| {o} | {c} | {_ms(us / 1e3)} | {_ms(late / 1e3)} |")
        lines += ["", f"{a}: largest gaps", "",
                  "| us | next kernel | its origin | its launch after the gap opened, us | host op running when it opened |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for x in g["largest"]:
            lines.append(f"| {x['us']:.1f} | `{x['kernel']}` | {x['origin']} | {x['launch_after_us']:.1f} | "
                         f"`{x['host_op']}` |")
    return lines


def phase_table(arms: dict) -> list[str]:
    """Per arm and phase, the unprofiled host and GPU milliseconds (:func:`phase_times`)."""
    arms = {a: r for a, r in arms.items() if r.get("phases")}
    if not arms:
        return []
    cols = [*PHASES, "step"]
    lines = ["| arm | " + " | ".join(f"{c} host / GPU ms" for c in cols) + " |", "|---" * (1 + len(cols)) + "|"]
    for a, r in arms.items():
        ph = r["phases"]
        lines.append(f"| {a} | " + " | ".join(f"{ph[c + ' host']:.2f} / {ph[c + ' gpu']:.2f}" for c in cols) + " |")
    return lines


def host_table(arms: dict, top: int = 16) -> list[str]:
    """Per arm, the host time of the custom ops, compiled graphs, backward nodes and phases in
    the profiled step (:func:`host_spans`)."""
    lines = []
    for a, r in arms.items():
        if not r.get("host"):
            continue
        lines += ["", f"{a}", "", "| span | count | host ms |", "|---|---|---|"]
        for label, (c, us) in sorted(r["host"].items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| {label} | {c} | {_ms(us / 1e3)} |")
    return lines


def cprofile_table(res: dict, top: int = 30) -> list[str]:
    """The host's Python time per step (cProfile over ``res['cprofile_steps']`` steps, GPU not
    drained between them): by own time and by time with callees."""
    rows, steps = res.get("cprofile"), res.get("cprofile_steps", 1)
    if not rows:
        return []
    lines = []
    for key, title in (("tt", "own time"), ("ct", "time with callees")):
        lines += ["", f"by {title} (ms per step; calls per step)", "",
                  "| function | calls | own ms | with callees ms |", "|---|---|---|---|"]  # fmt: skip
        for r in sorted(rows, key=lambda r: -r[key])[:top]:
            fn = r["fn"].replace("|", "\\|")
            lines.append(f"| `{fn}` | {r['calls'] / steps:.0f} | {r['tt'] / steps * 1e3:.3f} | "
                         f"{r['ct'] / steps * 1e3:.3f} |")
    lines += ["", "callers (calls per step) of the functions with the most own time and of Triton's launch path", "",
              "| function | callers |", "|---|---|"]  # fmt: skip
    launch_path = ("runtime/jit.py", "hopper.py", "make_tensordesc_arg", "backend_impl")
    picked = sorted(rows, key=lambda r: -r["tt"])[:12]
    picked += [r for r in rows if r not in picked and any(m in r["fn"] for m in launch_path)]
    for r in picked:
        who = "; ".join(f"`{c}` {n / steps:.0f}" for c, n in r.get("callers", []))
        lines.append(f"| `{r['fn']}` | {who.replace('|', chr(92) + '|')} |")
    return lines


def summary_table(shapes: list[dict], what: str, cuda: bool) -> list[str]:
    lines = ["| tokens | arm | wall ms/step | " + what + " sum ms | busy ms | idle ms (wall - busy) | "
             + what + "s | memset+memcpy | host issue ms | host syncs (aten / runtime) | top-level aten ops |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in shapes:
        for a, r in s["arms"].items():
            lines.append(
                f"| {s['shape']} | {a} | {_ms(r['wall_ms'])} | {_ms(r['sum_ms'])} | {_ms(r['busy_ms'])} | "
                f"{_ms(r['wall_ms'] - r['busy_ms']) if cuda else '-'} | {r['n'] - r['memops']} | {r['memops']} | "
                f"{_ms(r['issue_ms'])} | {r['syncs']} / {r['rt_syncs']} | {r['top_ops']} |"
            )
    for s in shapes:
        arms = s["arms"]
        if "eager" in arms and "compiled" in arms:
            e, c = arms["eager"], arms["compiled"]
            lines.append("")
            lines.append(f"- {s['shape']}: eager / compiled wall {e['wall_ms'] / c['wall_ms']:.2f}x; "
                         f"{what} sum {e['sum_ms'] / max(c['sum_ms'], 1e-9):.2f}x; eager {what}s "
                         f"{e['n']} vs {c['n']}")  # fmt: skip
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny preset on the CPU (CPU ops for kernels)")
    p.add_argument("--census", type=int, default=0, metavar="N",
                   help="instead: an op census of one eager base-shaped step at N tokens x 1")
    p.add_argument("--census-ce-chunks", type=int, default=25,
                   help="cross-entropy chunks in the census (25: as at 8K x 4 with V = 50304)")
    p.add_argument("--census-plain-loss", action="store_true",
                   help="census with LongNetConfig.fused_loss=False (the checkpointed cross-entropy chunks)")
    p.add_argument("--census-dtype", choices=("bf16", "fp32"), default="bf16", help="census autocast dtype")
    p.add_argument("--adamw", choices=("default", "foreach", "fused"), default=None,
                   help="AdamW implementation (default: torch's choice, as ab_rotary.py; the census: foreach)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled arm")
    p.add_argument("--no-dense", action="store_true", help="skip the dense-SDPA arm")
    p.add_argument("--dense-compile", action="store_true", help="also the dense model compiled")
    p.add_argument("--shapes", default="", help="comma-separated N of the rows to run (default all: 8192,16384)")
    p.add_argument("--cprofile", default="", metavar="ARMS",
                   help="comma-separated arms (eager, compiled, dense, 'dense compiled') whose host Python "
                        "is profiled with cProfile over --cprofile-steps steps")
    p.add_argument("--cprofile-steps", type=int, default=5)
    p.add_argument("--set", default="", metavar="MOD.NAME=V,...",
                   help="module switches of dilated_attention.kernels for the whole run, e.g. gluon_fwd.DIRECT_LAUNCH=1")
    p.add_argument("--compiled-ab", default="", metavar="MOD.NAME=V,...",
                   help="a second compiled arm, the same compiled model with these switches")
    p.add_argument("--ab-rounds", type=int, default=0, metavar="N",
                   help="with --compiled-ab: N interleaved rounds of both settings (median of --iters steps each)")
    p.add_argument("--no-plain", action="store_true",
                   help="skip the eager arm without the fused loss and the Triton LayerNorm")
    p.add_argument("--torch-rotary", action="store_true", help="eager rotary in torch code (kernel off)")
    p.add_argument("--torch-ce", action="store_true",
                   help="fused loss with the torch code per chunk (kernels/triton_ce.py off)")
    p.add_argument("--torch-layernorm", action="store_true",
                   help="eager arms: the models' LayerNorms as nn.LayerNorm (flags.set_triton_layernorm(False); "
                        "the compiled arm always keeps nn.LayerNorm)")
    p.add_argument("--compile-backend", default=None, help="default inductor (aot_eager with --tiny)")
    p.add_argument("--out", default=None, help="markdown file (default results/profile_step_<gpu>_<date>.md)")
    args = p.parse_args(argv)
    args.shapes = {int(x) for x in args.shapes.split(",") if x.strip()}
    args.cprofile = {x.strip() for x in args.cprofile.split(",") if x.strip()}
    args.compiled_ab = parse_settings(args.compiled_ab)
    with settings(parse_settings(args.set)):
        return _main(args, argv)


def _main(args, argv) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not (args.tiny or args.census) else "cpu")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    args.adamw = args.adamw or ("foreach" if args.census else "default")
    # the kernel where it runs (CUDA); the torch code on the CPU (no interpreter here)
    flags.set_fused_rotary(device.type == "cuda" and not args.torch_rotary)
    # likewise the fused loss's cross-entropy kernel and the models' LayerNorm kernels
    flags.set_ce_kernel(device.type == "cuda" and not args.torch_ce)
    flags.set_triton_layernorm(False if args.torch_layernorm else None)  # None: the default, "auto"
    info = run_info(device, None if argv is None else " ".join(["python", sys.argv[0], *argv]))
    what = "kernel" if device.type == "cuda" else "CPU op"
    unit = "ms"
    if args.census:
        res = census(device, args)
        lines = results_header(
            f"Op census of one eager LongNet 'base' training step: {info['device']}", info=info,
            extra=[f"N {res['tokens']} x 1, branches {res['seg']}/(1, 2, 4), {res['dtype']} autocast, 12 layers, "
                   f"dim 768, vocabulary 50304; cross-entropy in {res['chunks']} chunks of {res['rows']} rows "
                   f"(as at 8K x 4); AdamW {args.adamw}"
                   + ("; fused_loss=False" if args.census_plain_loss else "; fused_loss=True (models/linear_ce.py)"),
                   f"{what}s: the outermost aten ops that do work (views, allocations and composites such as "
                   f"linear left out), CPU time with children; "
                   f"the attention on the CPU is the torch path (on CUDA: the Triton kernels)"],
        )  # fmt: skip
        lines += ["", f"- working ops (the outermost aten ops that do work): {res['n']}; top-level aten ops: {res['top_ops']}; "
                      f"host syncs (nonzero / item): {res['syncs']}", "",
                  "## Per category", ""]  # fmt: skip
        lines += category_table({"eager": res}, unit)
        lines += ["", "## Per origin", ""] + origin_table(res, unit, top=60)
        lines += ["", "## Most launched (origin, op) pairs", ""] + pair_table(res, unit, top=60)
        lines += ["", "## Top ops", ""] + top_table(res, unit, top=40)
        topic = "profile_step_census"
    else:
        cfg = configs(args.tiny)
        dtype = torch.float32 if args.tiny else torch.bfloat16
        shapes = e2e(cfg, device, dtype, args)
        lines = results_header(
            f"LongNet training step profile, eager vs compiled: {info['device']}", info=info,
            extra=[f"LongNet {cfg['preset']!r}, {str(dtype).removeprefix('torch.')} autocast, fwd + bwd + "
                   f"AdamW ({args.adamw}), compiled with {args.compile_backend} (model only), fused rotary "
                   f"{flags.fused_rotary_mode()}, fused-loss CE kernel {flags.ce_kernel_mode()}, Triton LayerNorm "
                   f"{flags.triton_layernorm_mode()}; dense: "
                   f"with_attention('dense', n), eager",
                   f"one profiled step per arm after {args.warmup} warm-up; wall: median of {args.iters} "
                   f"unprofiled steps; {what} times from the profiler"
                   + ("" if device.type == "cuda" else " (CPU self time: not comparable to a GPU)")],
        )  # fmt: skip
        lines += ["", "## Summary", ""] + summary_table(shapes, what, device.type == "cuda")
        for s in shapes:
            lines += ["", f"## {s['shape']}: branches {s['seg']} / {s['dil']}", "", "### Per category", ""]
            lines += category_table(s["arms"], unit)
            if "eager" in s["arms"]:
                lines += ["", "### Eager by origin (module or phase that launched it)", ""]
                lines += origin_table(s["arms"]["eager"], unit)
                lines += ["", "### Eager: most launched (origin, kernel) pairs", ""]
                lines += pair_table(s["arms"]["eager"], unit)
            ab = ab_table(s["arms"])
            if ab:
                lines += ["", "### Interleaved A/B of the compiled model (--ab-rounds)", ""] + ab
            ph = phase_table(s["arms"])
            if ph:
                lines += ["", "### Phases, unprofiled (host clock and CUDA events at each boundary; medians)", ""] + ph
            hs = host_table(s["arms"])
            if hs:
                lines += ["", "### Host time of the profiled step by span (the profiler's overhead included)"] + hs
            idle = idle_tables(s["arms"])
            if idle:
                lines += ["", "### Idle inside the profiled step (the profiler's host overhead included)", ""] + idle
            for a, r in s["arms"].items():
                if r.get("cprofile"):
                    lines += ["", f"### Host Python per step, {a} (cProfile; its own overhead included)"]
                    lines += cprofile_table(r)
            for a, r in s["arms"].items():
                lines += ["", f"### Top 25 {what}s, {a}", ""] + top_table(r, unit)
        topic = "profile_step"
    write_report("\n".join(lines) + "\n", args.out, topic, device, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
