"""Accuracy of a saved retrieval model by where the planted value sits in its first-branch segment.

The 128K evals of 2026-11-26 missed, again and again, the sequences whose value sat in the last
~32 tokens of its 1024-token segment (docs/training.md, "128K: seeds 1 and 2"). This asks the
question with fresh sequences: distances drawn from a bucket (lo, hi], split into those whose
value lands in the last ``--end`` tokens of its ``w0``-segment ("end") and the rest ("other"),
``--n`` sequences of each (new filler per sequence), accuracy of each group. Works on a CPU
(~40 s a sequence at N = 131072 for the 3.2M model in float32 on 2 cores) or a GPU::

    PYTHONPATH=src python benchmarks/retrieval_offsets.py --recipe h100-128k \\
        --checkpoint runs/issue25/out/retrieval128k-seed1/retrieval128k-seed1.pt \\
        --bucket 16384,32768 --n 10 --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_retrieval as T  # noqa: E402
from common import load_split  # noqa: E402

from dilated_attention.data import RetrievalTask  # noqa: E402


def distances(n_tokens: int, lo: int, hi: int, w0: int, end: int, n: int, rng: random.Random):
    """``n`` distances in (lo, hi] whose value (``train_retrieval.value_index``) lies in the last
    ``end`` positions of its ``w0``-segment, and ``n`` whose value lies elsewhere."""
    def offset(d):
        return T.value_index(n_tokens, d) % w0

    ends, others = [], []
    for _ in range(1000 * n):  # a draw, moved to the end of its value's segment
        if len(ends) == n:
            break
        v = T.value_index(n_tokens, rng.randint(lo + 1, hi))
        d = T.value_index(n_tokens, v - v % w0 + w0 - 1 - rng.randrange(end))  # (self-inverse)
        if lo < d <= hi:
            ends.append(d)
    for _ in range(1000 * n):
        if len(others) == n:
            break
        d = rng.randint(lo + 1, hi)
        if offset(d) < w0 - end:
            others.append(d)
    if len(ends) < n or len(others) < n:
        raise ValueError(f"distances in ({lo}, {hi}] give too few values {'at' if len(ends) < n else 'off'}"
                         f" the last {end} tokens of a {w0}-segment: widen the bucket")
    return ends, others


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="h100-128k", choices=list(T.RECIPES))
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--bucket", default="16384,32768", help="lo,hi: distances in (lo, hi]")
    p.add_argument("--n", type=int, default=10, help="sequences per group")
    p.add_argument("--end", type=int, default=32, help="'end': the value in the last END tokens")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=12345, help="the distances and fillers drawn")
    a = p.parse_args(argv)
    lo, hi = (int(x) for x in a.bucket.split(","))
    r = dict(T.RECIPES[a.recipe], device=a.device, dtype=a.dtype, impl="auto")
    n_tokens, w0 = r["seq_len"], r["segments"][0]
    if not 5 <= lo < hi <= n_tokens:
        p.error(f"--bucket {a.bucket}: need 5 <= lo < hi <= N = {n_tokens}")
    ck = load_split(a.checkpoint, map_location=a.device)
    device = torch.device(a.device)
    model = T.build_model(r, ck["attention"], device)
    model.load_state_dict(ck["model"])
    model.eval()
    autocast = T._autocast(r, device)
    task = RetrievalTask(seq_len=n_tokens, num_pairs=1, min_distance=r["min_distance"],
                         max_distance=n_tokens)  # fmt: skip
    rng = random.Random(a.seed)
    ends, others = distances(n_tokens, lo, hi, w0, a.end, a.n, rng)
    print(f"{a.checkpoint}: {ck['attention']} seed {ck['seed']} step {ck['state']['step']}; N = "
          f"{n_tokens}, w0 = {w0}, distances in ({lo}, {hi}], {a.n} per group, {a.dtype} on {a.device}")
    res = {}
    for group, ds in (("end", ends), ("other", others)):
        ok_n = 0
        for i, d in enumerate(ds):
            x, y = task.batch(1, a.seed, 7 * 10**8 + i + (10**6 if group == "end" else 0), distance=d)
            t = time.perf_counter()
            with torch.no_grad(), autocast:
                ok = bool(T.answers_right(model, x.to(device), y.to(device))[0].all())
            ok_n += ok
            off = T.value_index(n_tokens, d) % w0
            print(f"  {group}: d {d} offset {off} {'ok' if ok else 'MISS'} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
        res[group] = (ok_n, len(ds))
    print("| group | value offset in its w0-segment | right / sequences |")
    print("| --- | --- | --- |")
    print(f"| end | >= {w0 - a.end} | {res['end'][0]} / {res['end'][1]} |")
    print(f"| other | < {w0 - a.end} | {res['other'][0]} / {res['other'][1]} |")
    return res


if __name__ == "__main__":
    main()
