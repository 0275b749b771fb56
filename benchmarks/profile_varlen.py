"""Where the causal packed-documents (varlen) step loses to one sequence: per-launch GPU times
and block-config variants (issue 22 item 2).

The packed batch of ``bench_varlen.py`` (131072 tokens, lognormal documents, mean 8K, 16 x 128,
bf16, LongNet branches). For (a) the packed stream and (b) one sequence of the same tokens, one
fwd+bwd through ``triton_launch.forward`` / ``backward`` (the launches the library makes, no
autograd) under ``torch.profiler``: every kernel launch in order with its GPU time, then the
sums per kernel name. Then fwd+bwd median times per block-config variant (``--configs``), (a)
and (b) with the same variant, and the ratio per useful FLOP (the issue's measure). Last, the
packed step through the public API (``bench_varlen.py``'s row (a)) against these direct
launches: do_bench times, its kernels under the profiler and the GPU time outside them
(``--no-api``: skipped)::

    PYTHONPATH=src python3 benchmarks/profile_varlen.py [--causal yes|no] [--unchecked] [--out f.md]

The packed offsets are built from host lengths, so they are passed as checked
(``Docs(..., checked=True)``, what ``dilated_attention_varlen`` does for CPU offsets or
``check_offsets=True``): the launches skip the zero-fills where one sequence does.
``--unchecked``: as unchecked device offsets (the fills kept; every packed call before branch
packedfills, 2026-11-26), for an A/B of the fills on the same machine.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dilated_attention.branches import branch_head_ranges
from dilated_attention.flops import dilated_flops, dilated_flops_varlen
from dilated_attention.kernels import triton_launch as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_varlen import _offsets, document_lengths  # noqa: E402
from common import results_header  # noqa: E402

VARIANTS = {
    "default": None,
    "dq64": dict(dq=(64, 64, 4, 3)),
    "dq64x32": dict(dq=(64, 32, 4, 3)),
    "fwd64": dict(fwd=(64, 64, 4, 3)),
    "dkdv32x64": dict(dkdv=(32, 64, 4, 2)),
    "dkdv64x128": dict(dkdv=(64, 128, 8, 2)),
    "dkdv32x128": dict(dkdv=(32, 128, 4, 3)),
    "dkdv64w8": dict(dkdv=(64, 64, 8, 2)),
    "dkdv64w8s3": dict(dkdv=(64, 64, 8, 3)),
    "dkdv32x64s3": dict(dkdv=(32, 64, 4, 3)),
    "dkdv64s1": dict(dkdv=(64, 64, 4, 1)),  # fewer pipeline buffers: fewer registers
    "dkdv32x64s1": dict(dkdv=(32, 64, 4, 1)),  # fewest dK/dV spills (kernel_resources.py)
    "small": dict(fwd=(64, 64, 4, 3), dq=(64, 64, 4, 3), dkdv=(32, 64, 4, 2)),
}


def _step(q, k, v, do, seg, dil, causal, scale, ranges, docs, config):
    out, lse = L.forward(q, k, v, None, seg, dil, causal, scale, ranges, config=config, docs=docs)
    return L.backward(do, q, k, v, None, out, lse, seg, dil, causal, scale, ranges, config=config,
                      docs=docs)


def _api_step(q, k, v, do, cu_host, longest, seg, dil, causal, scale):
    """fwd+bwd through the public API as ``bench_varlen.py``'s row (a): host offsets,
    ``dilated_attention_varlen(impl="triton")`` and ``torch.autograd.grad``."""
    from dilated_attention import dilated_attention_varlen

    xs = [t[0].detach().requires_grad_() for t in (q, k, v)]
    out = dilated_attention_varlen(*xs, cu_host, cu_host, longest, longest, seg, dil,
                                   causal=causal, softmax_scale=scale, impl="triton")
    return torch.autograd.grad(out, xs, do[0])


def _kernels(prof) -> list[tuple[str, float]]:
    evs = [e for e in prof.events() if getattr(e, "device_type", None) is not None
           and str(e.device_type).endswith("CUDA") and e.name and not e.name.startswith("aten::")]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evs]


_SHOWN = ("VARLEN", "BM", "BN", "CAUSAL", "FIRST", "COMP", "STORE_LO", "ROWS_FULL")


def constexprs_from_cache_key(key, arg_names: list[str]) -> dict:
    """The constexpr arguments of one compiled variant, read from its key in Triton's kernel
    cache: ``str(specialization) + str(options)``, the specialization a list with one
    ``(type, value)`` per argument in order, ``("constexpr", value)`` for constexprs. ``{}``
    when the key has another form."""
    if not isinstance(key, str) or not key.startswith("["):
        return {}
    depth, quote = 0, None
    for end, ch in enumerate(key):  # the list's closing bracket (brackets in strings skipped)
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
            if depth == 0:
                break
    else:
        return {}
    try:
        spec = ast.literal_eval(key[: end + 1])
    except (ValueError, SyntaxError):
        return {}
    if len(spec) != len(arg_names):
        return {}
    return {name: item[1] for name, item in zip(arg_names, spec, strict=True)
            if isinstance(item, tuple) and len(item) == 2 and item[0] == "constexpr"}


def compiled_resources() -> list[str]:
    """Markdown rows: registers and spilled bytes of every variant of the Triton kernels this
    process compiled (JITFunction.device_caches, read after the runs; n_regs / n_spills are
    filled when a kernel is loaded on a GPU), with the constexprs that tell the variants apart.
    Lines saying why when this Triton keeps them elsewhere (or under the interpreter)."""
    from dilated_attention.kernels import triton_kernels as tk

    rows = ["| kernel | variant | warps | stages | n_regs | n_spills (Triton's) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in ("dilated_fwd_kernel", "dilated_bwd_dkdv_kernel", "dilated_bwd_dq_kernel"):
        fn = getattr(tk, name, None)
        caches = getattr(fn, "device_caches", None)
        if not caches:
            rows.append(f"| {name} | no compiled variants here (interpreter or another Triton) | | | | |")
            continue
        arg_names = list(getattr(fn, "arg_names", []))
        for entry in caches.values():
            for cache_key, ck in (entry[0] if isinstance(entry, tuple) else entry).items():
                consts = getattr(getattr(ck, "src", None), "constexprs", {}) or {}
                named = {}
                for key, val in consts.items():  # keys: names, or (index,) paths
                    if isinstance(key, tuple) and key and isinstance(key[0], int) and key[0] < len(arg_names):
                        key = arg_names[key[0]]
                    named[key] = val
                if not any(k in named for k in _SHOWN):  # Triton 3.6 (H100 image): src has none
                    named = constexprs_from_cache_key(cache_key, arg_names)
                variant = ", ".join(f"{k}={named[k]}" for k in _SHOWN if k in named) or "?"
                md = getattr(ck, "metadata", None)
                rows.append(f"| {name} | {variant} | {getattr(md, 'num_warps', '?')} | "
                            f"{getattr(md, 'num_stages', '?')} | {getattr(ck, 'n_regs', '?')} | "
                            f"{getattr(ck, 'n_spills', '?')} |")  # fmt: skip
    return rows


def api_vs_direct(q, k, v, do, lens, seg, dil, causal, scale, ranges, docs, direct_kernels):
    """Markdown lines: the packed fwd+bwd through the public API (:func:`_api_step`) against
    the direct launches (:func:`_step`, default config): do_bench medians, and the API call's
    kernels under the profiler (count, GPU time, the ones the direct call does not launch).
    ``bench_varlen.py`` (the API) has measured ~2.5 ms more than this script's direct launches
    on the causal packed step (2026-11-26/27); this says whether that is GPU work or GPU idle."""
    import triton.testing

    cu_host = _offsets(lens, "cpu")
    longest = max(lens)
    api = lambda: _api_step(q, k, v, do, cu_host, longest, seg, dil, causal, scale)  # noqa: E731
    direct = lambda: _step(q, k, v, do, seg, dil, causal, scale, ranges, docs, None)  # noqa: E731
    api()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        api()
        torch.cuda.synchronize()
    ka = _kernels(prof)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_d:
        direct()
        torch.cuda.synchronize()
    t_api = triton.testing.do_bench(api, warmup=25, rep=150, return_mode="median")
    t_dir = triton.testing.do_bench(direct, warmup=25, rep=150, return_mode="median")
    ga, gd = sum(t for _, t in ka), sum(t for _, t in direct_kernels)
    extra = collections.Counter(n for n, _ in ka)
    extra.subtract(collections.Counter(n for n, _ in direct_kernels))
    lines = ["", "## The public API (host offsets, autograd) vs the direct launches "
             "(default config)", "",
             f"- do_bench fwd+bwd median: API {t_api:.3f} ms, direct {t_dir:.3f} ms "
             f"({t_api / t_dir:.3f}x)",
             f"- kernels under the profiler: API {len(ka)} launches, {ga:.0f} us of GPU time; "
             f"direct {len(direct_kernels)} launches, {gd:.0f} us",
             f"- GPU time not in kernels (idle or copies) in the API call's median: "
             f"{t_api * 1e3 - ga:.0f} us; in the direct call's: {t_dir * 1e3 - gd:.0f} us",
             "- launches the API makes beyond the direct call's (name: count, GPU us): "
             + (", ".join(f"`{n[:50]}`: {c}, {sum(t for m, t in ka if m == n):.0f}"
                          for n, c in extra.items() if c > 0) or "none"),
             f"- CUDA runtime calls on the host (name: count, host us), API: {_runtime_calls(prof)}",
             f"- the same, direct: {_runtime_calls(prof_d)}"]
    return lines


def _runtime_calls(prof) -> str:
    """The CUDA runtime/driver calls of one profiled step, grouped by name: host syncs,
    allocations and copies show here (the measurement's own ``torch.cuda.synchronize()``
    included: ``cudaDeviceSynchronize``, whose host time is the wait for the GPU)."""
    calls: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        name = e.name or ""
        if str(getattr(e, "device_type", "")).endswith("CPU") and name.startswith(("cuda", "cu")):
            calls[name].append(e.time_range.elapsed_us())
    return ", ".join(f"`{n}`: {len(t)}, {sum(t):.0f}" for n, t in sorted(calls.items())) or "none"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--configs", default=",".join(VARIANTS))
    p.add_argument("--total", type=int, default=131072)
    p.add_argument("--unchecked", action="store_true",
                   help="packed offsets as unchecked device offsets (zero-fills kept)")
    p.add_argument("--no-api", dest="api", action="store_false",
                   help="skip the public-API vs direct-launch section")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import triton.testing

    causal = a.causal == "yes"
    dev, dt = torch.device("cuda"), torch.bfloat16
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    h, d, total = 16, 128, a.total
    lens = document_lengths(total, 8192, 1.0, 0)
    longest = max(lens)
    cu = _offsets(lens, dev)
    checked = not a.unchecked  # host lengths: the offsets cover the tensors
    docs = L.Docs(cu, cu, longest, longest, checked)
    ranges = branch_head_ranges(h, len(seg), "all")
    scale = d**-0.5
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, total, h, d, device=dev, dtype=dt) for _ in range(4))
    f_var = dilated_flops_varlen(lens, lens, h, d, seg, dil, causal)
    f_one = dilated_flops(1, total, total, h, d, seg, dil, causal)
    lines = results_header(
        f"varlen vs one sequence, per launch (causal={causal})", dev,
        f"PYTHONPATH=src python3 benchmarks/profile_varlen.py {' '.join(argv or sys.argv[1:])}",
        [f"{total} tokens in {len(lens)} documents (lognormal mean 8192, sigma 1, seed 0; longest "
         f"{longest}), 16 x 128 bf16, branches {seg} / {dil}",
         f"packed offsets {'checked (no zero-fills)' if checked else 'unchecked (zero-fills kept)'}"],
    )
    rows = {}
    # "varlen1": the same tokens as ONE packed document: the packed kernels' own cost (runtime
    # lengths and offsets, the slot search) apart from the documents' shapes
    one_doc = L.Docs(_offsets([total], dev), _offsets([total], dev), total, total, checked)
    for name, dd in (("varlen", docs), ("one", None), ("varlen1", one_doc)):
        fn = lambda dd=dd: _step(q, k, v, do, seg, dil, causal, scale, ranges, dd, None)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows[name] = _kernels(prof)
    lines += ["", "## Per launch, in order (us)", "",
              "| # | varlen kernel | varlen us | one-sequence kernel | one us |", "|---|---|---:|---|---:|"]
    va, on = rows["varlen"], rows["one"]
    for i in range(max(len(va), len(on))):
        x = va[i] if i < len(va) else ("", 0.0)
        y = on[i] if i < len(on) else ("", 0.0)
        lines.append(f"| {i} | {x[0][:48]} | {x[1]:.1f} | {y[0][:48]} | {y[1]:.1f} |")
    v1 = rows["varlen1"]
    lines += ["", "## The same tokens as one packed document vs one sequence (same FLOPs; us)", ""]
    for n in sorted({m for m, _ in v1} | {m for m, _ in on}):
        s1, so = sum(t for m, t in v1 if m == n), sum(t for m, t in on if m == n)
        lines.append(f"- `{n[:60]}`: {s1:.0f} / {so:.0f} us ({s1 / so if so else float('nan'):.3f}x)")
    lines += ["", "## Sums per kernel (us): varlen / one / ratio per useful FLOP", ""]
    names = sorted({n for n, _ in va} | {n for n, _ in on})
    for n in names:
        sv = sum(t for m, t in va if m == n)
        so = sum(t for m, t in on if m == n)
        ratio = (sv / f_var) / (so / f_one) if so else float("nan")
        lines.append(f"- `{n[:60]}`: {sv:.0f} / {so:.0f} us, {ratio:.3f}x")
    tv, to = sum(t for _, t in va), sum(t for _, t in on)
    lines.append(f"- total: {tv:.0f} / {to:.0f} us, {(tv / f_var) / (to / f_one):.3f}x per useful FLOP")
    lines += ["", "## Block-config variants: fwd+bwd median ms (do_bench), ratio per useful FLOP", "",
              "| variant | config | varlen ms | one ms | varlen / one per FLOP | varlen / one (default "
              "config) per FLOP |", "|---|---|---:|---:|---:|---:|"]
    one_default = None  # the one sequence with the default config: a packed-only config's baseline
    for name in a.configs.split(","):
        cfg = VARIANTS[name]
        try:
            tv_ = triton.testing.do_bench(
                lambda: _step(q, k, v, do, seg, dil, causal, scale, ranges, docs, cfg),
                warmup=25, rep=150, return_mode="median")
            to_ = triton.testing.do_bench(
                lambda: _step(q, k, v, do, seg, dil, causal, scale, ranges, None, cfg),
                warmup=25, rep=150, return_mode="median")
            if cfg is None:
                one_default = to_
            vs_default = (f"{(tv_ / f_var) / (one_default / f_one):.3f}" if one_default
                          else "(run `default` first)")
            lines.append(f"| {name} | {cfg} | {tv_:.3f} | {to_:.3f} | {(tv_ / f_var) / (to_ / f_one):.3f} "
                         f"| {vs_default} |")
        except Exception as e:  # a variant that does not compile says so; the others still run
            lines.append(f"| {name} | {cfg} | {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |")
        print(lines[-1], flush=True)
    if a.api:
        lines += api_vs_direct(q, k, v, do, lens, seg, dil, causal, scale, ranges, docs, va)
        print("\n".join(lines[-8:]), flush=True)
    lines += ["", "## Registers and spills of the compiled variants (ptxas, this Triton)", "",
              *compiled_resources()]
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
