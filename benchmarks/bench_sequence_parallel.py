"""Sequence-parallel dilated attention benchmark (GitHub issue 5): weak and strong scaling.

Run with torchrun, one process per GPU, e.g. on 2 GPUs:

    torchrun --nproc_per_node=2 benchmarks/bench_sequence_parallel.py --out benchmarks/results/sp_h200x2.md

LongNet branches: w = 2048, 4096, 8192, 16384, 32768 with r = 1, 2, 4, 8, 16, plus one global
branch w = N with r = N / 2048 (so every branch has 2048 rows per segment and offset). Heads 16 x
128, bf16, causal and not.

- weak scaling: N = 256K x P on P ranks vs N = 256K on one GPU;
- strong scaling: N = 1M on P ranks vs N = 1M on one GPU.

For each it reports forward and forward+backward time (max over ranks), useful TFLOP/s per GPU
(docs/spec.md, "Measuring speed": pairs attended per branch and head, causal counted exactly), per-rank peak
memory, bytes sent per rank (forward; backward = K/V rows again + returned dK/dV), and the
efficiency ``t1 / tP`` (weak) or ``t1 / (P * tP)`` (strong), where t1 is the same
sequence-parallel code on a one-rank group on rank 0 (the other ranks wait at a barrier). Also on
rank 0: the single-device ``dilated_attention(impl=--single-impl)`` time and, up to
``--dense-max`` tokens, dense causal/full SDPA at the same N. A correctness check against the
single-device torch path runs first. The markdown table is printed last and written to ``--out``.

CPU smoke test (gloo): ``torchrun --nproc_per_node=2 benchmarks/bench_sequence_parallel.py --device cpu --small``
"""

from __future__ import annotations

import os

# NVLink SHARP (multicast) must stay off on the shared machines; set before NCCL initialises
os.environ["NCCL_NVLS_ENABLE"] = "0"

import argparse  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import peak_gib, reset_peak, setup, time_fn, torchrun_header  # noqa: E402

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.distributed import sequence_parallel as sp  # noqa: E402
from dilated_attention.distributed.layout import shard_local  # noqa: E402
from dilated_attention.flops import dilated_flops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weak-per-gpu", type=int, default=262144, help="tokens per GPU (weak scaling)")
    p.add_argument("--strong-n", type=int, default=1048576, help="total tokens (strong scaling)")
    p.add_argument("--segments", type=str, default="2048,4096,8192,16384,32768")
    p.add_argument("--dilations", type=str, default="1,2,4,8,16")
    p.add_argument("--global-rows", type=int, default=2048,
                   help="add a branch w = N with r = N / global-rows (0: no global branch)")
    p.add_argument("--modes", type=str, default="full,causal", help="full and/or causal")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--exchange", choices=list(sp.EXCHANGE_MODES), default="auto")
    p.add_argument("--impl", choices=["auto", "torch", "triton"], default="auto",
                   help="impl of the sequence-parallel runs (their local blocks: torch attention "
                        "or the fused Triton kernel; see kernels.select.pick_sp_local_impl)")
    p.add_argument("--single-impl", default="auto", help="impl of the one-GPU dilated baseline")
    p.add_argument("--dense-max", type=int, default=262144, help="dense SDPA baseline up to this N")
    p.add_argument("--no-single", action="store_true", help="skip all one-GPU baselines")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke test")
    p.add_argument("--out", type=str, default=None)
    a = p.parse_args()
    if a.small:
        a.weak_per_gpu, a.strong_n, a.segments, a.dilations = 512, 1024, "64,128,256", "1,2,4"
        a.global_rows, a.heads, a.headdim, a.iters, a.warmup, a.dense_max = 64, 4, 32, 2, 1, 1024
        if a.device == "cpu" and a.dtype == "bf16":
            a.dtype = "fp32"
    return a


