"""Do the batch (non-varlen) Triton kernels compile to the same code as at an older commit?

Compiles every kernel variant (causal x key padding) of the current ``triton_kernels.py`` with
``VARLEN=False`` and of the file at ``--rev`` to Triton IR (TTIR, after Triton's TTIR passes) for
an sm_90 target, without a GPU (no launch: nothing needs CUDA), and compares the multisets of
operations (SSA names ignored: the varlen change added two unused pointer arguments, which
renumbers values). ``--ptx`` also lowers the causal fwd and dq kernels to PTX and prints the
instructions that differ. ``--varlen`` also compiles the packed-documents variants
(``VARLEN=True``) of the current file to PTX (that they compile for sm_90, no comparison).
An old file that has ``VARLEN`` already is compiled with ``VARLEN=False``.

    python benchmarks/compare_kernel_ir.py --rev 8d86ec6 [--ptx] [--varlen]

Result at the varlen commit (2026-11-24, triton 3.9, CPU): TTIR op multisets equal for all 16
variants; PTX differs only in 3-4 scalar int64 address instructions of the program prologue
(the batch offset ``b * stride`` is computed once instead of per tensor), none in the loops.
At the flat varlen grid (``--rev daab233``, 2026-11-26, triton 3.9, CPU): TTIR equal for all 16,
PTX of the causal fwd and dq identical (the new ``NDOCS`` argument is unused there).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret

import triton  # noqa: E402,F401
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402

PATH = "src/dilated_attention/kernels/triton_kernels.py"
INTS = {"NQ", "NK", "QOFF", "HS", "NHB", "H", "REP", "W", "R", "S0", "NM", "HE", "HKV", "NI",
        "NNB", "N", "NB", "WMIN", "RMAX", "NT", "NROWS", "LO_ROW0", "NDOCS"}
TARGET = GPUTarget("cuda", 90, 32)


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _signature(fn, consts):
    sig = {}
    for p in fn.arg_names:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ("qk_scale", "sm_scale"):
            sig[p] = "fp32"
        elif p[0].isupper() and p not in INTS:
            sig[p] = {"CU_Q": "*i32", "CU_K": "*i32", "BRS": "*i32", "KPM": "*u8", "ACC_L": "*fp32",
                      "LSE": "*fp32", "DELTA": "*fp32"}.get(p, "*bf16")
        else:
            sig[p] = "i32"
    return sig


def compile_to(fn, consts, last):
    src = ASTSource(fn=fn, signature=_signature(fn, consts), constexprs=dict(consts))
    backend = make_backend(TARGET)
    opts = backend.parse_options({"num_warps": 8, "num_stages": 3})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(TARGET, opts, backend.get_codegen_implementation(opts),
                      backend.get_module_map(), ctx)
    stages = {}
    backend.add_stages(stages, opts, src.language)
    md = {}
    for st in ("ttir", "ttgir", "llir", "ptx"):
        mod = stages[st](mod, md)
        if st == last:
            return str(mod)
    raise ValueError(last)


def _ops(text, ptx):
    out = collections.Counter()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("module", "tt.func", "#loc", ".loc", ".file", "//",
                                        ".param", "ld.param", ".b8", ".section", "}")):
            continue
        line = re.sub(r"loc\(.*?\)", "", line)
        line = re.sub(r"%[\w#]+|\b\d+\b|_param_\d+" if ptx else r"%[\w#]+", "#", line)
        out[line] += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="8d86ec6", help="git revision of the old kernels")
    ap.add_argument("--ptx", action="store_true", help="also compare PTX of two variants")
    ap.add_argument("--varlen", action="store_true",
                    help="also compile the VARLEN=True variants of the current file to PTX")
    args = ap.parse_args()
    old_src = subprocess.run(["git", "show", f"{args.rev}:{PATH}"], check=True,
                             capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "old_kernels.py")
        with open(p, "w") as f:
            f.write(old_src)
        old = _load("old_kernels", p)
    new = _load("new_kernels", PATH)
    base = dict(D=128, BM=128, BN=64, PREC="tf32")
    cases = []
    for causal in (False, True):
        for kpm in (False, True):
            c = dict(base, CAUSAL=causal, HAS_KPM=kpm)
            cases += [("dilated_fwd_kernel", dict(c, FIRST=False, COMP=True, STORE_LO=True)),
                      ("dilated_fwd_folded_kernel", c),
                      ("dilated_bwd_dkdv_kernel", dict(c, BM=64, COMP=True, STORE_LO=True)),
                      ("dilated_bwd_dq_kernel", dict(c, COMP=True, STORE_LO=False))]
    bad = 0
    def old_consts(fn, c):  # an old file that already had VARLEN (from 2026-11-24): batch path
        c = dict(c, VARLEN=False) if "VARLEN" in fn.arg_names else c
        # the backward kernels took FIRST on 2026-11-26 (False: the code they had before)
        return dict(c, FIRST=False) if "FIRST" in fn.arg_names and "FIRST" not in c else c

    for name, c in cases:
        fn = getattr(old, name)
        a = _ops(compile_to(fn, old_consts(fn, c), "ttir"), False)
        b = _ops(compile_to(getattr(new, name), old_consts(getattr(new, name), c), "ttir"), False)
        same = a == b
        bad += not same
        print(f"TTIR {name:28s} causal={c['CAUSAL']!s:5s} kpm={c['HAS_KPM']!s:5s} "
              f"ops {sum(a.values())} vs {sum(b.values())}: {'same' if same else 'DIFFERENT'}")
    if args.ptx:
        c = dict(base, CAUSAL=True, HAS_KPM=False, COMP=True)
        for name, cc in (("dilated_fwd_kernel", dict(c, FIRST=False, STORE_LO=True)),
                         ("dilated_bwd_dq_kernel", dict(c, STORE_LO=False))):
            fn = getattr(old, name)
            a = _ops(compile_to(fn, old_consts(fn, cc), "ptx"), True)
            b = _ops(compile_to(getattr(new, name), old_consts(getattr(new, name), cc), "ptx"), True)
            print(f"PTX {name}: {sum(a.values())} vs {sum(b.values())} instructions; "
                  f"only old: {dict(a - b)}; only new: {dict(b - a)}")
    if args.varlen:
        for name, c in cases:
            fn = getattr(new, name)
            ptx = compile_to(fn, dict(old_consts(fn, c), VARLEN=True), "ptx")
            print(f"PTX VARLEN=True {name:28s} causal={c['CAUSAL']!s:5s} kpm={c['HAS_KPM']!s:5s} "
                  f"{sum(_ops(ptx, True).values())} instructions")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
