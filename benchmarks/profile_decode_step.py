"""Where an eager decode step of ``LongNetLM.generate`` spends its time on a GPU (issue 23 item 6).

For the ``small`` preset (bf16, batch 1) with dilated attention and with dense attention
(``LongNetConfig.with_attention("dense", ...)``, the baseline of ``bench_decode.py``), after a
prefill of ``--context`` tokens, the step that ``generate(..., decode="eager")`` runs per token
(``model._decode_step(1, t, "eager")`` and the greedy ``_sample``), timed four ways:

- ``eager b2b``: wall time per step of ``--steps`` back-to-back steps, one synchronisation at the
  end (what the decode loop of ``generate`` does: its tokens/s);
- ``eager sync``: the median wall time of single steps, each followed by a synchronisation
  (host + GPU of one step when nothing overlaps);
- ``host only``: the median host time to issue one step (no synchronisation, measured before the
  GPU queue fills: every 8th step synchronises first);
- ``graph``: the same step captured in a CUDA graph (``_decode_step(..., "graph")``), replayed
  back to back: the GPU time of the step without host work.

Then ``torch.profiler`` over ``--prof-steps`` eager steps (CUDA kernels per step and their summed
time, runtime calls per step: launches, synchronisations, allocations) and cProfile over the same
number of steps (the Python functions with the most own time). Prints a markdown table last.

    PYTHONPATH=src python benchmarks/profile_decode_step.py --out $OUT/profile_decode_step.md
    PYTHONPATH=src python benchmarks/profile_decode_step.py --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

from dilated_attention.models import LongNetConfig, LongNetLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, eager_decoder, results_header  # noqa: E402


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _arm(kind, args, dev, dtype) -> dict:
    base = LongNetConfig.preset(args.preset)
    cap = args.context + args.steps * 4 + 64
    cfg = base.with_attention(kind, cap)
    torch.manual_seed(0)
    model = LongNetLM(cfg).to(device=dev, dtype=dtype).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.context), device=dev)
    row = dict(kind=kind)
    with torch.no_grad():
        one, state = eager_decoder(model, prompt, cap)
        for _ in range(10):
            one()
        _sync(dev)
        # back to back
        t0 = time.perf_counter()
        for _ in range(args.steps):
            one()
        _sync(dev)
        row["b2b_us"] = (time.perf_counter() - t0) * 1e6 / args.steps
        # one step, synchronised
        ts = []
        for _ in range(args.steps // 2):
            _sync(dev)
            t0 = time.perf_counter()
            one()
            _sync(dev)
            ts.append((time.perf_counter() - t0) * 1e6)
        row["sync_us"] = statistics.median(ts)
        # host only: issue time of a step on an empty queue
        hs = []
        for i in range(args.steps):
            if i % 8 == 0:
                _sync(dev)
            t0 = time.perf_counter()
            one()
            hs.append((time.perf_counter() - t0) * 1e6)
        _sync(dev)
        row["host_us"] = statistics.median(hs)
        # torch.profiler
        acts = [torch.profiler.ProfilerActivity.CPU]
        if dev == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.prof_steps):
                one()
            _sync(dev)
        n = args.prof_steps
        kernels, ktime, runtime, ops = 0, 0.0, collections.Counter(), collections.Counter()
        by_kernel = collections.defaultdict(lambda: [0, 0.0])  # name -> [launches, us]
        for e in prof.events():
            dt = getattr(e, "device_type", None)
            if dt is not None and str(dt).endswith("CUDA") and e.name not in ("",):
                kernels += 1
                dt_us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                ktime += dt_us
                by_kernel[e.name[:90]][0] += 1
                by_kernel[e.name[:90]][1] += dt_us
            elif e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
                runtime[e.name] += 1
            elif e.name.startswith("aten::"):
                ops[e.name] += 1
        row["kernels"] = kernels / n
        row["kernel_us"] = ktime / n
        row["runtime"] = {k: v / n for k, v in runtime.most_common(8)}
        row["aten_ops"] = sum(ops.values()) / n
        row["by_kernel"] = sorted(((k, c / n, t / n) for k, (c, t) in by_kernel.items()), key=lambda x: -x[2])
        row["top_ops"] = {k: v / n for k, v in ops.most_common(12)}
        # cProfile
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.prof_steps):
            one()
        _sync(dev)
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        row["calls"] = st.total_calls / n
        st.sort_stats("tottime").print_stats(args.top)
        row["cprofile"] = s.getvalue()
        # graph
        if dev == "cuda":
            pos, tok = state
            g = model._decode_step(1, pos, "graph")
            for _ in range(5):
                g(tok, pos)
            _sync(dev)
            t0 = time.perf_counter()
            for i in range(args.steps):
                g(tok, pos)  # same position: the replay's GPU work does not depend on it here
            _sync(dev)
            row["graph_us"] = (time.perf_counter() - t0) * 1e6 / args.steps
        model.clear_cache()
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help=".md file for the report")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny preset, fp32)")
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prof-steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if args.tiny:
        args.context, args.preset, args.steps, args.prof_steps = [200], "tiny", 16, 4
    rows = []
    for ctx in args.context:
        a = argparse.Namespace(**{**vars(args), "context": ctx})
        for kind in ("dilated", "dense"):
            r = _arm(kind, a, dev, dtype)
            r["ctx"] = ctx
            rows.append(r)
            print(f"ctx {ctx} {kind}: b2b {r['b2b_us']:.0f} us, sync {r['sync_us']:.0f}, host {r['host_us']:.0f}, "
                  f"graph {r.get('graph_us', float('nan')):.0f}, kernels {r['kernels']:.0f} "
                  f"({r['kernel_us']:.0f} us), aten ops {r['aten_ops']:.0f}, py calls {r['calls']:.0f}", flush=True)
    lines = results_header("Eager decode step of LongNetLM.generate, where the time goes (issue 23 item 6)", dev,
                           "PYTHONPATH=src " + command_line(), [f"preset {args.preset}, batch 1, {dtype}, greedy"])
    lines += [""]
    lines += ["| context | attention | eager b2b us/step | eager sync us | host issue us | graph us/step | kernels/step | kernel sum us | aten ops | Python calls |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ctx']} | {r['kind']} | {r['b2b_us']:.0f} | {r['sync_us']:.0f} | {r['host_us']:.0f} | "
                     f"{r.get('graph_us', float('nan')):.0f} | {r['kernels']:.0f} | {r['kernel_us']:.0f} | {r['aten_ops']:.0f} | {r['calls']:.0f} |")
    for r in rows:
        lines += ["", f"## {r['ctx']} {r['kind']}", "", "runtime calls per step: " + ", ".join(
            f"{k} {v:.1f}" for k, v in r["runtime"].items()), "", "aten ops per step: " + ", ".join(
            f"{k} {v:.1f}" for k, v in r["top_ops"].items()), ""]
        if r["by_kernel"]:
            lines += ["| kernel | launches/step | us/step |", "|---|---|---|"]
            lines += [f"| `{k}` | {c:.1f} | {t:.1f} |" for k, c, t in r["by_kernel"][:25]]
        lines += ["", "```", r["cprofile"].strip(), "```"]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for ln in text.splitlines():
        if ln.startswith("| "):
            print(ln)


if __name__ == "__main__":
    main()
