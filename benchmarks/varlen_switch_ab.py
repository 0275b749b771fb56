"""A/B of ``gluon_varlen.VARLEN_FORWARD`` or ``VARLEN_BACKWARD`` (issue 22 item 2b): packed documents
through the public ``dilated_attention_varlen(impl="triton")`` with the Gluon varlen kernels on and
off, over several packed batches (document-length mixes, head dims, GQA, dtypes, causal or not).
``--switch forward`` (the default) flips the forward's switch (the backward's as shipped in both
arms); ``--switch backward`` flips the backward's (the forward's as shipped); ``both`` flips both;
``host-desc`` flips ``gluon_varlen.HOST_DESCRIPTORS`` (the Gluon varlen kernels in both arms, their
descriptors made on the host over the whole stream, or by every program on the device); ``unchecked``
flips ``gluon_varlen.HOST_DESCRIPTORS_UNCHECKED`` with the offsets handed over on the device in both arms
(unchecked offsets: the split launches of host- and device-descriptor programs, or device descriptors only);
``fill-only`` flips ``gluon_varlen.FILL_UNCOVERED_ONLY``, offsets on the device in both arms (unchecked
offsets: only the rows no document covers filled, or every result and accumulator zero-filled).
``--min-mean-doc``, ``--min-mean-doc-backward`` and ``--headdims`` replace the gates
(``gluon_varlen.MIN_MEAN_DOC``, ``MIN_MEAN_DOC_BACKWARD``, ``HEADDIMS``, ``HEADDIMS_BACKWARD`` and their
``DEVICE_DESC_`` twins alike)
for the run, to time batches the shipped gates keep on the Triton kernels (where is the crossover?).

Both arms run in one process, interleaved over ``--rounds`` rounds (on, off, on, off, ...), so
their ratio compares them under the same clocks. Forward (no grad) and forward+backward medians
(``triton.testing.do_bench``). With ``--switch forward`` the backward is the same in both arms, so
the fwd+bwd ratio shows what the forward's change is worth in a training step. ``max|on-off|``: the
largest difference of the two arms' outputs (both exact to the reference in the tests: a sanity
column, not the exactness test, which is tests/test_gluon_varlen.py).

    PYTHONPATH=src python3 benchmarks/varlen_switch_ab.py --out results.md     # Hopper GPU
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys

import torch

from dilated_attention import dilated_attention_varlen
from dilated_attention.kernels import gluon_varlen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_varlen import _offsets, document_lengths  # noqa: E402
from common import results_header  # noqa: E402

DEVICE = "cuda"  # tests/test_gluon_varlen.py runs a tiny case on the CPU (interpreter)
LONGNET = ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
# name: (total tokens, mean length, sigma, heads, kv heads, headdim, dtype, segments, dilations)
CASES = {
    "issue-128k-16x128": (131072, 8192, 1.0, 16, 16, 128, torch.bfloat16, *LONGNET),
    "short-docs-64k-mean512": (65536, 512, 1.0, 16, 16, 128, torch.bfloat16, [512, 1024, 2048], [1, 2, 4]),
    "d64-64k-mean4096": (65536, 4096, 1.0, 16, 16, 64, torch.bfloat16, [2048, 4096, 8192], [1, 2, 4]),
    "gqa32x8-64k-mean4096": (65536, 4096, 1.0, 32, 8, 128, torch.bfloat16, [2048, 4096, 8192], [1, 2, 4]),
    "fp16-64k-mean8192": (65536, 8192, 1.0, 16, 16, 128, torch.float16, *LONGNET),
    "few-long-256k-mean64k": (262144, 65536, 0.5, 8, 8, 128, torch.bfloat16, *LONGNET),
    # between the 512-token mix and the 4096 ones: where MIN_MEAN_DOC belongs
    "mean1024-64k": (65536, 1024, 1.0, 16, 16, 128, torch.bfloat16, [1024, 2048, 4096], [1, 2, 4]),
    "mean2048-64k": (65536, 2048, 1.0, 16, 16, 128, torch.bfloat16, [2048, 4096, 8192], [1, 2, 4]),
    # below the 512-token mix: where the gates belong once no program makes descriptors (2026-11-29, s30)
    "mean256-64k": (65536, 256, 1.0, 16, 16, 128, torch.bfloat16, [256, 512, 1024], [1, 2, 4]),
}


def _bench(fn, rep: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def run_case(name: str, causal: bool, rounds: int, rep: int, switch: str = "forward") -> dict:
    total, mean, sigma, h, hkv, d, dt, seg, dil = CASES[name]
    lens = document_lengths(total, mean, sigma, 0)
    cu = _offsets(lens, "cpu")
    if switch in ("unchecked", "fill-only"):  # offsets on the device: not checked on the host, so not `covered`
        cu = cu.to(DEVICE)
    longest = max(lens)
    torch.manual_seed(0)
    q, do = (torch.randn(total, h, d, device=DEVICE, dtype=dt) for _ in range(2))
    k, v = (torch.randn(total, hkv, d, device=DEVICE, dtype=dt) for _ in range(2))
    xs = [t.clone().requires_grad_() for t in (q, k, v)]

    def call(a, b, c):
        return dilated_attention_varlen(a, b, c, cu, cu, longest, longest, seg, dil, causal=causal, impl="triton")

    def fwd():
        with torch.no_grad():
            return call(*xs)

    def fb():
        return torch.autograd.grad(call(*xs), xs, do)

    names = {"forward": ["VARLEN_FORWARD"], "backward": ["VARLEN_BACKWARD"],
             "both": ["VARLEN_FORWARD", "VARLEN_BACKWARD"], "host-desc": ["HOST_DESCRIPTORS"],
             "unchecked": ["HOST_DESCRIPTORS_UNCHECKED"], "fill-only": ["FILL_UNCOVERED_ONLY"]}[switch]  # fmt: skip
    shipped = {n: getattr(gluon_varlen, n) for n in names}

    def arm(on: bool, what):
        for n in names:
            setattr(gluon_varlen, n, on)
        try:
            return what()
        finally:
            for n, val in shipped.items():
                setattr(gluon_varlen, n, val)

    # the on arm's calls of the Gluon varlen forward and backward (0: the gate sent it to Triton)
    calls = {"forward": [], "backward": []}
    real = {n: getattr(gluon_varlen, n) for n in calls}
    for n in calls:
        setattr(gluon_varlen, n, lambda *a, _n=n, **kw: calls[_n].append(1) or real[_n](*a, **kw))
    try:
        outs = {True: arm(True, fb)}
        counted = {n: len(c) for n, c in calls.items()}  # the on arm's only
        outs[False] = arm(False, fb)
    finally:
        for n in calls:
            setattr(gluon_varlen, n, real[n])
    times = {(on, k): [] for on in (True, False) for k in ("fwd", "fb")}
    for _ in range(rounds):
        for on in (True, False):
            times[(on, "fwd")].append(arm(on, lambda: _bench(fwd, rep)))
            times[(on, "fb")].append(arm(on, lambda: _bench(fb, rep)))
    med = {key: statistics.median(v) for key, v in times.items()}
    return dict(name=name, causal=causal, docs=len(lens), longest=longest,
                gluon=f"{counted['forward']} / {counted['backward']}",
                diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(outs[True], outs[False], strict=True)),
                on_fwd=med[(True, "fwd")], off_fwd=med[(False, "fwd")],
                on_fb=med[(True, "fb")], off_fb=med[(False, "fb")],
                spread=[min(rs), max(rs)] if (rs := [a / b for a, b in zip(times[(True, "fb")], times[(False, "fb")],
                                                                            strict=True)]) else [])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--switch", choices=["forward", "backward", "both", "host-desc", "unchecked", "fill-only"], default="forward")
    ap.add_argument("--min-mean-doc", type=int, default=None, help="replaces gluon_varlen.MIN_MEAN_DOC")
    ap.add_argument("--min-mean-doc-backward", type=int, default=None,
                    help="replaces gluon_varlen.MIN_MEAN_DOC_BACKWARD")
    ap.add_argument("--headdims", default=None, help="replaces gluon_varlen.HEADDIMS, e.g. 64,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.min_mean_doc is not None:
        gluon_varlen.MIN_MEAN_DOC = gluon_varlen.DEVICE_DESC_MIN_MEAN_DOC = args.min_mean_doc
    if args.min_mean_doc_backward is not None:
        gluon_varlen.MIN_MEAN_DOC_BACKWARD = gluon_varlen.DEVICE_DESC_MIN_MEAN_DOC_BACKWARD = args.min_mean_doc_backward
    if args.headdims is not None:
        dims = tuple(int(x) for x in args.headdims.split(","))
        gluon_varlen.HEADDIMS = gluon_varlen.HEADDIMS_BACKWARD = gluon_varlen.DEVICE_DESC_HEADDIMS_BACKWARD = dims
    gates = (f"gates: MIN_MEAN_DOC {gluon_varlen.MIN_MEAN_DOC} (device descriptors "
             f"{gluon_varlen.DEVICE_DESC_MIN_MEAN_DOC}), MIN_MEAN_DOC_BACKWARD {gluon_varlen.MIN_MEAN_DOC_BACKWARD} "
             f"({gluon_varlen.DEVICE_DESC_MIN_MEAN_DOC_BACKWARD}), HEADDIMS {gluon_varlen.HEADDIMS}, HEADDIMS_BACKWARD "
             f"{gluon_varlen.HEADDIMS_BACKWARD} ({gluon_varlen.DEVICE_DESC_HEADDIMS_BACKWARD}), HOST_DESCRIPTORS "
             f"{gluon_varlen.HOST_DESCRIPTORS}")
    lines = [
        *results_header(f"gluon_varlen switch {args.switch!r} on / off: packed documents through "
                        "dilated_attention_varlen(impl='triton')",
                        device="cuda", command=f"python3 benchmarks/varlen_switch_ab.py {shlex.join(sys.argv[1:])}"),
        "",
        f"Interleaved, {args.rounds} rounds, medians (ms). on / off < 1: the Gluon varlen kernels are faster. "
        "Gluon calls: the on arm's calls of gluon_varlen.forward / backward in one training step. "
        "per round: the range of the fwd+bwd on/off ratio over the rounds (two identical arms spread about "
        "0.94-1.01 on an H200, 2026-11-29: read ratios inside that as no difference). "
        f"max abs on-off: over dq, dk, dv. {gates}.",
        "",
        "| case | causal | docs | longest | Gluon calls fwd / bwd (on) | fwd on | fwd off | on/off | fwd+bwd on | fwd+bwd off | on/off | per round | max abs on-off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def flush():
        text = "\n".join(lines) + "\n"
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)

    for name in args.cases.split(","):
        for causal in (False, True):
            try:
                r = run_case(name, causal, args.rounds, args.rep, args.switch)
                lines.append(
                    f"| {name} | {causal} | {r['docs']} | {r['longest']} | {r['gluon']} | {r['on_fwd']:.3f} | {r['off_fwd']:.3f} | "
                    f"{r['on_fwd'] / r['off_fwd']:.3f} | {r['on_fb']:.3f} | {r['off_fb']:.3f} | "
                    f"{r['on_fb'] / r['off_fb']:.3f} | {r['spread'][0]:.3f}-{r['spread'][1]:.3f} | {r['diff']:.2e} |")  # fmt: skip
            except Exception as e:  # noqa: BLE001  (a case that cannot run says why; the others run)
                lines.append(f"| {name} | {causal} | error: {type(e).__name__}: {str(e).splitlines()[0][:150]} |")
            print(lines[-1], flush=True)
            flush()
            torch.cuda.empty_cache()
    flush()


if __name__ == "__main__":
    main()
