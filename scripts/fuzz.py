"""Long-run fuzzing: random configurations against impl="reference", counting mismatches.

    PYTHONPATH=src python scripts/fuzz.py --impl torch --minutes 10
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/fuzz.py --impl triton --examples 50   # CPU
    PYTHONPATH=src python scripts/fuzz.py --impl triton --device cuda --examples 5000 --workers 12  # GPU
    PYTHONPATH=src python scripts/fuzz.py --varlen --impl torch --minutes 10   # packed documents

Draws cases from tests/property_cases.py (the same generator as the hypothesis tests; with
``--varlen`` packed documents from tests/varlen_cases.py, checked against the reference on each
document alone), checks forward, LSE and dq/dk/dv against the float64 reference, prints each
mismatch with its case (replayable: the case holds its seed), a progress line every ``--every``
examples and a summary; exit 1 if anything mismatched. The tensors are tiny: on a CPU set
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

import property_cases  # noqa: E402
import varlen_cases  # noqa: E402

# per kind: (draw, check, variant, run the impl alone)
KINDS = {
    False: (property_cases.random_case, property_cases.check, property_cases.variant, property_cases.run_impl),
    True: (varlen_cases.random_varlen_case, varlen_cases.check_varlen, varlen_cases.variant, varlen_cases.run_impl),
}
# what a template fixes (a variant redraws the rest, within the values' specialisation classes)
FIXED = {
    False: "heads, kv heads, headdim 16, number of branches, causal, split heads, padding mask "
           "present; classes (1 / multiple of 16 / other) of nk, nq, nk - nq, each w and r, "
           "(nk - nq) // w, batch x nq x heads",
    True: "heads, kv heads, headdim 16, number of branches, causal, split, return_lse, float16 or "
          "float32, layout, offsets' dtype / sharing / device, check_offsets, fold, per-call, grad, "
          "self-attention packing, any document; classes of each w and r and of the row totals "
          "(queries, keys, queries x heads, longest documents as passed)",
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
    return type(a).__name__


class CompileGate:
    """Replaces Triton's dispatch (``JITFunction.run``, the interpreter's ``run``: the class of
    the library's kernels) with a recorder of each launch's *signature*: what Triton compiles a
    binary for, namely the kernel, every constexpr's value, every other argument's class
    (:func:`_arg_class`: integers as ``direct_launch.int_class``, tensors by dtype and 16-byte
    alignment; ``do_not_specialize`` ones by type only) and the launch options. Launches that
    ``direct_launch`` makes without Triton's dispatch reuse a key that went through it before
    (same binary). ``dry``: record only, run nothing (:meth:`needs`)."""

    def __init__(self):
        from dilated_attention.kernels import triton_kernels as kern

        self.cls = type(kern.dilated_fwd_kernel)
        self.orig = self.cls.run
        self.seen: set = set()  # signatures launched for real
        self.dry: set | None = None  # while a dry run records
        self.params: dict = {}
        gate = self

        def run(fn, *args, grid, warmup, **kwargs):
            sig = gate.signature(fn, args, kwargs)
            if gate.dry is not None:
                gate.dry.add(sig)
                return None
            gate.seen.add(sig)
            return gate.orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        self.cls.run = run

    def close(self) -> None:
        self.cls.run = self.orig

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
        return (fn.__name__, tuple(parts), opts)

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


def triton_binaries() -> set | None:
    """(kernel, cache key) of every binary in the in-process caches of Triton's JITFunctions of
    the library's kernels (None under the interpreter, or where the cache layout is unknown)."""
    from dilated_attention.kernels import triton_decode, triton_kernels

    out, known = set(), False
    for mod in (triton_kernels, triton_decode):
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
    varlen, impl, device, pool = o["varlen"], o["impl"], o["device"], o["pool"]
    draw, check_case, variant, run_impl = KINDS[varlen]
    d = 16 if impl == "triton" else rng.choice([4, 16])
    gate = CompileGate() if impl == "triton" else None
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
    ap.add_argument("--impl", choices=["torch", "triton"], default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=int, default=0, help="stop after this many in all (0: no limit)")
    ap.add_argument("--minutes", type=float, default=1.0, help="stop starting cases after this long")
    ap.add_argument("--seed", type=int, default=None, help="generator seed (default: random)")
    ap.add_argument("--varlen", action="store_true", help="packed documents (dilated_attention_varlen)")
    ap.add_argument("--every", type=int, default=100, help="progress line every N examples (per worker)")
    ap.add_argument("--pool", type=int, default=None,
                    help="templates per worker: the compile pool (0: every case drawn freely; "
                         "default 4 for --impl triton off the CPU, else 0)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=1, help="processes (spawned), examples split")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per worker (default: 1 with several workers, else torch's)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    pool = args.pool if args.pool is not None else (4 if args.impl == "triton" and args.device != "cpu" else 0)
    nw = max(1, args.workers)
    what = "varlen" if args.varlen else "batch"
    print(f"fuzz ({what}): impl={args.impl} device={args.device} generator seed={seed} "
          f"workers={nw} pool={pool}", flush=True)  # fmt: skip
    t0 = time.monotonic()
    deadline = time.time() + 60 * args.minutes
    threads = args.threads if args.threads is not None else (1 if nw > 1 else 0)
    opts = [
        dict(index=i, workers=nw, seed=worker_seed(seed, i), impl=args.impl, device=args.device,
             varlen=args.varlen, pool=pool, every=args.every, deadline=deadline, threads=threads,
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
        print(f"fixed per template (from the pool, not per case): {FIXED[args.varlen]}; "
              "redrawn per case: everything else")  # fmt: skip
    if nw > 1:
        print("worker seeds: " + ", ".join(f"{res['seed']} ({res['counts'].get('examples', 0)} ex, "
                                           f"{res['seconds']:.0f} s)" for res in results))  # fmt: skip
    return 1 if (mism or errs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
