"""Ring attention benchmark: strong scaling and per-rank memory of exact sequence-sharded attention.

Run with torchrun, one process per GPU, e.g. on 2 GPUs (NVLink SHARP stays off):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src torchrun --nproc_per_node=2 benchmarks/bench_ring.py \
        --out benchmarks/results/ring_memory_h200x2.md

For every total length N and mode (non-causal contiguous, causal zigzag) it measures, on the P
ranks of the run, the forward and forward+backward time of ``ring_attention`` (max over ranks) and
the per-rank peak memory; on rank 0 alone (the other ranks wait at a barrier) dense
``scaled_dot_product_attention`` over the whole N on one GPU; and, in the same run, PyTorch's
``torch.distributed.tensor.experimental.context_parallel`` (SDPA on per-rank shards of N/P inside
the context, for each ``--cp-rotate`` method; its own load balancing when causal; skipped with
the reason recorded where it does not run, e.g. on CPU, which has no CP sharding rule for SDPA).
Memory target per rank: ``1.1 * one-GPU peak / P + one K/V block`` (column "target GiB"). Strong-scaling efficiency is
``t1(N) / (P * tP(N))`` with t1 the one-GPU SDPA time (1.0 = perfect). TFLOP/s count useful work:
``4 * N^2 * H * D`` for the forward (halved when causal), x3.5 for forward+backward (docs/spec.md, "Measuring speed").
A small correctness check against SDPA runs first. The markdown table is printed last and written
to ``--out`` with the command, GPU, versions, date and NCCL environment.

Expected run time on 2 x H200 with the defaults (128K, 256K, 512K; 2 modes; ring, one GPU and
2 CP rotate methods): about 5-7 minutes, about 4 of them at N = 512K (estimated from earlier ring
and one-GPU timings; context_parallel not yet timed there). To stay well under a 10-minute
limit run ``--sizes 131072,262144`` and ``--sizes 524288`` as two commands.

CPU smoke test (gloo): ``torchrun --nproc_per_node=2 benchmarks/bench_ring.py --device cpu --small``
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

from dilated_attention.distributed import ring_attention, shard_sequence  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = {  # name -> (causal, layout)
    "full": (False, "contiguous"),
    "causal-zigzag": (True, "zigzag"),
    "causal-contig": (True, "contiguous"),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=str, default=None,
                   help="comma-separated total sequence lengths N (default 65536,...,524288)")
    p.add_argument("--modes", type=str, default="full,causal-zigzag", help=f"from {list(MODES)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: = heads)")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke test")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU SDPA baseline")
    p.add_argument("--cp-rotate", type=str, default="allgather,alltoall",
                   help="context_parallel rotate methods to compare ('' skips context_parallel)")
    p.add_argument("--out", type=str, default=None, help="write the markdown report here")
    a = p.parse_args()
    if a.small:
        a.sizes, a.heads, a.headdim, a.iters, a.warmup = a.sizes or "512,1024", 2, 32, 2, 1
        if a.device == "cpu" and a.dtype == "bf16":
            a.dtype = "fp32"
    a.sizes = a.sizes or "131072,262144,524288"
    return a


def make_inputs(b, n, h, hkv, d, dtype, dev, seed, grad):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g, device=dev, dtype=dtype).requires_grad_(grad)
    k = torch.randn(b, n, hkv, d, generator=g, device=dev, dtype=dtype).requires_grad_(grad)
    v = torch.randn(b, n, hkv, d, generator=g, device=dev, dtype=dtype).requires_grad_(grad)
    return q, k, v


def sdpa(q, k, v, causal):
    # (B, N, H, D) -> SDPA layout; GQA through enable_gqa
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return o.transpose(1, 2)


def fwd_bwd(fn, q, k, v, *args):
    fn(q, k, v, *args).backward(q)  # any gradient of out's shape will do: q's values


def correctness_check(a, dev, dtype, hkv, rank):
    """ring_attention vs one-device SDPA on the same global tensors (small N, every rank)."""
    world = dist.get_world_size()
    n = 2 * world * 256 if not a.small else 2 * world * 16
    errs = {}
    for mode in a.modes.split(","):
        causal, layout = MODES[mode]
        q, k, v = make_inputs(a.batch, n, a.heads, hkv, a.headdim, dtype, dev, 1234, True)
        ref = sdpa(q, k, v, causal)
        qs, ks, vs = (shard_sequence(x.detach(), layout=layout).requires_grad_() for x in (q, k, v))
        out = ring_attention(qs, ks, vs, causal=causal, layout=layout)
        do = torch.randn(ref.shape, generator=torch.Generator(device=dev).manual_seed(7), device=dev,
                         dtype=dtype)  # identical on every rank
        out.backward(shard_sequence(do, layout=layout))
        ref.backward(do)
        e = [
            (out - shard_sequence(ref, layout=layout)).abs().max().item(),
            (qs.grad - shard_sequence(q.grad, layout=layout)).abs().max().item(),
            (ks.grad - shard_sequence(k.grad, layout=layout)).abs().max().item(),
        ]
        errs[mode] = max(e)
    t = torch.tensor(list(errs.values()), dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res = dict(zip(errs, t.tolist(), strict=True))
    if rank == 0:
        print(f"correctness vs SDPA (max abs error of out, dq, dk; N={n}): {res}", flush=True)
    return res


def run_context_parallel(a, dev, dtype, hkv, n, causal, rotate, world):
    """PyTorch's context parallelism on this run's shapes: (fwd s, fwd+bwd s, per-rank peak GiB)
    or an error string. SDPA on per-rank (B, H, N/P, D) shards inside ``context_parallel`` (the
    inputs are random, so only the shapes and the work per rank matter)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError as e:
        return f"not available: {e}"
    try:
        set_rotate_method(rotate)
        mesh = init_device_mesh(dev.type, (world,))
        reset_peak(dev)
        b, h, d = a.batch, a.heads, a.headdim
        g = torch.Generator(device=dev).manual_seed(3 + dist.get_rank())
        q, k, v = (torch.randn(b, hh, n // world, d, generator=g, device=dev, dtype=dtype).requires_grad_()
                   for hh in (h, hkv, hkv))

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h)

        def fb():
            fwd().backward(q)

        # the inputs are made per rank already; a (1, 1, N, 1) buffer tells the context the
        # global length (which sets its load balancing) and is sharded in their place
        seq = torch.zeros(1, 1, n, 1, device=dev)
        with context_parallel(mesh, buffers=[seq], buffer_seq_dims=[2], no_restore_buffers={seq}):
            tf = time_fn(fwd, dev, a.warmup, a.iters, dist.group.WORLD)
            tfb = time_fn(fb, dev, a.warmup, a.iters, dist.group.WORLD)
        mem = peak_gib(dev)
        m = torch.tensor([mem or 0.0], dtype=torch.float64, device=dev)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return tf, tfb, (m.item() if dev.type == "cuda" else None)
    except Exception as e:  # noqa: BLE001 - recorded in the report: the comparison is optional
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return msg


