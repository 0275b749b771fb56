"""Correctness of ring attention and sequence-parallel dilated attention at P = 2..8 on CPU gloo.

Every P in ``--world`` gets one spawn of P real processes (gloo, ``file://`` rendezvous in a temp
dir; ``tests/dist_utils.run_distributed``). Each rank draws the same global
float64 tensors, runs its shard through

* ``ring_attention`` (layouts contiguous and zigzag, causal and not, GQA), compared with dense
  attention over the global tensors, and
* ``dilated_attention(..., group=...)`` (branches that stay inside a shard, span 2 ranks, span all
  ranks, w > N, w % r != 0, a LongNet-like mix; causal and not), compared with
  ``impl="reference"`` on the global tensors,

and records the max abs error of out, dq, dk, dv (max over ranks), bytes sent per rank
(``exchange_mode``'s ``calls.stats`` / ``ring_attention(stats=)``, max and min over ranks) and the ring's peak bytes in
flight. A last case keeps w/r and N/P fixed (``--traffic-l`` tokens per rank) so that N grows
with P: bytes sent per rank should not change with P.

    python benchmarks/check_gloo_scaling.py --world 2 4 8 --out benchmarks/results/x.md

Exit status 1 if any error exceeds ``--atol`` (float64) or a traffic expectation fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from dist_utils import run_distributed  # noqa: E402  (the tests' spawner: forkserver + file://)

sys.path.insert(0, HERE)
from common import results_header  # noqa: E402


def _inputs(seed, b, n, h, hkv, d):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _dense(q, k, v, causal):
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    s = qt @ kt.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vt).transpose(1, 2)


def _errors(ref_fn, dist_fn, q, k, v, do, shard):
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    ref = ref_fn(qg, kg, vg)
    ref_grads = torch.autograd.grad(ref, (qg, kg, vg), do)
    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    out = dist_fn(ql, kl, vl)
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(do))
    errs = [(out - shard(ref)).abs().max().item()]
    errs += [(g - shard(w)).abs().max().item() for g, w in zip(grads, ref_grads, strict=True)]
    return errs  # out, dq, dk, dv


def _sp_cases(L, n):
    return [
        ("local (w = N/P)", (L,), (1,)),
        ("local dilated", (L // 2, L), (2, 3)),
        ("span 2 ranks", (2 * L,), (2,)),
        ("span all ranks", (n,), (3,)),
        ("w > N", (2 * n + 3,), (4,)),
        ("w % r != 0", (7, 2 * L + 3), (2, 4)),
        ("LongNet mix", (L // 2, L, 2 * L, n), (1, 2, 4, 8)),
    ]


def _worker(rank, world, cfg, out_file):
    from dilated_attention import dilated_attention
    from dilated_attention.distributed import ring_attention
    from dilated_attention.distributed import sequence_parallel as sp
    from dilated_attention.distributed.layout import shard_local

    b, h, hkv, d, n = cfg["b"], cfg["h"], cfg["hkv"], cfg["d"], cfg["n"]
    L = n // world
    grp = dist.group.WORLD
    rows = []
    seed = 0
    t0 = time.perf_counter()
    # ---------------------------------------------------------------- ring attention
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            seed += 1
            q, k, v, do = _inputs(seed, b, n, h, hkv, d)
            st = {}
            errs = _errors(lambda q_, k_, v_, c=causal: _dense(q_, k_, v_, c),
                           lambda q_, k_, v_, c=causal, lay=layout: ring_attention(
                               q_, k_, v_, group=grp, causal=c, layout=lay, stats=st),
                           q, k, v, do, lambda x, lay=layout: shard_local(x, world, rank, lay, 1))
            rows.append(dict(kind="ring", case=layout, causal=causal, n=n, errs=errs,
                             fwd=st["fwd_bytes_sent"], bwd=st["bwd_bytes_sent"],
                             peak=st["fwd_peak_ring_bytes"], bpeak=st["bwd_peak_ring_bytes"],
                             block=st["kv_block_bytes"]))
    # ---------------------------------------------------------------- sequence-parallel dilated
    def shard_c(x):
        return shard_local(x, world, rank, "contiguous", 1)

    def sp_case(name, seg, dil, causal, nn, ll, seed_):
        q, k, v, do = _inputs(seed_, b, nn, h, hkv, d)
        with sp.exchange_mode() as calls:
            errs = _errors(lambda q_, k_, v_: dilated_attention(q_, k_, v_, seg, dil, causal=causal, impl="reference"),
                           lambda q_, k_, v_: dilated_attention(q_, k_, v_, seg, dil, causal=causal, group=grp),
                           q, k, v, do, lambda x: shard_local(x, world, rank, "contiguous", 1))
        st = calls.stats
        return dict(kind="sp", case=f"{name}: w={list(seg)} r={list(dil)}", causal=causal, n=nn, errs=errs,
                    fwd=st["fwd_bytes_sent"], bwd=st["bwd_bytes_sent"], peak=None, bpeak=None, block=None)

    for causal in (False, True):
        for name, seg, dil in _sp_cases(L, n):
            seed += 1
            rows.append(sp_case(name, seg, dil, causal, n, L, seed))
    # fixed w/r and N/P: N grows with P
    lt = cfg["traffic_l"]
    seg, dil = (lt // 2, lt, 2 * lt), (1, 2, 4)
    for causal in (False, True):
        r = sp_case("fixed w/r, N/P", seg, dil, causal, lt * world, lt, 1000)
        r["kind"] = "sp-traffic"
        rows.append(r)
    secs = time.perf_counter() - t0

    # reduce over ranks: max of errors, max and min of bytes
    vals = torch.tensor([x for row in rows for x in (*row["errs"], row["fwd"], row["bwd"])], dtype=torch.float64)
    mx, mn = vals.clone(), -vals.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    dist.all_reduce(mn, op=dist.ReduceOp.MAX)
    mn = -mn
    pk = torch.tensor([float(row[key] or 0) for row in rows for key in ("peak", "bpeak")], dtype=torch.float64)
    dist.all_reduce(pk, op=dist.ReduceOp.MAX)
    if rank == 0:
        for i, row in enumerate(rows):
            base = i * 6
            row["errs"] = mx[base:base + 4].tolist()
            row["fwd"], row["bwd"] = int(mx[base + 4]), int(mx[base + 5])
            row["fwd_min"], row["bwd_min"] = int(mn[base + 4]), int(mn[base + 5])
            if row["peak"] is not None:
                row["peak"], row["bpeak"] = int(pk[2 * i]), int(pk[2 * i + 1])
        with open(out_file, "w") as f:
            json.dump(dict(world=world, secs_rank0=secs, rows=rows), f)


def _fmt_b(x):
    return f"{x:,}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8], help="process counts P")
    ap.add_argument("--n", type=int, default=384, help="global tokens (rounded down to a multiple of 2P)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--headdim", type=int, default=16)
    ap.add_argument("--traffic-l", type=int, default=32, help="tokens per rank in the fixed-w/r traffic case")
    ap.add_argument("--atol", type=float, default=1e-10)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    a = ap.parse_args()

    results = []
    for world in a.world:
        n = a.n // (2 * world) * (2 * world)
        cfg = dict(b=a.batch, h=a.heads, hkv=a.kv_heads, d=a.headdim, n=n, traffic_l=a.traffic_l)
        with tempfile.TemporaryDirectory() as tmp:
            f = os.path.join(tmp, "res.json")
            t = time.perf_counter()
            run_distributed(_worker, world, cfg, f)
            wall = time.perf_counter() - t
            with open(f) as fh:
                res = json.load(fh)
        res["wall"] = wall
        results.append(res)
        print(f"P={world}: N={n} done in {wall:.1f} s (rank 0 compute {res['secs_rank0']:.1f} s)", flush=True)

    failures = []
    lines = ["| P | N | kind | case | causal | err out | err dq | err dk | err dv | bytes sent/rank fwd (min..max) "
             "| bwd (min..max) | ring peak in flight fwd / bwd (K/V blocks) | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        P = res["world"]
        for row in res["rows"]:
            ok = max(row["errs"]) <= a.atol
            if row["case"].startswith("local (") and row["fwd"] + row["bwd"] != 0:
                ok = False
                failures.append(f"P={P} {row['case']} causal={row['causal']}: local branch sent bytes")
            if not ok and max(row["errs"]) > a.atol:
                failures.append(f"P={P} {row['kind']} {row['case']} causal={row['causal']}: "
                                f"max err {max(row['errs']):.3g} > {a.atol}")
            peak = "" if row["peak"] is None else (f"{row['peak'] / row['block']:g} / {row['bpeak'] / row['block']:g}"
                                                   f" (block {_fmt_b(row['block'])} B)")
            rng = lambda lo, hi: _fmt_b(hi) if lo == hi else f"{_fmt_b(lo)}..{_fmt_b(hi)}"  # noqa: E731
            e = [f"{x:.1e}" for x in row["errs"]]
            lines.append(f"| {P} | {row['n']} | {row['kind']} | {row['case']} | {row['causal']} | "
                         f"{' | '.join(e)} | {rng(row['fwd_min'], row['fwd'])} | {rng(row['bwd_min'], row['bwd'])} | "
                         f"{peak} | {'yes' if ok else '**NO**'} |")
    # traffic: bytes per rank at fixed w/r and N/P must not depend on P (P >= 2 compared)
    traffic = ["", f"Fixed w/r and N/P = {a.traffic_l} (segments {[a.traffic_l // 2, a.traffic_l, 2 * a.traffic_l]}, "
               "dilations [1, 2, 4]): max bytes sent per rank as N and P grow together",
               "", "| P | N | causal | fwd bytes/rank (max) | bwd bytes/rank (max) |", "|---|---|---|---|---|"]
    for causal in (False, True):
        tr = {res["world"]: next(r for r in res["rows"] if r["kind"] == "sp-traffic" and r["causal"] == causal)
              for res in results}
        for P, r in sorted(tr.items()):
            traffic.append(f"| {P} | {r['n']} | {causal} | {_fmt_b(r['fwd'])} | {_fmt_b(r['bwd'])} |")
        by_p = {P: (r["fwd"], r["bwd"]) for P, r in tr.items()}
        if len(set(by_p.values())) > 1:
            failures.append(f"max bytes/rank at fixed w/r and N/P differ across P (causal={causal}): {by_p}")
    times = ["", "| P | wall s (spawn + all cases) |", "|---|---|"] + [
        f"| {res['world']} | {res['wall']:.1f} |" for res in results]

    head = results_header(
        "Ring + sequence-parallel dilated attention on CPU gloo: correctness at P = "
        + ", ".join(str(w) for w in a.world), "cpu",
        " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:]), extra=[
        f"backend gloo, {os.cpu_count()} cores, one thread per rank, real spawned processes "
        "(forkserver, file:// rendezvous)",
        f"float64; batch {a.batch}, heads {a.heads}, kv heads {a.kv_heads}, headdim {a.headdim}; "
        f"N = {a.n} rounded down to a multiple of 2P; errors are max abs over all ranks vs. the single-process "
        f"reference (dense for ring, impl='reference' for dilated); tolerance {a.atol}",
        "bytes sent/rank: min..max over ranks; ring peak: max over ranks of received ring buffers alive at once "
        "(forward / backward, backward counts K/V and dK/dV blocks), in units of one local K/V block",
    ]) + [""]
    verdict = ["", "Result: " + ("all checks pass" if not failures else "FAILURES:\n" + "\n".join(f"- {x}" for x in failures))]
    text = "\n".join(head + lines + traffic + times + verdict) + "\n"
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
