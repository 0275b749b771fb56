"""Same-process A/B of the models' rotary: the fused Triton kernel vs the torch code (issue 23, item 5).

Arms, switched by ``flags.set_fused_rotary`` (``True``: the kernel, ``False``: the torch code),
in interleaved rounds (A, B, A, B, ...) so that the host's drift cancels out:

- rotary alone: ``Rotary.rotate`` of q (B, N, 12, 64) and k (B, N, Hkv, 64) bf16, views of one
  Linear-like output as in the model, forward and forward+backward; the kernel's achieved GB/s
  (q and k read and written once each way; the tables are small);
- end to end: LongNet ``base`` training steps (bf16 autocast, fwd + bwd + AdamW) at 8K x 4 and
  16K x 2 with the branches of ``bench_overhead.py``, eager with the kernel, eager without it,
  and ``torch.compile`` (which keeps the torch code; ``--no-compile`` skips it), beside the
  same model with dense attention (one branch w = N: the SDPA path), eager, as the baseline.

Per round and arm: the median of back-to-back calls (``dilated_attention.timing.median_ms``);
reported: the median over rounds and the spread (min-max).

    python benchmarks/ab_rotary.py --out $OUT/ab_rotary.md     # H100: a few minutes
    python benchmarks/ab_rotary.py --tiny --out /tmp/r.md      # CPU smoke run (interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys

import torch

from dilated_attention import flags
from dilated_attention.models.longnet import LongNetConfig, LongNetLM, Rotary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, results_header, run_info, write_report  # noqa: E402


def configs(tiny: bool) -> dict:
    if tiny:
        return dict(rotary=[(2, 64, 4, 2, 16)], preset="tiny",
                    e2e=[(128, 2, (32, 64), (1, 2))])  # fmt: skip
    return dict(rotary=[(4, 8192, 12, 12, 64), (2, 16384, 12, 12, 64), (4, 8192, 12, 4, 64)],
                preset="base",
                e2e=[(8192, 4, (2048, 4096, 8192), (1, 2, 4)),
                     (16384, 2, (2048, 4096, 8192, 16384), (1, 2, 4, 8))])  # fmt: skip


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def rounds(arms: dict, device, args) -> dict:
    """``arms``: name -> (fused switch, callable); each timed once per round, interleaved."""
    out = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (fused, fn) in arms.items():
            flags.set_fused_rotary(fused)
            out[name].append(median_ms(fn, device, args.warmup, args.iters))
    flags.set_fused_rotary(None)
    return out


def rotary_rows(cfg, device, dtype, args) -> list[dict]:
    rows = []
    for b, n, h, hkv, d in cfg["rotary"]:
        rot = Rotary(d).to(device)
        table = rot.table(torch.arange(10**6, 10**6 + n, device=device), dtype)
        qkv = torch.randn(b, n, (h + 2 * hkv) * d, device=device, dtype=dtype)
        # views of one projection output (strided rows), as the model's q and k
        q = qkv[..., : h * d].view(b, n, h, d).detach().requires_grad_()
        k = qkv[..., h * d : (h + hkv) * d].view(b, n, hkv, d).detach().requires_grad_()
        gq, gk = torch.randn_like(q), torch.randn_like(k)

        def fwd():
            with torch.no_grad():
                rot.rotate(q, k, table)

        def fwd_bwd():
            qo, ko = rot.rotate(q, k, table)
            torch.autograd.backward((qo, ko), (gq, gk))
            q.grad = k.grad = None

        res = rounds({"fwd fused": (True, fwd), "fwd torch": (False, fwd),
                      "fwd+bwd fused": (True, fwd_bwd), "fwd+bwd torch": (False, fwd_bwd)},
                     device, args)  # fmt: skip
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write, one direction
        for what in ("fwd", "fwd+bwd"):
            f, t = res[f"{what} fused"], res[f"{what} torch"]
            moved = nbytes * (1 if what == "fwd" else 2)
            rows.append(dict(shape=f"B{b} N{n} H{h}/{hkv} D{d}", what=what, fused=f, torch=t,
                             gbs=moved / (statistics.median(f) * 1e-3) / 1e9))  # fmt: skip
    return rows


def e2e_rows(cfg, device, dtype, args) -> list[dict]:
    rows = []
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for n, batch, seg, dil in cfg["e2e"]:
        mcfg = dataclasses.replace(LongNetConfig.preset(cfg["preset"], max_seq_len=n),
                                   segment_lengths=seg, dilation_rates=dil)  # fmt: skip
        torch.manual_seed(0)
        model = LongNetLM(mcfg).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, mcfg.vocab_size, (batch, n + 1), device=device)
        inp, tgt = x[:, :-1], x[:, 1:]

        # the dense-SDPA baseline of the same run: the same model with one branch w = N, r = 1
        # (the dense path), eager, rotary as shipped (flags default)
        dense = LongNetLM(mcfg.with_attention("dense", n)).to(device).train()
        dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-4)

        def step(run, opt):
            def go():
                with amp:
                    _, loss = run(inp, tgt, return_logits=False)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            return go

        arms = {"eager fused": (True, step(model, opt)), "eager torch": (False, step(model, opt))}
        if not args.no_compile:
            arms["compiled"] = (None, step(torch.compile(model, backend=args.compile_backend), opt))
        arms["eager dense"] = (None, step(dense, dense_opt))
        res = rounds(arms, device, args)
        rows.append(dict(shape=f"N{n} x {batch}", **res))
        del model, opt, dense, dense_opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per round and arm")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-e2e", action="store_true", help="rotary rows only")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled arm")
    p.add_argument("--compile-backend", default=None, help="default inductor (aot_eager with --tiny)")
    p.add_argument("--out", default=None, help="markdown file (default results/ab_rotary_<gpu>_<date>.md)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    info = run_info(device, None if argv is None else " ".join(["python", sys.argv[0], *argv]))
    cfg = configs(args.tiny)
    rot = rotary_rows(cfg, device, dtype, args)
    e2e = [] if args.no_e2e else e2e_rows(cfg, device, dtype, args)
    lines = results_header(
        f"Rotary A/B, fused Triton kernel vs torch code: {info['device']}", info=info,
        extra=[f"{args.rounds} interleaved rounds of {args.iters} timed calls per arm (after "
               f"{args.warmup} warm-up); median over rounds (min-max), ms",
               f"end to end: LongNet {cfg['preset']!r}, {str(dtype).removeprefix('torch.')} autocast, "
               f"fwd + bwd + AdamW, compiled with {args.compile_backend}"],
    )  # fmt: skip
    lines += ["", "| shape | pass | fused ms | torch ms | torch / fused | fused GB/s |", "|---|---|---|---|---|---|"]
    for r in rot:
        ratio = statistics.median(r["torch"]) / statistics.median(r["fused"])
        lines.append(f"| {r['shape']} | {r['what']} | {_spread(r['fused'])} | {_spread(r['torch'])} | "
                     f"{ratio:.2f}x | {r['gbs']:.0f} |")  # fmt: skip
    if e2e:
        lines += ["", "| tokens | eager fused ms | eager torch ms | compiled ms | fused / compiled | "
                  "torch / compiled | eager dense-SDPA ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in e2e:
            comp = r.get("compiled")
            c = statistics.median(comp) if comp else float("nan")
            lines.append(
                f"| {r['shape']} | {_spread(r['eager fused'])} | {_spread(r['eager torch'])} | "
                f"{_spread(comp) if comp else '-'} | {statistics.median(r['eager fused']) / c:.2f}x | "
                f"{statistics.median(r['eager torch']) / c:.2f}x | {_spread(r['eager dense'])} |"
            )
    write_report("\n".join(lines) + "\n", args.out, "ab_rotary", device, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