def fmt(x, spec="{:.1f}"):
    return "-" if x is None else spec.format(x)


def main():
    a = parse_args()
    dev = setup(a.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[a.dtype]
    hkv = a.kv_heads or a.heads
    b, h, d = a.batch, a.heads, a.headdim
    world_group = dist.group.WORLD
    errs = correctness_check(a, dev, dtype, hkv, rank)
    rows = []
    for n in [int(s) for s in a.sizes.split(",")]:
        for mode in a.modes.split(","):
            causal, layout = MODES[mode]
            flops_fwd = 4.0 * b * h * d * n * n / (2 if causal else 1)
            # ---- one GPU, rank 0 only; the other ranks wait at the barrier
            t1f = t1fb = mem1 = None
            if rank == 0 and not a.no_single:
                try:
                    reset_peak(dev)
                    q, k, v = make_inputs(b, n, h, hkv, d, dtype, dev, 0, True)
                    t1f = time_fn(partial(sdpa, q, k, v, causal), dev, a.warmup, a.iters)
                    t1fb = time_fn(partial(fwd_bwd, sdpa, q, k, v, causal), dev, a.warmup, a.iters)
                    mem1 = peak_gib(dev)
                except torch.OutOfMemoryError:
                    t1f = t1fb = mem1 = None
                    print(f"N={n} {mode}: one-GPU SDPA out of memory", flush=True)
                q = k = v = None
            dist.barrier()
            # ---- P ranks, ring attention on shards of N/P
            reset_peak(dev)
            q, k, v = make_inputs(b, n // world, h, hkv, d, dtype, dev, 1 + rank, True)
            fwd = partial(ring_attention, causal=causal, layout=layout)
            tpf = time_fn(partial(fwd, q, k, v), dev, a.warmup, a.iters, world_group)
            tpfb = time_fn(partial(fwd_bwd, fwd, q, k, v), dev, a.warmup, a.iters, world_group)
            memp = peak_gib(dev)
            mem_t = torch.tensor([memp or 0.0], dtype=torch.float64, device=dev)
            dist.all_reduce(mem_t, op=dist.ReduceOp.MAX)
            q = k = v = None
            kv_gib = 2 * b * (n // world) * hkv * d * torch.finfo(dtype).bits / 8 / 2**30
            cp = {}
            for rot in [r for r in a.cp_rotate.split(",") if r]:
                cp[rot] = run_context_parallel(a, dev, dtype, hkv, n, causal, rot, world)
            row = dict(
                N=n, mode=mode, P=world, fwd_ms=tpf * 1e3, fb_ms=tpfb * 1e3,
                tflops_fwd=flops_fwd / (world * tpf) / 1e12,
                tflops_fb=3.5 * flops_fwd / (world * tpfb) / 1e12,
                mem=(mem_t.item() if dev.type == "cuda" else None),
                t1f=None if t1f is None else t1f * 1e3, t1fb=None if t1fb is None else t1fb * 1e3,
                mem1=mem1,
                eff_f=None if t1f is None else t1f / (world * tpf),
                eff_fb=None if t1fb is None else t1fb / (world * tpfb),
                target=None if mem1 is None else 1.1 * mem1 / world + kv_gib, cp=cp,
            )
            rows.append(row)
            if rank == 0:
                print(
                    f"N={n:>8} {mode:<14} P={world} fwd {row['fwd_ms']:.2f} ms  fwd+bwd "
                    f"{row['fb_ms']:.2f} ms  eff fwd {fmt(row['eff_f'], '{:.2f}')} fwd+bwd "
                    f"{fmt(row['eff_fb'], '{:.2f}')}", flush=True,
                )
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


def render(a, rows, errs, dev, world) -> str:
    lines = torchrun_header("ring_attention strong scaling", dev, world) + [
        f"- shape: batch {a.batch}, heads {a.heads} (kv {a.kv_heads or a.heads}) x {a.headdim}, {a.dtype}; "
        f"warmup {a.warmup}, iters {a.iters}",
        f"- correctness vs SDPA, max abs error of out/dq/dk: {errs}",
        "- t1 = dense SDPA over the whole N on one GPU (rank 0); eff = t1 / (P * tP); TFLOP/s are "
        "useful work per GPU (causal halves it; fwd+bwd = 3.5 x fwd); mem = per-rank peak allocated",
        "",
        "| N | mode | P | ring fwd ms | ring fwd+bwd ms | TFLOP/s/GPU fwd | TFLOP/s/GPU fwd+bwd "
        "| peak GiB/rank | target GiB | 1-GPU fwd ms | 1-GPU fwd+bwd ms | 1-GPU peak GiB | eff fwd "
        "| eff fwd+bwd |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['N']} | {r['mode']} | {r['P']} | {r['fwd_ms']:.2f} | {r['fb_ms']:.2f} | "
            f"{r['tflops_fwd']:.3g} | {r['tflops_fb']:.3g} | {fmt(r['mem'], '{:.2f}')} | "
            f"{fmt(r['target'], '{:.2f}')} | "
            f"{fmt(r['t1f'], '{:.2f}')} | {fmt(r['t1fb'], '{:.2f}')} | {fmt(r['mem1'], '{:.2f}')} | "
            f"{fmt(r['eff_f'], '{:.2f}')} | {fmt(r['eff_fb'], '{:.2f}')} |"
        )
    cp_rows = [(r, rot, res) for r in rows for rot, res in r["cp"].items()]
    if cp_rows:
        lines += [
            "",
            "context_parallel (torch.distributed.tensor.experimental) on the same shapes; eff "
            "against the same one-GPU SDPA:",
            "",
            "| N | mode | P | rotate | CP fwd ms | CP fwd+bwd ms | CP peak GiB/rank | eff fwd | "
            "eff fwd+bwd | ring / CP fwd+bwd time |",
            "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r, rot, res in cp_rows:
            if isinstance(res, str):
                lines.append(f"| {r['N']} | {r['mode']} | {r['P']} | {rot} | not run: {res} | | | | | |")
                continue
            tf, tfb, mem = res
            ef = None if r["t1f"] is None else r["t1f"] / 1e3 / (world * tf)
            efb = None if r["t1fb"] is None else r["t1fb"] / 1e3 / (world * tfb)
            lines.append(
                f"| {r['N']} | {r['mode']} | {r['P']} | {rot} | {tf * 1e3:.2f} | {tfb * 1e3:.2f} | "
                f"{fmt(mem, '{:.2f}')} | {fmt(ef, '{:.2f}')} | {fmt(efb, '{:.2f}')} | "
                f"{r['fb_ms'] / (tfb * 1e3):.2f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