def branches(a, n):
    seg = [int(x) for x in a.segments.split(",")]
    dil = [int(x) for x in a.dilations.split(",")]
    if a.global_rows:
        seg.append(n)
        dil.append(max(1, n // a.global_rows))
    return seg, dil


def make(b, n, h, hkv, d, dtype, dev, seed, grad=True):
    g = torch.Generator(device=dev).manual_seed(seed)
    return tuple(
        torch.randn(b, n, hh, d, generator=g, device=dev, dtype=dtype).requires_grad_(grad)
        for hh in (h, hkv, hkv)
    )


def fwd_bwd(fn, q, k, v):
    fn(q, k, v).backward(q)  # any gradient of out's shape will do


def dense(q, k, v, causal):
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return o.transpose(1, 2)


def correctness_check(a, dev, dtype, hkv, rank, world):
    n = world * (2 * 2048 if not a.small else 256)
    seg, dil = branches(a, n)
    seg, dil = [min(w, n) for w in seg], [min(r, min(w, n)) for w, r in zip(seg, dil, strict=True)]
    res = {}
    for mode in a.modes.split(","):
        causal = mode == "causal"
        q, k, v = make(a.batch, n, a.heads, hkv, a.headdim, dtype, dev, 99)
        ref = dilated_attention(q, k, v, seg, dil, causal=causal, impl="torch")
        do = torch.randn(ref.shape, generator=torch.Generator(device=dev).manual_seed(5), device=dev, dtype=dtype)
        ref.backward(do)
        sh = partial(shard_local, world=world, rank=rank, layout="contiguous", dim=1)
        ql, kl, vl = (sh(x.detach()).requires_grad_() for x in (q, k, v))
        with sp.exchange_mode(a.exchange):
            out = dilated_attention(ql, kl, vl, seg, dil, causal=causal, group=dist.group.WORLD,
                                    impl=a.impl)
        out.backward(sh(do))
        err = max((out - sh(ref)).abs().max().item(), (ql.grad - sh(q.grad)).abs().max().item(),
                  (kl.grad - sh(k.grad)).abs().max().item(), (vl.grad - sh(v.grad)).abs().max().item())
        t = torch.tensor([err], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[mode] = float(t.item())
    if rank == 0:
        print(f"correctness of impl={a.impl!r} with group= vs single-device impl='torch' (max abs err "
              f"out/dq/dk/dv, N={n}): {res}", flush=True)
    return res


def fmt(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def run_case(a, dev, dtype, hkv, rank, world, solo, kind, n, mode):
    causal = mode == "causal"
    b, h, d = a.batch, a.heads, a.headdim
    seg, dil = branches(a, n)
    fn = partial(dilated_attention, segment_lengths=seg, dilation_rates=dil, causal=causal)
    row = dict(kind=kind, N=n, mode=mode, P=world, branches=list(zip(seg, dil, strict=True)))
    # ---- one GPU (rank 0), the others wait at the barrier
    n1 = n // world if kind == "weak" else n
    t1 = {}
    if rank == 0 and not a.no_single:
        seg1, dil1 = branches(a, n1)
        fn1 = partial(dilated_attention, segment_lengths=seg1, dilation_rates=dil1, causal=causal)
        q, k, v = make(b, n1, h, hkv, d, dtype, dev, 0)
        for name, f in (
            ("sp1", partial(fn1, group=solo, impl=a.impl)),
            ("single", partial(fn1, impl=a.single_impl)),
            ("dense", partial(dense, causal=causal)),
        ):
            if name == "dense" and n1 > a.dense_max:
                continue
            try:
                reset_peak(dev)
                t1[name + "_f"] = time_fn(partial(f, q, k, v), dev, a.warmup, a.iters)
                t1[name + "_fb"] = time_fn(partial(fwd_bwd, f, q, k, v), dev, a.warmup, a.iters)
                t1[name + "_mem"] = peak_gib(dev)
            except Exception as e:  # a baseline that cannot run is reported, not fatal
                print(f"{kind} N={n1} {mode}: one-GPU {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        q = k = v = None
    dist.barrier()
    # ---- P ranks
    reset_peak(dev)
    q, k, v = make(b, n // world, h, hkv, d, dtype, dev, 1 + rank)
    fp = partial(fn, group=dist.group.WORLD, impl=a.impl)
    with sp.exchange_mode(a.exchange) as calls:
        tf = time_fn(partial(fp, q, k, v), dev, a.warmup, a.iters, dist.group.WORLD)
        tfb = time_fn(partial(fwd_bwd, fp, q, k, v), dev, a.warmup, a.iters, dist.group.WORLD)
    st = calls.stats
    stats = torch.tensor([peak_gib(dev) or 0.0, st["fwd_bytes_sent"], st["bwd_bytes_sent"]],
                         dtype=torch.float64, device=dev)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    q = k = v = None
    flops = dilated_flops(b, n, n, h, d, seg, dil, causal)  # forward
    row.update(
        fwd_ms=tf * 1e3, fb_ms=tfb * 1e3, tflops_f=flops / world / tf / 1e12,
        tflops_fb=3.5 * flops / world / tfb / 1e12,
        mem=stats[0].item() if dev.type == "cuda" else None,
        fwd_mib=stats[1].item() / 2**20, bwd_mib=stats[2].item() / 2**20,
        modes=sorted({x["mode"] for x in st["branches"]}),
        local=sorted({x.get("local_impl", "torch") for x in st["branches"]}),
    )
    scale = 1 if kind == "weak" else world
    for key in ("sp1", "single", "dense"):
        for ph in ("f", "fb"):
            v_ = t1.get(f"{key}_{ph}")
            row[f"{key}_{ph}"] = None if v_ is None else v_ * 1e3
        row[f"{key}_mem"] = t1.get(f"{key}_mem")
    row["eff_f"] = None if "sp1_f" not in t1 else t1["sp1_f"] / (scale * tf)
    row["eff_fb"] = None if "sp1_fb" not in t1 else t1["sp1_fb"] / (scale * tfb)
    if rank == 0:
        print(f"{kind} N={n} {mode} P={world}: fwd {row['fwd_ms']:.1f} ms fwd+bwd {row['fb_ms']:.1f} ms "
              f"eff {fmt(row['eff_f'])}/{fmt(row['eff_fb'])} sent {row['fwd_mib']:.1f}/{row['bwd_mib']:.1f} MiB",
              flush=True)
    return row


def render(a, rows, errs, dev, world):
    lines = torchrun_header("dilated_attention sequence-parallel scaling", dev, world) + [
        f"- shape: batch {a.batch}, heads {a.heads} (kv {a.kv_heads or a.heads}) x {a.headdim}, {a.dtype}; "
        f"exchange {a.exchange}; warmup {a.warmup}, iters {a.iters}",
        f"- sequence-parallel impl: {a.impl!r} (column local: the kernels that ran rank 0's local "
        "blocks, torch attention and/or the fused triton kernel)",
        f"- correctness of impl={a.impl!r} with group= vs single-device torch path, max abs err: {errs}",
        "- branches (w, r): " + "; ".join(f"N={n}: {b}" for n, b in {r["N"]: r["branches"] for r in rows}.items()),
        "- t1 = the same sequence-parallel code on a one-rank group (rank 0); eff = t1 / tP (weak: "
        "N/P per GPU fixed) or t1 / (P tP) (strong); 1-GPU dilated = dilated_attention(impl="
        f"{a.single_impl!r}); dense = SDPA at the 1-GPU N; sent = bytes sent per rank (max over "
        "ranks); TFLOP/s = useful work per GPU (docs/spec.md; fwd+bwd = 3.5 x fwd)",
        "",
        "| scaling | N | mode | P | fwd ms | fwd+bwd ms | TFLOP/s/GPU fwd | TFLOP/s/GPU fwd+bwd | peak GiB/rank "
        "| sent fwd MiB | sent bwd MiB | t1 fwd ms | t1 fwd+bwd ms | eff fwd | eff fwd+bwd "
        "| 1-GPU dilated fwd/fwd+bwd ms | dense fwd/fwd+bwd ms | exchange | local |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['N']} | {r['mode']} | {r['P']} | {r['fwd_ms']:.2f} | {r['fb_ms']:.2f} | "
            f"{r['tflops_f']:.3g} | {r['tflops_fb']:.3g} | {fmt(r['mem'])} | {r['fwd_mib']:.2f} | "
            f"{r['bwd_mib']:.2f} | {fmt(r['sp1_f'])} | {fmt(r['sp1_fb'])} | {fmt(r['eff_f'])} | "
            f"{fmt(r['eff_fb'])} | {fmt(r['single_f'])} / {fmt(r['single_fb'])} | "
            f"{fmt(r['dense_f'])} / {fmt(r['dense_fb'])} | {','.join(r['modes']) or 'local'} | "
            f"{','.join(r['local'])} |"
        )
    return "\n".join(lines) + "\n"


def main():
    a = parse_args()
    dev = setup(a.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[a.dtype]
    hkv = a.kv_heads or a.heads
    solo = dist.new_group([0])  # collective: every rank creates it; only rank 0 uses it
    errs = correctness_check(a, dev, dtype, hkv, rank, world)
    rows = []
    for kind, n in (("weak", a.weak_per_gpu * world), ("strong", a.strong_n)):
        if n % world:
            if rank == 0:
                print(f"skip {kind}: N={n} not divisible by P={world}")
            continue
        for mode in a.modes.split(","):
            rows.append(run_case(a, dev, dtype, hkv, rank, world, solo, kind, n, mode))
    if rank == 0:
        report = render(a, rows, errs, dev, world)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                f.write(report)
            print(f"wrote {a.out}", flush=True)
        print(report, flush=True)  # the table is the last thing printed
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
