"""Host cost of a packed (varlen) training step vs an unpacked one, on the CPU, stand-in launches.

The real call path of ``benchmarks/train_stdlib_bytes.py``'s training step (``LongNetLM``
forward with the loss, backward; ``--pack``: ``StdlibBytes.packed_batch`` offsets, each source
file of a crop its own document, through ``dilated_attention_varlen`` -> the fused launches)
with the kernels replaced by no-ops as in ``host_cost_cpu.py`` (CPU tensors count as CUDA
device 0, launchers do nothing). The geometry is the ``h100-32k`` preset's (4 layers, causal,
4 branches r = 1, 2, 4, 8 with w = N/32 .. N, 8 heads) scaled down so that the CPU's own work
(the model's matmuls, real here) stays small: N = 2048, batch 4, width 64 (head dim 8 -> 16).

Per step it counts what carries over to a GPU's host:

- plan builds (``triton_launch.TrainPlan`` constructions) and the plans table's size;
- launches through Triton's slow path (``kernel[grid](...)``: on an H100 ~100+ us each, here a
  no-op) and through a plan's kept launcher;
- CTAs launched (the grids' sizes: programs past a document's end return at once on a GPU,
  but are scheduled);
- host syncs on a GPU: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``), ``aten.nonzero``
  / ``masked_select`` (data-dependent shapes), ``Tensor.tolist``;

and times the median host time per step (forward + loss + backward; the batch is built outside
the timer; ``packed_batch`` vs ``batch`` is timed on its own).

    PYTHONPATH=src python benchmarks/host_cost_packed_cpu.py [--steps 40] [--no-plans] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cost_cpu  # noqa: E402  (sets the malloc knobs when run as a script: see there)

if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in host_cost_cpu._MALLOC.items()):
    os.environ.update(host_cost_cpu._MALLOC)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _Counts(TorchDispatchMode):
    """Counts the aten ops that synchronise a CUDA host with its device (``Tensor.tolist`` is
    counted apart: on the CPU it dispatches nothing)."""

    SYNC = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive")

    def __init__(self):
        super().__init__()
        self.syncs: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNC:
            self.syncs[name] = self.syncs.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _instrument():
    """Counters on plan builds, slow-path launches, direct launches and CTAs."""
    from dilated_attention.kernels import direct_launch, triton_launch

    host_cost_cpu.install_stand_ins()
    c = {"plans": 0, "slow": 0, "direct": 0, "ctas": 0, "tolist": 0}
    real_init = triton_launch.TrainPlan.__init__

    def init(self, *a, **kw):
        c["plans"] += 1
        real_init(self, *a, **kw)

    triton_launch.TrainPlan.__init__ = init

    def slow_call(self, *args, **kw):  # _NoKernel[grid](...): Triton's JITFunction.run on a GPU
        c["slow"] += 1
        return host_cost_cpu._COMPILED

    def getitem(self, grid):
        def call(*args, **kw):
            c["ctas"] += grid[0] * (grid[1] if len(grid) > 1 else 1)
            return slow_call(self, *args, **kw)

        return call

    host_cost_cpu._NoKernel.__getitem__ = getitem

    def launcher(compiled, grid):
        n = grid[0] * (grid[1] if len(grid) > 1 else 1)

        def go(stream, args):
            c["direct"] += 1
            c["ctas"] += n

        return go

    direct_launch.launcher = launcher
    if hasattr(direct_launch, "grid_launcher"):  # per-call grids (packed plans)

        def grid_launcher(compiled):
            def go(gx, gy, gz, stream, args):
                c["direct"] += 1
                c["ctas"] += gx * gy * gz

            return go

        direct_launch.grid_launcher = grid_launcher
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        c["tolist"] += 1
        return real_tolist(self)

    torch.Tensor.tolist = tolist
    return c


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-plans", action="store_true", help="triton_launch.USE_PLANS = False")
    p.add_argument("--profile", action="store_true", help="cProfile the packed steps, top 25")
    p.add_argument("--docs-from", type=int, default=32768,
                   help="take each step's documents from packed_batch at this N, offsets scaled to "
                        "--n (the h100-32k preset's document counts; 0: packed_batch at --n)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast as the GPU run (the CPU's "
                   "bf16 matmuls then dominate the step)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    c = _instrument()
    from dilated_attention.data import StdlibBytes
    from dilated_attention.kernels import triton_launch
    from dilated_attention.models.longnet import LongNetConfig, LongNetLM

    if args.no_plans:
        triton_launch.USE_PLANS = False
    n = args.n
    cfg = LongNetConfig(vocab_size=256, dim=args.dim, n_layer=4, n_head=4, ffn_dim=2 * args.dim,
                        segment_lengths=(n // 32, n // 8, n // 2, n), dilation_rates=(1, 2, 4, 8),
                        max_seq_len=n, impl="triton")  # fmt: skip
    torch.manual_seed(0)
    model = LongNetLM(cfg)
    data = StdlibBytes(seq_len=n)
    big = StdlibBytes(seq_len=args.docs_from) if args.docs_from else None

    def batches(packed: bool, step: int):
        if packed:
            x, y, cu, mx = data.packed_batch(args.batch, 0, step)
            if big is not None:  # the documents of an N = docs_from crop, scaled to n
                cu_big = big.packed_batch(args.batch, 0, step)[2].tolist()
                cu = torch.tensor(sorted({b * n // args.docs_from for b in cu_big}), dtype=torch.int32)
                mx = int((cu[1:] - cu[:-1]).max())
            return x, y, {"cu_seqlens": cu, "max_seqlen": mx}
        x, y = data.batch(args.batch, 0, step)
        return x, y, {}

    def step_fn(x, y, kw):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            _, loss = model(x, y, return_logits=False, **kw)
        loss.backward()
        model.zero_grad(set_to_none=True)

    print(f"LongNetLM 4 layers x 4 heads (head dim {args.dim // 4}), N = {n}, batch {args.batch}, "
          f"branches w {cfg.segment_lengths} r {cfg.dilation_rates}, causal, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, documents "
          f"{f'of N = {args.docs_from} crops scaled' if args.docs_from else 'of N crops'}, "
          f"impl=triton with stand-in launches, 1 thread, training plans "
          f"{'off' if args.no_plans else 'on'}")  # fmt: skip
    for packed in (False, True):
        for s in range(args.warmup):  # the first steps: compile-free here, but plans get built
            step_fn(*batches(packed, 10_000 + s))
        ts, docs, mxs = [], [], []
        tot = dict.fromkeys(c, 0)
        syncs: dict[str, int] = {}
        prof = cProfile.Profile() if args.profile and packed else None
        before_plans = len(triton_launch._PLANS)
        for s in range(args.steps):
            x, y, kw = batches(packed, s)
            if packed:
                docs.append(kw["cu_seqlens"].numel() - 1)
                mxs.append(kw["max_seqlen"])
            c0 = dict(c)
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            step_fn(x, y, kw)
            if prof:
                prof.disable()
            ts.append(time.perf_counter() - t0)
            for key in c:
                tot[key] += c[key] - c0[key]
        nsync = 5  # syncs: a few more steps under the counting mode (it slows the host down)
        tolist = 0
        for s in range(nsync):
            x, y, kw = batches(packed, 20_000 + s)
            t0 = c["tolist"]
            with _Counts() as sc:
                step_fn(x, y, kw)
            for key, v in sc.syncs.items():
                syncs[key] = syncs.get(key, 0) + v / nsync
            tolist += (c["tolist"] - t0) / nsync
        k = args.steps
        what = "packed  " if packed else "unpacked"
        extra = (f"; documents per step {min(docs)}..{max(docs)}, max_seqlen {min(mxs)}..{max(mxs)}"
                 if packed else "")  # fmt: skip
        print(f"  {what}: median host time per step {statistics.median(ts) * 1e3:7.2f} ms; per step: "
              f"plan builds {tot['plans'] / k:.2f}, slow-path launches {tot['slow'] / k:.1f}, "
              f"direct launches {tot['direct'] / k:.1f}, CTAs {tot['ctas'] / k:,.0f}, syncs "
              f"{syncs} + tolist {tolist:.1f}; "
              f"plans kept {before_plans} -> {len(triton_launch._PLANS)}{extra}")  # fmt: skip
        if prof:
            for key in ("tottime", "cumtime"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(25)
                print(f"\n===== packed steps, top 25 by {key}\n{out.getvalue()}")
    # the attention calls alone (what differs between the two steps): per step, n_layer
    # forward + backward calls of the fused path on (B, N) rows or on one packed (1, B*N) row
    # packed: triton_ops' entry, which dilated_attention_varlen calls after its checks when the
    # offsets are on the device (CPU offsets, as here, are read and checked there by design)
    from dilated_attention import dilated_attention
    from dilated_attention.kernels.triton_ops import dilated_attention_triton_varlen

    h, d = cfg.n_head, cfg.dim // cfg.n_head
    seg, dil = cfg.segment_lengths, cfg.dilation_rates
    triton_launch._PLANS.clear()  # the LM steps above built plans for these very batches
    for packed in (False, True):
        shape = (1, args.batch * n, h, d) if packed else (args.batch, n, h, d)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        do = torch.randn(shape)

        def attn_step(kw, q=q, k=k, v=v, do=do, packed=packed):
            for _ in range(cfg.n_layer):
                if packed:
                    cu, mx = kw["cu_seqlens"], kw["max_seqlen"]
                    out = dilated_attention_triton_varlen(
                        q[0], k[0], v[0], cu, cu, mx, mx, seg, dil, causal=True, scale=d**-0.5,
                        head_assignment="all")[0][None]  # fmt: skip
                else:
                    out = dilated_attention(q, k, v, seg, dil, causal=True, impl="triton")
                torch.autograd.grad(out, (q, k, v), do)

        for s in range(args.warmup):
            attn_step(batches(packed, 10_000 + s)[2])
        ts = []
        c0 = dict(c)
        prof = cProfile.Profile() if args.profile and packed else None
        for s in range(args.steps):
            kw = batches(packed, s)[2]
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            attn_step(kw)
            if prof:
                prof.disable()
            ts.append(time.perf_counter() - t0)
        k_ = args.steps
        print(f"  attention only, {cfg.n_layer} x (fwd + bwd) {'packed  ' if packed else 'unpacked'}: "
              f"median host time per step {statistics.median(ts) * 1e3:6.2f} ms; per step: plan "
              f"builds {(c['plans'] - c0['plans']) / k_:.2f}, slow-path launches "
              f"{(c['slow'] - c0['slow']) / k_:.1f}, direct launches {(c['direct'] - c0['direct']) / k_:.1f}, "
              f"CTAs {(c['ctas'] - c0['ctas']) / k_:,.0f}; plans kept {len(triton_launch._PLANS)}")  # fmt: skip
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            print(f"\n===== packed attention calls, top 25 by tottime\n{out.getvalue()}")
    tb, tp = [], []
    for s in range(args.steps):
        t0 = time.perf_counter()
        data.batch(args.batch, 0, s)
        tb.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        data.packed_batch(args.batch, 0, s)
        tp.append(time.perf_counter() - t0)
    print(f"  batch building (outside the step timer): batch {statistics.median(tb) * 1e3:.2f} ms, "
          f"packed_batch {statistics.median(tp) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
