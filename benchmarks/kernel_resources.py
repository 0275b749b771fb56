"""Registers and spills of the Triton kernels one call launches, compiled for an H100 without a GPU.

Runs the call of ``profile_varlen.py`` (131072 tokens: 22 packed documents, or one sequence;
16 x 128 bf16, branches 2048..32768 / 1..16; forward and backward) under the Triton
interpreter with every kernel launch **recorded instead of run** (the outputs are garbage: only
the launches' arguments matter), then compiles each distinct launch with the real (not
interpreted) kernels for ``GPUTarget("cuda", 90, 32)``, specialised as Triton's JIT would on a
GPU for those arguments (pointers and ints divisible by 16, ints equal to 1 as constants:
the same binder code), and reads the cubin's resource usage (``cuobjdump
--dump-resource-usage``): registers, stack frame, local memory. Triton's ``n_spills`` on a GPU is
that local memory per thread / 4 (``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4``).

The numbers match a GPU only with the GPU machine's Triton (2026-11-26: triton 3.6.0 and its
bundled ptxas): a venv with that wheel, and torch reached through ``PYTHONPATH`` (the kernels
and the interpreter need no CUDA)::

    python3.11 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy
    # torch from the project's venv through a .pth, which comes after the venv's own triton
    # (the same folder in PYTHONPATH would come first and import the project venv's Triton)
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/t36/lib/python3.11/site-packages/zz.pth
    PYTHONPATH=src /tmp/t36/bin/python benchmarks/kernel_resources.py --what both --causal yes

``--sass DIR`` also writes each variant's SASS (``cuobjdump -sass``): where the spill loads
(``LDL``) sit, in a loop with the MMAs or outside it, says more than their count (2026-11-27:
the packed dK/dV binary at R = 1 had 41 of them in its hot loop, one sequence's 20).

Checked against the H100 (2026-11-26): with triton 3.6.0 this gives, for the causal profile
shape, the registers of every fwd / dQ / dK/dV variant and the dK/dV spills (Triton's
``n_spills`` 80, 80, 54 packed and 50, 76, 48 one sequence = STACK / 4) that
``profile_varlen.py`` read from the kernels loaded on the GPU
(``benchmarks/results/profile_varlen_h100_2026-11-26_recheck.md``). Another Triton gives other
numbers (3.9 here: see NOTES_triton.md): a kernel edit can be judged for registers and spills
in seconds, on the CPU, before a GPU call; its time still needs the GPU.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import pickle
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "..", "src", "dilated_attention", "kernels", "triton_kernels.py")
NAMES = ("VARLEN", "BM", "BN", "CAUSAL", "FIRST", "COMP", "STORE_LO", "R", "HAS_KPM")


def parse_config(text: str | None) -> dict | None:
    """``"dkdv=64,64,4,1;dq=..."`` -> ``{"dkdv": (64, 64, 4, 1), ...}`` (None: the defaults)."""
    if not text:
        return None
    out = {}
    for part in text.split(";"):
        name, _, vals = part.partition("=")
        out[name.strip()] = tuple(int(x) for x in vals.split(","))
    return out


def record(what: str, causal: bool, config: dict | None, path: str, hkv: int = 16) -> None:
    """Phase 1 (a subprocess with TRITON_INTERPRET=1): one forward + backward of the profile
    shape (``what``: varlen or one) with the GPU's block configs, every launch recorded
    (kernel name, arguments with tensors as (dtype, 16-byte aligned), keyword arguments).
    ``hkv``: kv heads (16 query heads)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from dilated_attention.branches import branch_head_ranges
    from dilated_attention.kernels import triton_launch as L

    sys.path.insert(0, HERE)
    from bench_varlen import _offsets, document_lengths

    launches = []

    def _record(self, *args, grid, warmup, **kwargs):
        desc = tuple(("tensor", str(a.dtype), a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                     else a for a in args)  # fmt: skip
        launches.append((self.fn.__name__, desc, kwargs))

    # the GPU's configs and launch options, not the interpreter's small blocks
    L.INTERPRET = False
    L.default_configs = functools.partial(L.default_configs, interpret=False)
    L.USE_PLANS = False  # the per-call path: every launch through the kernel objects
    InterpretedFunction.run = _record
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    h, d, total = 16, 128, 131072
    lens = document_lengths(total, 8192, 1.0, 0)
    docs = None
    if what == "varlen":
        cu = _offsets(lens, torch.device("cpu"))
        docs = L.Docs(cu, cu, max(lens), max(lens), True)
    ranges = branch_head_ranges(h, len(seg), "all")
    q, do = (torch.empty(1, total, h, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(1, total, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    out, lse = L.forward(q, k, v, None, seg, dil, causal, d**-0.5, ranges, config=config, docs=docs)
    L.backward(do, q, k, v, None, out, lse, seg, dil, causal, d**-0.5, ranges, config=config,
               docs=docs)  # fmt: skip
    with open(path, "wb") as f:
        pickle.dump(launches, f)


def resources(cubin: bytes, tool: str) -> dict:
    """REG, STACK, SHARED, LOCAL of one cubin (``cuobjdump --dump-resource-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def _write_sass(cubin: bytes, tool: str, path: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(out)


def compile_launches(launches, kernels: list[str], sass_dir: str | None = None) -> list[str]:
    """Phase 2 (this process, not interpreting): each distinct launch compiled for sm_90 with the
    specialisation Triton's JIT gives its arguments; markdown rows. ``sass_dir``: also write each
    variant's SASS there (``cuobjdump -sass``; where the spill stores and loads sit)."""
    import importlib.util

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    spec = importlib.util.spec_from_file_location("_compiled_triton_kernels", KERNELS)
    comp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comp)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    def tensor(dtype: str, aligned: bool):  # only the dtype and the address's alignment count
        dt = getattr(torch, dtype.split(".")[-1])
        es = torch.empty((), dtype=dt).element_size()
        buf = torch.empty(64 * es + 16, dtype=torch.uint8)  # CPU allocations: 64-byte aligned
        return buf[:64 * es].view(dt) if aligned else buf[es:65 * es].view(dt)

    seen = collections.OrderedDict()
    binders = {}  # per kernel: the JIT's argument binder (specialisation), as JITFunction keeps it
    for what, name, desc, kwargs in launches:
        if name not in kernels:
            continue
        args = [tensor(a[1], a[2]) if isinstance(a, tuple) and a and a[0] == "tensor" else a for a in desc]
        fn = getattr(comp, name)
        if name not in binders:
            binders[name] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, opts = binders[name](*args, **kwargs)
        key = (what, name, str(specialization), str(sorted(kwargs.items())))
        if key in seen:
            seen[key][1] += 1
            seen[key][2].add(bound.get("R"))
            continue
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
        r = resources(ck.asm["cubin"], tool)
        if sass_dir:
            _write_sass(ck.asm["cubin"], tool, os.path.join(sass_dir, f"{what}_{name}_{len(seen)}.sass"))
        variant = ", ".join(f"{n}={bound[n]}" for n in NAMES if n in bound and n != "R")
        seen[key] = [(what, name, variant, options.num_warps, options.num_stages, r), 1, {bound.get("R")}]
    # Triton's n_spills on the H100 (2026-11-26) equals STACK / 4 for every variant here
    rows = ["| call | kernel | variant | R (one binary) | warps | stages | launches | REG | STACK bytes "
            "| LOCAL bytes | Triton's n_spills (STACK / 4) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (what, name, variant, w, s, r), n, rs in seen.values():
        rows.append(f"| {what} | {name} | {variant} | {', '.join(str(x) for x in sorted(rs))} | {w} | {s} | {n} "
                    f"| {r.get('REG')} | {r.get('STACK')} | {r.get('LOCAL')} | {r.get('STACK', 0) // 4} |")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", choices=["varlen", "one", "both"], default="both")
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--config", default=None, help='block configs, e.g. "dkdv=64,64,4,1" (default: the GPU\'s)')
    p.add_argument("--kernels", default="dilated_fwd_kernel,dilated_fwd_folded_kernel,dilated_bwd_dkdv_kernel,dilated_bwd_dq_kernel")
    p.add_argument("--hkv", type=int, default=16, help="kv heads of the call (16 query heads; default 16)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    p.add_argument("--sass", default=None, help="write each variant's SASS (cuobjdump -sass) to this folder")
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)  # phase 1 (internal)
    a = p.parse_args(argv)
    causal = a.causal == "yes"
    config = parse_config(a.config)
    if a.record:
        record(a.what, causal, config, a.record, a.hkv)
        return None
    import triton

    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        for what in (["varlen", "one"] if a.what == "both" else [a.what]):
            path = os.path.join(tmp, f"{what}.pkl")
            env = dict(os.environ, TRITON_INTERPRET="1")
            cmd = [sys.executable, os.path.abspath(__file__), "--what", what, "--causal", a.causal,
                   "--record", path, "--hkv", str(a.hkv)]
            cmd += ["--config", a.config] if a.config else []
            subprocess.run(cmd, env=env, check=True)
            with open(path, "rb") as f:
                launches += [(what, *x) for x in pickle.load(f)]
    rows = compile_launches(launches, a.kernels.split(","), a.sass)
    lines = [f"triton {triton.__version__}, target sm_90 (cuobjdump of the cubin), causal={causal}, "
             f"configs {config or 'default (the GPU ones)'}, 16/{a.hkv} heads",
             "", *rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
