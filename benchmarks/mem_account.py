"""Peak memory of one impl="triton" forward+backward, in units of one q-sized tensor (issue 24).

Two ways to count, one script:

- ``--device cpu`` (Triton's interpreter, tiny sizes): :class:`LiveBytes`, a dispatch mode that
  sees every tensor torch allocates (user tensors, launcher buffers, autograd's) and frees
  (weakref finalizers on the storages; ``gc.collect()`` before counting a new one: the interpreter
  keeps frames in reference cycles that would delay frees a GPU run does not delay). Prints the
  allocation timeline and the peak. ``tests/test_triton_memory.py`` uses it to hold the bound.
- ``--device cuda``: ``torch.cuda.max_memory_allocated`` around one forward+backward, each case
  in a fresh process (``--fresh``: the driver runs itself once per case), with the time of one
  more forward+backward and the ratio to q; ``--out`` writes a markdown table.

The user's side, as ``benchmarks/bench_dilated.py`` holds it (``--loss backward``): q, k, v
(leaves), the loss gradient ``do`` allocated beforehand, ``out = f(q, k, v)`` alive until
``out.backward(do)`` returns, the gradients left in ``.grad``. ``--loss sum``:
``out.sum().backward()`` (the incoming gradient is a broadcast scalar, no ``do`` tensor).

    PYTHONPATH=src TRITON_INTERPRET=1 python benchmarks/mem_account.py --device cpu --causal yes
    PYTHONPATH=src python benchmarks/mem_account.py --device cuda --n 2097152 --fresh \\
        --out $OUT/mem2m.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LONGNET = dict(segments=(2048, 4096, 8192, 16384, 32768), dilations=(1, 2, 4, 8, 16))


class LiveBytes(TorchDispatchMode):
    """Bytes of the distinct storages that ops create inside the mode and that are still alive:
    ``cur`` now, ``peak`` the maximum, ``log`` the (event, op, bytes, live after) timeline.
    Storages are keyed by data pointer, so views and in-place results count once."""

    def __init__(self, collect: bool = True):
        super().__init__()
        self.collect = collect
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0
        self.log: list[tuple[str, str, int, int]] = []

    def _free(self, ptr: int, n: int, what: str) -> None:
        if self.live.pop(ptr, None) is not None:
            self.cur -= n
            self.log.append(("free", what, n, self.cur))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or ptr in self.live:
                continue
            if self.collect:  # free what only a reference cycle still holds, before counting
                gc.collect()
            what = f"{func.__name__} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
            self.live[ptr] = n
            self.cur += n
            self.peak = max(self.peak, self.cur)
            self.log.append(("alloc", what, n, self.cur))
            weakref.finalize(st, self._free, ptr, n, what)
        return out


def make_inputs(b, n, h, hkv, d, dtype, device, loss):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, n, h, d, dtype=dtype, device=device, generator=g)
    k, v = (torch.randn(b, n, hkv, d, dtype=dtype, device=device, generator=g) for _ in range(2))
    do = torch.randn(b, n, h, d, dtype=dtype, device=device, generator=g) if loss == "backward" else None
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, do


def fwd_bwd(q, k, v, do, seg, dil, causal):
    from dilated_attention import dilated_attention

    out = dilated_attention(q, k, v, seg, dil, causal=causal, impl="triton")
    if do is None:
        out.sum().backward()
    else:
        out.backward(do)


def cpu_ledger(b, n, h, hkv, d, seg, dil, causal, loss, dtype=torch.float16, lo_min_bytes=0):
    """(peak / q bytes, timeline) of one forward+backward on the CPU (interpreter).
    ``lo_min_bytes`` replaces ``triton_launch.LO_MIN_BYTES`` for the call (0: the lo buffers
    are cut into their long-N ranges at any N, so a tiny N shows the ratio of a long one)."""
    from dilated_attention.kernels import triton_launch

    saved = getattr(triton_launch, "LO_MIN_BYTES", None)
    if saved is not None:
        triton_launch.LO_MIN_BYTES = lo_min_bytes
    try:
        return _cpu_ledger(b, n, h, hkv, d, seg, dil, causal, loss, dtype)
    finally:
        if saved is not None:
            triton_launch.LO_MIN_BYTES = saved


def _cpu_ledger(b, n, h, hkv, d, seg, dil, causal, loss, dtype):
    with LiveBytes() as m:
        q, k, v, do = make_inputs(b, n, h, hkv, d, dtype, "cpu", loss)
        fwd_bwd(q, k, v, do, seg, dil, causal)
        unit = q.numel() * q.element_size()
        peak = m.peak / unit
        log = [(e, w, nb / unit, cur / unit) for e, w, nb, cur in m.log]
        del q, k, v, do
    return peak, log


def gpu_case(n, causal, loss, h, hkv, d, seg, dil, reps) -> dict:
    dev = torch.device("cuda")
    q, k, v, do = make_inputs(1, n, h, hkv, d, torch.bfloat16, dev, loss)
    unit = q.numel() * q.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fwd_bwd(q, k, v, do, seg, dil, causal)  # the first call: compiles, and measures the peak
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    times = []
    for _ in range(reps):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd(q, k, v, do, seg, dil, causal)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(n=n, causal=causal, loss=loss, peak_gib=peak / 2**30, reserved_gib=reserved / 2**30,
                ratio=peak / unit, q_gib=unit / 2**30, first_s=first_s,
                ms=1e3 * sorted(times)[len(times) // 2] if times else None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--n", type=int, default=None, help="tokens (cuda default 2097152, cpu 512)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--headdim", type=int, default=None)
    p.add_argument("--segments", type=str, default=None, help="cuda default 2048..32768, cpu 16,32")
    p.add_argument("--dilations", type=str, default=None, help="cuda default 1..16, cpu 1,2")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--loss", choices=["backward", "sum", "both"], default="backward",
                   help="backward: out.backward(do) with a held do; sum: out.sum().backward()")
    p.add_argument("--reps", type=int, default=3, help="cuda: timed forward+backward calls")
    p.add_argument("--fresh", action="store_true", help="cuda: every case in a fresh process")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one case, for --fresh
    p.add_argument("--out", type=str, default=None)
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    n = args.n or (2097152 if gpu else 512)
    h = args.heads or (16 if gpu else 2)
    hkv = args.kv_heads or h
    d = args.headdim or (128 if gpu else 16)
    seg = tuple(int(x) for x in args.segments.split(",")) if args.segments else (LONGNET["segments"] if gpu else (16, 32))
    dil = tuple(int(x) for x in args.dilations.split(",")) if args.dilations else (LONGNET["dilations"] if gpu else (1, 2))
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    losses = ["backward", "sum"] if args.loss == "both" else [args.loss]
    if not gpu:
        for causal in causals:
            for loss in losses:
                peak, log = cpu_ledger(1, n, h, hkv, d, seg, dil, causal, loss)
                print(f"causal={causal} loss={loss}: peak {peak:.4f} x q (N={n}, H={h}/{hkv}, D={d})")
                for e, w, u, cur in log:
                    print(f"  {e:5} {u:8.4f} -> {cur:8.4f}  {w}")
        return 0
    if not torch.cuda.is_available():
        sys.exit("mem_account.py --device cuda needs a CUDA GPU")
    rows = []
    for causal in causals:
        for loss in losses:
            if args.fresh:
                cmd = [sys.executable, os.path.abspath(__file__), "--device", "cuda", "--n", str(n),
                       "--heads", str(h), "--kv-heads", str(hkv), "--headdim", str(d),
                       "--segments", ",".join(map(str, seg)), "--dilations", ",".join(map(str, dil)),
                       "--causal", "yes" if causal else "no", "--loss", loss, "--reps", str(args.reps),
                       "--json"]
                res = subprocess.run(cmd, capture_output=True, text=True)
                line = [x for x in res.stdout.splitlines() if x.startswith("{")]
                if res.returncode or not line:
                    err = (res.stderr.strip().splitlines() or ["?"])[-1]
                    r = dict(n=n, causal=causal, loss=loss, error=err[:160])
                else:
                    r = json.loads(line[-1])
            else:
                try:
                    r = gpu_case(n, causal, loss, h, hkv, d, seg, dil, args.reps)
                except torch.OutOfMemoryError as e:
                    r = dict(n=n, causal=causal, loss=loss, error=f"OOM: {str(e)[:160]}")
                torch.cuda.empty_cache()
            if args.json:
                print(json.dumps(r))
                return 0
            rows.append(r)
            print(r, flush=True)
    from dilated_attention.timing import command_line, results_header

    lines = results_header("Peak memory of one fused forward+backward (issue 24)", "cuda",
                           command_line("python3")) + [
        f"- shape: bf16, batch 1, N {n}, {h} heads ({hkv} kv) x {d}; branches w={list(seg)}, r={list(dil)}",
        "- peak = torch.cuda.max_memory_allocated over the first forward+backward (fresh process "
        "per row: " + ("yes" if args.fresh else "no") + "); ratio = peak / bytes of q; "
        "loss backward = out.backward(do) with do held, sum = out.sum().backward()",
        "",
        "| N | causal | loss | peak GiB | ratio to q | max reserved GiB | fwd+bwd ms (median) | first call s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | {r['causal']} | {r['loss']} | {r['error']} | | | | |")
        else:
            ms = f"{r['ms']:.1f}" if r["ms"] is not None else "-"
            lines.append(f"| {r['n']} | {r['causal']} | {r['loss']} | {r['peak_gib']:.2f} | "
                         f"{r['ratio']:.3f} | {r['reserved_gib']:.2f} | {ms} | {r['first_s']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
