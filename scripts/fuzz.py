"""Long-run fuzzing: random configurations against impl="reference", counting mismatches.

    PYTHONPATH=src python scripts/fuzz.py --impl torch --minutes 10
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/fuzz.py --impl triton --examples 50   # CPU
    PYTHONPATH=src python scripts/fuzz.py --impl triton --device cuda --examples 5000 --workers 12  # GPU
    PYTHONPATH=src python scripts/fuzz.py --varlen --impl torch --minutes 10   # packed documents
    PYTHONPATH=src python scripts/fuzz.py --gluon --device cuda --examples 5000 --workers 12  # Gluon, sm_90
    PYTHONPATH=src python scripts/fuzz.py --gluon --varlen --device cuda --examples 2000 --workers 12  # Gluon varlen

Draws cases from tests/property_cases.py (the same generator as the hypothesis tests; with
``--varlen`` packed documents from tests/varlen_cases.py, checked against the reference on each
document alone; with ``--gluon`` cases of the Gluon kernels from tests/gluon_fuzz_cases.py, see
below; with both, packed documents through the Gluon varlen kernels from
tests/gluon_varlen_fuzz_cases.py, host and device offsets, rows past the documents holding NaN), checks forward, LSE and dq/dk/dv against the float64 reference, prints each mismatch
with its case (replayable: the case holds its seed), a progress line every ``--every`` examples
and a summary; exit 1 if anything mismatched or raised. The tensors are tiny: on a CPU set
OMP_NUM_THREADS=1, above all for several runs side by side (two runs of two threads each on two
cores ran some cases 20x slower, long enough to look hung).

Compile pool (``--pool P``, the default for ``--impl triton`` off the CPU). Compiled, the Triton
kernels specialise on every constexpr (causal, padding mask, FIRST / COMP / STORE_LO, dtype,
block sizes) and on the class of every integer argument that is not ``do_not_specialize``: the
value 1 (a constant), a multiple of 16, anything else (``direct_launch.int_class``). A random
configuration's ~12 integer arguments per launch (nq, nk, nk - nq, w, r, heads, a branch's head
range, kv heads, the first segment with a query, ...) make almost every configuration need
binaries of its own: 6.5 per configuration at first, still ~1 per configuration after 5,000
(5,016 distinct signatures in 5,000 dense draws, counted on the CPU by this script's hook), at
~3 s of compilation each on the H100 host (2026-11-27: 10 dense examples in 180 s needed 65).
With a pool, each worker draws its first P configurations (its *templates*) freely from the
generator and compiles their binaries; every later configuration is a template's ``variant``
(property_cases.variant / varlen_cases.variant): the template's structure kept (heads, kv
heads, headdim, number of branches, causal, split heads, padding mask present or not; varlen
also its switches: dtype, layout, offsets' dtype, fold, per-call, ...) and every value redrawn
at random within its specialisation class (lengths, nq < nk, w and r of every branch, batch,
mask density, documents and their lengths, softmax scale, tensor values: ``FIXED`` below says
exactly what a template fixes). Before a variant runs, a dry run of the impl with Triton's
dispatch replaced by a recorder (:class:`CompileGate`: no kernel runs, direct launch off) lists
the binaries it needs; it runs only if its worker has them all, else it is rejected and another
is drawn (on the CPU with the GPU block configs: 0 of 2,400 dense and 3 of 2,400 varlen variants
rejected; the summary counts them, and any binary an accepted variant still compiled). The
specialisations covered are the templates' (printed: distinct signatures, Triton's cached
binaries), the values the generator's; ``--pool 0`` draws every configuration freely
(compile-bound on a GPU: ~18 s per dense example).

Workers (``--workers W``): W processes (spawned), each with its own generator seed (worker 0
takes ``--seed``; the summary lists them), its own templates and Triton binaries (compiled in
parallel: compilation is CPU work, one core per process), ``--examples`` split between them;
the summary adds them up. Replay a worker's stream with ``--seed <its seed> --workers 1`` and
the same ``--pool``; a single case with ``property_cases.check(case, "triton", "cuda")``.
Where the time goes per case once compiled (CPU measurements): the float64 reference ~1.4 ms, a
dry run ~1 ms; on a GPU add the launches and ~10 host syncs of the comparison.

Gluon kernels (``--gluon``, issue 24: kernels/gluon_fwd.py + gluon_fwd_kernel.py, gluon_bwd.py +
gluon_bwd_kernel.py). The cases above never reach them (headdim 16, float32, masks, nq < nk);
``--gluon`` draws from tests/gluon_fuzz_cases.py instead: configurations that pass every
condition of the Gluon gate a case controls (bf16 / fp16, headdim 64 / 128, seqlen_q ==
seqlen_k = N <= 4096, every branch with w // r >= 2; some with w % r != 0 (blocks of two
lengths) and some with N % w != 0 (a short last segment, at batch 2 each entry launched apart;
forward and backward Gluon's as shipped since 2026-11-29), contiguous
inputs, no mask, no packed documents; partial tiles (w // r mostly no multiple of 64), first
branches with r > 1, MHA / GQA / MQA, causal or not, batch 1-2, heads 1-8; one case in five
with split heads: the Gluon forward, then the Triton backward), with ``gluon_fwd.MIN_ROWS = 0``
and ``D64_MIN_BLOCK = 0`` in each worker (small cases take the Gluon path; exactness depends
on neither). Each case
runs the float64 reference on the device (dense: its size bound is
gluon_fuzz_cases.MAX_SCORES) on the kernels' rounded inputs, then impl="triton" with both Gluon
switches off and on, judged as tests/test_gluon_fwd.py and test_gluon_bwd.py judge the Gluon
path: out, lse, dq, dk, dv within 2x the error of the switches-off run + 1e-3, and both within
a gross bound (fp16: varlen_cases.HALF_ATOL x (1 + max |ref|), bf16 8x that; property_cases has
no bf16 / fp16 tolerance to reuse). A case whose Gluon kernels did not launch (the calls of
``gluon_fwd.launch_branch`` and ``gluon_bwd.launch_branch`` that returned, counted: every
branch forward; each branch backward unless split heads make it refuse) is an ERROR, not a
pass: a run that fell back to the Triton kernels cannot report success. Where Gluon cannot run
(no CUDA device, not sm_90, Gluon missing, Triton's interpreter: any CPU) ``--gluon`` says why
and exits 2 without running a case.

The compile pool serves ``--gluon`` as it serves the others (not ``--pool 0``: a Gluon case
compiles ~3 Gluon and ~4 Triton binaries per branch, its switches-off run included). The Gluon
kernels are ``GluonJITFunction``s, which dispatch through ``JITFunction.run``: the gate patches
the class that defines ``run`` for each kind of kernel (JITFunction once compiled, for both;
under the interpreter InterpretedFunction and JITFunction), classes a host TensorDescriptor by
its ``__mangle__()`` (dtype, block shape, layout: all Triton specialises a descriptor on; its
shape and strides are runtime arguments) and :func:`triton_binaries` counts the Gluon kernels'
binaries too, so "binaries compiled for accepted variants" still says whether the gate held.
(With ``gluon_fwd.DIRECT_LAUNCH``, off as shipped, later Gluon launches skip ``run`` and reuse
a recorded binary, as direct_launch does for Triton.) A dry run launches nothing: the Gluon
forward and backward return unwritten buffers, which nothing reads. A template fixes
``FIXED["gluon"]`` (gluon_fuzz_cases.case_key); its variants redraw N (log-uniformly), each
branch's w and r, the batch and the tensors within those classes (tests/test_fuzz.py measures
the gate's rejections on the CPU, with the Gluon gate forced open for the dry runs).
``--pool`` defaults to 2 here (~20 binaries per template). Replay one case with
``gluon_fuzz_cases.check(case, "triton", "cuda")`` (it sets MIN_ROWS itself).
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import gluon_fuzz_cases  # noqa: E402
import gluon_varlen_fuzz_cases  # noqa: E402
import property_cases  # noqa: E402
import varlen_cases  # noqa: E402

# per kind (batch, --varlen, --gluon): (draw, check, variant, run the impl alone)
KINDS = {
    "batch": (property_cases.random_case, property_cases.check, property_cases.variant, property_cases.run_impl),
    "varlen": (varlen_cases.random_varlen_case, varlen_cases.check_varlen, varlen_cases.variant,
               varlen_cases.run_impl),
    "gluon": (gluon_fuzz_cases.gluon_case, gluon_fuzz_cases.check, gluon_fuzz_cases.variant,
              gluon_fuzz_cases.run_impl),
    "gluon-varlen": (gluon_varlen_fuzz_cases.gluon_varlen_case, gluon_varlen_fuzz_cases.check,
                     gluon_varlen_fuzz_cases.variant, gluon_varlen_fuzz_cases.run_impl),
}  # fmt: skip
# what a template fixes (a variant redraws the rest, within the values' specialisation classes)
FIXED = {
    "batch": "heads, kv heads, headdim 16, number of branches, causal, split heads, padding mask "
           "present; classes (1 / multiple of 16 / other) of nk, nq, nk - nq, each w and r, "
           "(nk - nq) // w, batch x nq x heads",
    "varlen": "heads, kv heads, headdim 16, number of branches, causal, split, return_lse, float16 or "
              "float32, layout, offsets' dtype / sharing / device, check_offsets, fold, per-call, grad, "
              "self-attention packing, any document; classes of each w and r and of the row totals "
              "(queries, keys, queries x heads, longest documents as passed)",
    "gluon": "heads, kv heads, headdim 64 or 128, bf16 or fp16, number and order of branches, causal, "
             "split heads; classes (1 / multiple of 16 / other) of N, heads x N, batch x N x heads and "
             "of each branch's w, r, w // r, N // w and ceil((w // r) / 128)",
    "gluon-varlen": "the stream's rows and the rows past its documents, heads, kv heads, headdim 64 or 128, bf16 or "
                    "fp16, branches (w, r) in order, causal, offsets on the host or the device; class of the "
                    "document count",
}  # fmt: skip


# ------------------------------------------------------------------------------ compile gate


def _params(fn) -> list[tuple[str, bool, bool]]:
    """(name, constexpr, do_not_specialize) of a Triton kernel's parameters, compiled
    (``JITFunction.params``) or interpreted (its signature and jit kwargs)."""
    ps = getattr(fn, "params", None)
    if ps and hasattr(ps[0], "is_constexpr"):
        return [(p.name, bool(p.is_constexpr), bool(p.do_not_specialize)) for p in ps]
    dns = set((getattr(fn, "kwargs", None) or {}).get("do_not_specialize") or ())
    sig = inspect.signature(fn.fn)
    return [(n, "constexpr" in str(p.annotation), n in dns or i in dns)
            for i, (n, p) in enumerate(sig.parameters.items())]  # fmt: skip


def _arg_class(a) -> str:
    import torch

    from dilated_attention.kernels.direct_launch import int_class

    if isinstance(a, bool):
        return "u1"
    if isinstance(a, int):
        return f"i{int_class(a)}"
    if isinstance(a, float):
        return "fp32"
    if isinstance(a, torch.Tensor):
        return f"{a.dtype}{'/16' if a.data_ptr() % 16 == 0 else ''}"
    if hasattr(a, "__mangle__"):  # a Gluon host TensorDescriptor: Triton's own type string of it
        return a.__mangle__()
    return type(a).__name__


def _run_owner(kernel) -> type:
    """The class that defines ``run`` for ``kernel`` (a GluonJITFunction inherits JITFunction's)."""
    return next(c for c in type(kernel).__mro__ if "run" in vars(c))


def gluon_kernels() -> list:
    """One kernel object of each Gluon module (imported here: the gate patches their class)."""
    from dilated_attention.kernels import gluon_bwd, gluon_fwd

    fwd, bwd = gluon_fwd.kernel_module(), gluon_bwd.kernel_module()
    if fwd is None or bwd is None:
        raise RuntimeError(f"the Gluon kernels do not import: {gluon_fwd.import_error() or gluon_bwd._import_error}")
    return [fwd.gluon_fwd_kernel, bwd.dkdv_kernel, bwd.dq_kernel]


class CompileGate:
    """Replaces Triton's dispatch (``JITFunction.run``, the interpreter's ``run``: the class of
    the library's kernels; with ``gluon`` also the class that dispatches the Gluon kernels,
    ``JITFunction``, the same one once compiled) with a recorder of each launch's *signature*:
    what Triton compiles a binary for, namely the kernel, every constexpr's value, every other
    argument's class (:func:`_arg_class`: integers as ``direct_launch.int_class``, tensors by
    dtype and 16-byte alignment, Gluon tensor descriptors by dtype, block shape and layout;
    ``do_not_specialize`` ones by type only) and the launch options. Launches that
    ``direct_launch`` makes without Triton's dispatch reuse a key that went through it before
    (same binary). ``dry``: record only, run nothing (:meth:`needs`)."""

    def __init__(self, gluon: bool = False):
        from dilated_attention.kernels import triton_kernels as kern

        self.cls = _run_owner(kern.dilated_fwd_kernel)
        self.orig = self.cls.run
        self.seen: set = set()  # signatures launched for real
        self.dry: set | None = None  # while a dry run records
        self.params: dict = {}
        self.patched: list[tuple[type, object]] = []  # (class, its own run)
        owners = [self.cls] + [_run_owner(k) for k in (gluon_kernels() if gluon else [])]
        for cls in dict.fromkeys(owners):
            self.patched.append((cls, cls.run))
            cls.run = self._recorder(cls.run)

    def _recorder(self, orig):
        gate = self

        def run(fn, *args, grid, warmup, **kwargs):
            sig = gate.signature(fn, args, kwargs)
            if gate.dry is not None:
                gate.dry.add(sig)
                return None
            gate.seen.add(sig)
            return orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    def close(self) -> None:
        for cls, orig in reversed(self.patched):
            cls.run = orig

    def signature(self, fn, args, kwargs) -> tuple:
        ps = self.params.get(id(fn))
        if ps is None:
            ps = self.params[id(fn)] = _params(fn)
        names = [p[0] for p in ps]
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        parts = []
        for name, const, nospec in ps:
            if name not in bound:
                parts.append("default")
                continue
            a = bound[name]
            if const:
                parts.append(repr(a))
            elif nospec and isinstance(a, int) and not isinstance(a, bool):
                parts.append("i64" if a > 0x7FFFFFFF else "i32")
            else:
                parts.append(_arg_class(a))
        opts = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
        return (_kernel_name(fn), tuple(parts), opts)

    def needs(self, thunk) -> tuple[set, BaseException | None]:
        """The signatures ``thunk()`` launches through Triton's dispatch, run dry (no kernel
        runs; Triton's dispatch for every launch: direct launch off meanwhile), and the
        exception it raised if any."""
        from dilated_attention import flags

        self.dry = set()
        flags.set_direct_launch(False)
        err = None
        try:
            thunk()
        except Exception as e:  # noqa: BLE001 - the real run reports it
            err = e
        finally:
            flags.set_direct_launch(None)
            sigs, self.dry = self.dry, None
        return sigs, err


def _kernel_name(fn) -> str:
    """A kernel's name in signatures: its function's, ``gluon.`` before the Gluon kernels' (whose
    dkdv / dq would read like the Triton ones)."""
    mod = getattr(getattr(fn, "fn", None), "__module__", "") or ""
    gluon = mod.rsplit(".", 1)[-1].startswith("gluon_") and not fn.__name__.startswith("gluon")
    return f"gluon.{fn.__name__}" if gluon else fn.__name__


def triton_binaries() -> set | None:
    """(kernel, cache key) of every binary in the in-process caches of Triton's JITFunctions of
    the library's kernels, the Gluon ones where imported (None under the interpreter, or where
    the cache layout is unknown)."""
    from dilated_attention.kernels import triton_decode, triton_kernels

    out, known = set(), False
    gluon = [sys.modules.get(f"dilated_attention.kernels.{m}")
             for m in ("gluon_fwd_kernel", "gluon_bwd_kernel", "gluon_varlen_kernel")]  # fmt: skip
    for mod in (triton_kernels, triton_decode, *filter(None, gluon)):
        for name, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if caches is None:
                continue
            for entry in list(caches.values()):
                cache = entry[0] if isinstance(entry, tuple) else entry
                if isinstance(cache, dict):
                    known = True
                    out.update((name, str(k)) for k in cache)
    return out if known else None


# ------------------------------------------------------------------------------------ worker


def worker_seed(seed: int, i: int) -> int:
    return seed if i == 0 else random.Random(f"{seed}/{i}").randrange(2**31)


def work(o: dict) -> dict:
    """One worker's loop (``o``: its options); returns its counts and signature sets."""
    if o["threads"]:
        import torch

        torch.set_num_threads(o["threads"])
    tag = f"[w{o['index']}] " if o["workers"] > 1 else ""
    rng = random.Random(o["seed"])
    kind, impl, device, pool = o["kind"], o["impl"], o["device"], o["pool"]
    draw, check_case, variant, run_impl = KINDS[kind]
    if kind in ("gluon", "gluon-varlen"):
        from dilated_attention.kernels import gluon_fwd

        # small cases (and small head-dim-64 blocks) take the Gluon path too; exactness does not
        # depend on the speed floors
        gluon_fwd.MIN_ROWS = gluon_fwd.D64_MIN_BLOCK = 0
        if o.get("gluon_bwd_tail"):
            from dilated_attention.kernels import gluon_bwd

            gluon_bwd.TAIL_SEGMENTS = True
        if o.get("gluon_split_phases"):
            from dilated_attention.kernels import gluon_bwd

            gluon_bwd.SPLIT_PHASES = True
        d = None  # 64 or 128, drawn per template
    else:
        d = 16 if impl == "triton" else rng.choice([4, 16])
    gate = CompileGate(gluon=kind != "batch" and kind != "varlen") if impl == "triton" else None
    templates: list = []
    r = Counter()  # examples, mismatches, errors, templates, accepted, rejected, no_values, unexpected
    t0 = time.monotonic()
    if o["workers"] > 1:
        print(f"{tag}generator seed {o['seed']}: {o['examples'] or 'no limit of'} examples", flush=True)
    try:
        while True:
            if o["examples"] and r["examples"] >= o["examples"]:
                break
            if time.time() > o["deadline"]:
                break
            is_variant = bool(pool) and len(templates) >= pool
            if not is_variant:
                case = draw(rng, d=d)
                if pool:
                    templates.append(case)
                    r["templates"] += 1
            else:
                case = variant(rng.choice(templates), rng)
                if case is None:
                    r["no_values"] += 1
                    continue
                if gate is not None:
                    sigs, err = gate.needs(lambda c=case: run_impl(c, impl, device))
                    if err is None and not sigs <= gate.seen:
                        r["rejected"] += 1
                        continue
                r["accepted"] += 1
            before = len(gate.seen) if gate is not None else 0
            r["examples"] += 1
            try:
                bad = check_case(case, impl, device)
            except Exception as e:  # noqa: BLE001 - a crash is a finding too
                r["errors"] += 1
                print(f"{tag}ERROR {case}: {type(e).__name__}: {e}", flush=True)
                continue
            except KeyboardInterrupt:  # a case that seems to hang: say which one
                print(f"{tag}INTERRUPTED during {case} ({time.monotonic() - t0:.0f} s)", flush=True)
                raise
            if gate is not None and is_variant:
                r["unexpected"] += len(gate.seen) - before  # a variant compiled: the gate missed it
            if bad:
                r["mismatches"] += 1
                print(f"{tag}MISMATCH {case}: {'; '.join(bad)}", flush=True)
            if r["examples"] % o["every"] == 0:
                sig = f"{len(gate.seen)} signatures, {r['rejected']} rejected, " if gate is not None else ""
                print(f"{tag}... {r['examples']} examples, {r['mismatches']} mismatches, {r['errors']} errors, "
                      f"{sig}{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
    finally:  # Triton's dispatch back as it was, whatever happened
        if gate is not None:
            gate.close()
    sigs = set(gate.seen) if gate is not None else set()
    bins = triton_binaries() if impl == "triton" else None
    return dict(counts=dict(r), sigs=sigs, binaries=bins, seconds=time.monotonic() - t0, seed=o["seed"])


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=["torch", "triton"], default=None, help="default: torch (triton with --gluon)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=int, default=0, help="stop after this many in all (0: no limit)")
    ap.add_argument("--minutes", type=float, default=1.0, help="stop starting cases after this long")
    ap.add_argument("--seed", type=int, default=None, help="generator seed (default: random)")
    ap.add_argument("--varlen", action="store_true",
                    help="packed documents (dilated_attention_varlen); with --gluon: the Gluon varlen kernels")  # fmt: skip
    ap.add_argument("--gluon", action="store_true",
                    help="cases the Gluon kernels take (sm_90 CUDA only; exit 2 where they cannot run)")  # fmt: skip
    ap.add_argument("--gluon-bwd-tail", action="store_true",
                    help="with --gluon: the Gluon backward also takes short last segments "
                         "(gluon_bwd.TAIL_SEGMENTS; on as shipped since 2026-11-29, kept for old commands)")  # fmt: skip
    ap.add_argument("--gluon-split-phases", action="store_true",
                    help="with --gluon: the Gluon backward runs every branch's dK/dV before its dQ "
                         "(gluon_bwd.SPLIT_PHASES; on as shipped since 2026-11-29, kept for old commands)")  # fmt: skip
    ap.add_argument("--every", type=int, default=100, help="progress line every N examples (per worker)")
    ap.add_argument("--pool", type=int, default=None,
                    help="templates per worker: the compile pool (0: every case drawn freely; "
                         "default 4 for --impl triton off the CPU (2 with --gluon), else 0)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=1, help="processes (spawned), examples split")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per worker (default: 1 with several workers, else torch's)")
    args = ap.parse_args(argv)
    if args.gluon_bwd_tail and not args.gluon:
        ap.error("--gluon-bwd-tail needs --gluon")
    if args.gluon_split_phases and not args.gluon:
        ap.error("--gluon-split-phases needs --gluon")
    if args.gluon and args.impl == "torch":
        ap.error("--gluon needs --impl triton (the Gluon kernels run inside impl='triton')")
    args.impl = args.impl or ("triton" if args.gluon else "torch")
    kind = ("gluon-varlen" if args.varlen else "gluon") if args.gluon else "varlen" if args.varlen else "batch"
    if args.gluon:
        why = gluon_fuzz_cases.gluon_unavailable(args.device)
        if why is None and args.varlen:
            from dilated_attention.kernels import gluon_varlen

            if gluon_varlen.kernel_module() is None:
                why = f"the Gluon varlen kernels do not import: {gluon_varlen._import_error}"
        if why is not None:  # a run that fell back to the Triton kernels would pass for nothing
            print(f"fuzz --gluon: the Gluon kernels cannot run here: {why}. Nothing was fuzzed (exit 2); "
                  "run it on an sm_90 GPU with --device cuda", file=sys.stderr, flush=True)  # fmt: skip
            return 2
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    pool = args.pool
    if pool is None:
        pool = (2 if args.gluon else 4) if args.impl == "triton" and args.device != "cpu" else 0
    nw = max(1, args.workers)
    switches = ""
    if args.gluon:  # the Gluon backward's switches as the workers will run them (flag or default)
        from dilated_attention.kernels import gluon_bwd

        tail = args.gluon_bwd_tail or gluon_bwd.TAIL_SEGMENTS
        split = args.gluon_split_phases or gluon_bwd.SPLIT_PHASES
        switches = f" gluon_bwd.TAIL_SEGMENTS {'on' if tail else 'off'} gluon_bwd.SPLIT_PHASES {'on' if split else 'off'}"
    print(f"fuzz ({kind}): impl={args.impl} device={args.device} generator seed={seed} "
          f"workers={nw} pool={pool}" + switches, flush=True)  # fmt: skip
    t0 = time.monotonic()
    deadline = time.time() + 60 * args.minutes
    threads = args.threads if args.threads is not None else (1 if nw > 1 else 0)
    opts = [
        dict(index=i, workers=nw, seed=worker_seed(seed, i), impl=args.impl, device=args.device,
             kind=kind, pool=pool, every=args.every, deadline=deadline, threads=threads,
             gluon_bwd_tail=args.gluon_bwd_tail, gluon_split_phases=args.gluon_split_phases,
             examples=args.examples // nw + (i < args.examples % nw) if args.examples else 0)
        for i in range(nw)
    ]  # fmt: skip
    if nw == 1:
        results = [work(opts[0])]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        results = []
        with ProcessPoolExecutor(nw, mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = [ex.submit(work, o) for o in opts]
            for o, fut in zip(opts, futures, strict=True):
                try:
                    results.append(fut.result())
                except Exception as e:  # noqa: BLE001 - a worker that died is an error, not the end
                    print(f"[w{o['index']}] WORKER FAILED (generator seed {o['seed']}): {type(e).__name__}: {e}",
                          flush=True)  # fmt: skip
                    results.append(dict(counts=dict(errors=1), sigs=set(), binaries=None, seconds=0.0,
                                        seed=o["seed"]))  # fmt: skip
    tot = Counter()
    for res in results:
        tot.update(res["counts"])
    n, mism, errs = tot["examples"], tot["mismatches"], tot["errors"]
    print(f"examples run: {n}  mismatches: {mism}  errors: {errs}  "
          f"({time.monotonic() - t0:.0f} s, generator seed {seed}, {nw} worker(s))")  # fmt: skip
    if args.impl == "triton":
        sigs = set().union(*(res["sigs"] for res in results))
        per = Counter(s[0] for s in sigs)
        per_txt = ", ".join(f"{k.replace('dilated_', '').replace('_kernel', '')} {v}" for k, v in sorted(per.items()))
        bins = [res["binaries"] for res in results]
        bins_txt = ("n/a (interpreter, or a Triton cache layout this script does not know)" if any(b is None for b in bins)
                    else f"{len(set().union(*bins))} (union over workers; {sum(map(len, bins))} loaded in all)")  # fmt: skip
        print(f"compiled signatures: {len(sigs)} distinct ({per_txt}); Triton's binaries: {bins_txt}")
        if all(b is not None for b in bins) and len(set().union(*bins)) > len(sigs):
            print("NOTE: Triton holds more binaries than signatures counted: CompileGate's model of "
                  "Triton's specialisation misses something (the pool does not bound compilation)")  # fmt: skip
    if pool:
        print(f"compile pool: {pool} templates per worker x {nw} = {tot['templates']} templates drawn "
              f"freely, {tot['accepted']} variants run; {tot['rejected']} variants rejected before "
              f"running (needed a binary outside the pool), {tot['no_values']} without values in "
              f"class; {tot['unexpected']} binaries compiled for accepted variants (0: the gate held)")  # fmt: skip
        print(f"fixed per template (from the pool, not per case): {FIXED[kind]}; "
              "redrawn per case: everything else")  # fmt: skip
    if nw > 1:
        print("worker seeds: " + ", ".join(f"{res['seed']} ({res['counts'].get('examples', 0)} ex, "
                                           f"{res['seconds']:.0f} s)" for res in results))  # fmt: skip
    return 1 if (mism or errs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
