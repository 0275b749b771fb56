"""GQA / MQA against MHA on the fused Triton kernel (issue 24 target 2), with dense SDPA.

Per row (kv heads x causal): forward (no grad) and forward+backward of
``dilated_attention(impl="triton")``, and dense ``F.scaled_dot_product_attention`` of the same
run (k, v repeated to the query heads outside the timed call: the same FLOPs as GQA, as
benchmarks/sweep.py), in interleaved rounds (fused, dense, fused, dense, ...) so that the host's
and the GPU's drift cancel out.

Reported per row and pass: the median over rounds (min-max) of each round's median ms, useful
TF/s (``dilated_attention.flops``), % of the same run's dense SDPA and, per causal mode, each
GQA / MQA row's % of dense over the MHA row's (issue 24 target 2: >= 0.90).

    python benchmarks/bench_gqa.py --out $OUT/bench_gqa.md              # H100: a few minutes
    TRITON_INTERPRET=1 python benchmarks/bench_gqa.py --tiny --out /tmp/g.md   # CPU smoke run

Headline shape: B 1, N 131072, 16 query heads x 128, bf16, branches w 2048..32768, r 1..16,
kv heads 16 / 4 / 1, causal and not. ``--tiny``: N 128, 8 x 16 heads (kv 8 / 2 / 1), fp32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention
from dilated_attention.flops import dense_flops, dilated_flops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, results_header, run_info, write_report  # noqa: E402


def shape(tiny: bool) -> dict:
    if tiny:
        return dict(b=1, n=128, h=8, hkvs=(8, 2, 1), d=16, dtype=torch.float32,
                    seg=(16, 32, 64), dil=(1, 2, 4))  # fmt: skip
    return dict(b=1, n=131072, h=16, hkvs=(16, 4, 1), d=128, dtype=torch.bfloat16,
                seg=(2048, 4096, 8192, 16384, 32768), dil=(1, 2, 4, 8, 16))  # fmt: skip


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def run(args) -> tuple[list[dict], dict]:
    s = shape(args.tiny)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    b, n, h, d, dtype = s["b"], s["n"], s["h"], s["d"], s["dtype"]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    hkvs = [int(x) for x in args.hkv.split(",")] if args.hkv else list(s["hkvs"])
    rows = []
    dense = {}
    for causal in causals:
        for hkv in hkvs:
            torch.manual_seed(0)
            q = torch.randn(b, n, h, d, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(b, n, hkv, d, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(b, n, hkv, d, device=device, dtype=dtype, requires_grad=True)
            do = torch.randn_like(q)

            def fwd(q=q, k=k, v=v, causal=causal):
                with torch.no_grad():
                    dilated_attention(q, k, v, s["seg"], s["dil"], causal=causal, impl="triton")

            def fb(q=q, k=k, v=v, do=do, causal=causal):
                out = dilated_attention(q, k, v, s["seg"], s["dil"], causal=causal, impl="triton")
                torch.autograd.backward(out, do)
                q.grad = k.grad = v.grad = None

            arms = {"fused fwd": fwd, "fused fwd+bwd": fb}
            if causal not in dense:  # dense does not depend on hkv (k, v repeated)
                qt = q.detach().transpose(1, 2).requires_grad_()
                kt = k.detach().repeat_interleave(h // hkv, 2).transpose(1, 2).requires_grad_()
                vt = v.detach().repeat_interleave(h // hkv, 2).transpose(1, 2).requires_grad_()
                dot = do.transpose(1, 2)

                def dfwd(qt=qt, kt=kt, vt=vt, causal=causal):
                    with torch.no_grad():
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                def dfb(qt=qt, kt=kt, vt=vt, dot=dot, causal=causal):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    torch.autograd.backward(o, dot)
                    qt.grad = kt.grad = vt.grad = None

                arms["dense fwd"] = dfwd
                arms["dense fwd+bwd"] = dfb
            times = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, fn in arms.items():
                    iters = args.dense_iters if name.startswith("dense") else args.iters
                    times[name].append(median_ms(fn, device, args.warmup, iters))
            if "dense fwd" in times:
                dense[causal] = {w: times.pop(f"dense {w}") for w in ("fwd", "fwd+bwd")}
                del qt, kt, vt, dot
            for what in ("fwd", "fwd+bwd"):
                bw = what == "fwd+bwd"
                useful = dilated_flops(b, n, n, h, d, s["seg"], s["dil"], causal, backward=bw)
                dfl = dense_flops(b, n, h, d, causal, backward=bw)
                rows.append(dict(causal=causal, hkv=hkv, what=what, ms=times[f"fused {what}"],
                                 useful=useful, dense_flops=dfl))  # fmt: skip
            del q, k, v, do
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, dict(shape=s, device=device, dense=dense, hkvs=hkvs)


def report(rows, meta, args, info) -> str:
    s, dense = meta["shape"], meta["dense"]

    def tfs(flops, ms):
        return flops / (ms * 1e-3) / 1e12

    lines = results_header(
        f"GQA / MQA vs MHA on the fused Triton kernel, with dense SDPA: {info['device']}",
        info=info,
        extra=[f"B {s['b']}, N {s['n']}, {s['h']} query heads x {s['d']}, kv heads "
               f"{'/'.join(str(x) for x in meta['hkvs'])}, {str(s['dtype']).removeprefix('torch.')}, "
               f"branches w {','.join(map(str, s['seg']))} r {','.join(map(str, s['dil']))}",
               f"{args.rounds} interleaved rounds of {args.iters} timed calls per arm (dense: "
               f"{args.dense_iters}), {args.warmup} warm-up; median over rounds (min-max), ms; "
               "% dense = useful TF/s / dense SDPA's TF/s (k, v repeated: same FLOPs)"],
    )  # fmt: skip
    lines += ["", "| causal | H/Hkv | pass | fused ms | fused TF/s | dense ms | dense TF/s | % dense |",
              "|---|---|---|---|---|---|---|---|"]
    pct = {}
    for r in rows:
        ms = statistics.median(r["ms"])
        dn = statistics.median(dense[r["causal"]][r["what"]])
        dt = tfs(r["dense_flops"], dn)
        p = tfs(r["useful"], ms) / dt
        pct[(r["causal"], r["hkv"], r["what"])] = p
        lines.append(f"| {r['causal']} | {s['h']}/{r['hkv']} | {r['what']} | {_spread(r['ms'])} | "
                     f"{tfs(r['useful'], ms):.0f} | {_spread(dense[r['causal']][r['what']])} | "
                     f"{dt:.0f} | {100 * p:.1f}% |")  # fmt: skip
    mha = s["h"]
    lines += ["", f"Issue 24 target 2: each GQA / MQA row's % of dense over the MHA row's ({s['h']}/{mha}): "
              ">= 0.90 meets it.", "",
              "| causal | H/Hkv | pass | % dense / MHA's | meets |", "|---|---|---|---|---|"]
    for (causal, hkv, what), p in pct.items():
        if hkv == mha or (causal, mha, what) not in pct:
            continue
        ratio = p / pct[(causal, mha, what)]
        lines.append(f"| {causal} | {s['h']}/{hkv} | {what} | {ratio:.3f} | {'yes' if ratio >= 0.9 else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    p.add_argument("--hkv", default=None, help="kv heads, comma-separated (default 16,4,1; tiny 8,2,1)")
    p.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    p.add_argument("--iters", type=int, default=None, help="timed calls per round and arm (default 10; tiny 1)")
    p.add_argument("--dense-iters", type=int, default=None, help="for dense SDPA (default 3; tiny 1)")
    p.add_argument("--warmup", type=int, default=None, help="default 2; tiny 1")
    p.add_argument("--rounds", type=int, default=None, help="default 5; tiny 2")
    p.add_argument("--out", default=None, help="markdown file (default results/bench_gqa_<gpu>_<date>.md)")
    args = p.parse_args(argv)
    for name, full, tiny in (("iters", 10, 1), ("dense_iters", 3, 1), ("warmup", 2, 1), ("rounds", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    info = run_info(torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"),
                    " ".join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]))
    rows, meta = run(args)
    write_report(report(rows, meta, args, info), args.out, "bench_gqa", meta["device"], info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
