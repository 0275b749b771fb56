"""Which planted values can the retrieval answer reach, and over how many keys is it spread?

For a branch set (w_b, r_b), H heads (``head_assignment="all"``) and sequence length N, using
the attention pattern of docs/spec.md (query i and key j meet in branch b for head h iff
``i // w == j // w`` and ``(i % w) % r == (j % w) % r == h % r``, causal), prints for each
distance d of the retrieval task (value at position N + 2 - d, answer read at N - 1):

- ``1-hop``: the answer position attends the value directly (some head, some branch);
- ``2-hop``: the number of positions p that attend the value and are attended by the answer
  (a two-layer path: p copies the value, the answer reads p);

and, per head, the number of keys (counted with multiplicity) in the answer position's softmax:
at initialisation attention is near uniform, so the value's weight is about 1 / that number.

    python benchmarks/retrieval_reach.py                      # `small` at N = 32768
    python benchmarks/retrieval_reach.py --n 256 --w 32,128,256 --r 1,2,4 --heads 4 \\
        --distances 16,64,128,256                             # `tiny`

CPU only, no torch needed; takes a second.

``--spikes RUN.json`` (needs torch): for a run of ``train_retrieval.py`` at one sequence a step,
where were the planted values of the steps whose loss jumped above 1 at the last stage, against
the every-10th steps of that stage: the value's offset in the first (smallest) segment and its
number of two-layer paths to the answer (docs/training.md, "Spikes at 512K")::

    python benchmarks/retrieval_reach.py --spikes benchmarks/results/retrieval_512k_h100_2026-11-26_seed1.json

``--misses RUN.json``: the same for the eval sequences a run answered wrong (the ``"misses"`` its
evals record), per eval distance, against all eval sequences of that distance.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def attends(i: int, j: np.ndarray, ws, rs, heads: int) -> np.ndarray:
    """Bool mask over key positions ``j``: query ``i`` attends them in some branch and head."""
    j = np.asarray(j)
    ok = np.zeros(j.shape, dtype=bool)
    for w, r in zip(ws, rs, strict=True):
        qi = (i % w) % r
        if qi >= heads:  # no head h with h % r == qi (only when H < r)
            continue
        ok |= (j // w == i // w) & ((j % w) % r == qi)
    return ok & (j <= i)


def reach(n: int, ws, rs, heads: int, distances) -> list[dict]:
    i = n - 1
    rows = []
    for d in distances:
        v = n + 2 - d  # value position (RetrievalTask with one pair)
        one = bool(attends(i, np.array([v]), ws, rs, heads)[0])
        ps = np.arange(v, n)
        mid = np.array([attends(int(p), np.array([v]), ws, rs, heads)[0] for p in ps])
        two = int((mid & attends(i, ps, ws, rs, heads)).sum())
        rows.append({"distance": d, "value_pos": v, "one_hop": one, "two_hop": two})
    return rows


def two_hop_count(n: int, v: int, ws, rs, heads: int) -> int:
    """``reach``'s two-hop count for the value at ``v``, vectorised (fast at N = 1M)."""
    i, p = n - 1, np.arange(v, n)
    into, out = np.zeros(p.shape, bool), np.zeros(p.shape, bool)
    for w, r in zip(ws, rs, strict=True):
        if (v % w) % r < heads:
            into |= (p // w == v // w) & ((p % w) % r == (v % w) % r)
        if (i % w) % r < heads:
            out |= (p // w == i // w) & ((p % w) % r == (i % w) % r)
    return int((into & out).sum())


def spike_geometry(path: str) -> str:
    """Markdown: the planted values of a run's loss spikes vs its every-10th steps (last stage)."""
    import json
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_retrieval import value_position

    from dilated_attention.data import RetrievalTask

    d = json.load(open(path))
    rc = d["recipe"]
    n, ws, rs, heads = rc["seq_len"], rc["segments"], rc["rates"], rc["n_head"]
    task = RetrievalTask(seq_len=n, num_pairs=1, min_distance=rc["min_distance"], max_distance=n)
    w0 = ws[0]
    lines = [f"# Where the loss spikes were: `{path}`", "",
             f"N = {n}, w = {ws}, r = {rs}, {heads} heads; steps at the last stage (one sequence "
             f"a step); value position v = N + 2 - distance; offset = v mod {w0} (the first "
             f"segment); paths = two-layer paths from the value to the answer "
             f"(`retrieval_reach.py`)", "",
             "| run | steps | median paths | paths < 128 | offset >= 7/8 of the segment |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for run in d["runs"]:
        if run.get("num_pairs", rc["num_pairs"]) != 1:
            continue

        def value_pos(step):  # the batch of logged step `step` was drawn at step - 1
            return value_position(task, task.batch(1, run["seed"], step - 1)[0][0])

        rows = [row for row in run["losses"] if row[1] == n]
        groups = (("loss > 1", [row for row in rows if row[2] > 1]),
                  ("loss <= 1 (every 10th step)", [row for row in rows if row[2] <= 1]))  # fmt: skip
        for name, grp in groups:
            if not grp:
                continue
            vs = [value_pos(row[0]) for row in grp]
            paths = np.array([two_hop_count(n, v, ws, rs, heads) for v in vs])
            late = np.mean([v % w0 >= w0 - w0 // 8 for v in vs])
            lines.append(f"| {run['attention']} seed {run['seed']} | {len(grp)} {name} | "
                         f"{np.median(paths):.0f} | {np.mean(paths < 128):.2f} | {late:.2f} |")
    lines.append("")
    lines.append("(uniform positions: offset >= 7/8 of the segment for 0.125 of the values)")
    return "\n".join(lines) + "\n"


def miss_geometry(path: str) -> str:
    """Markdown: the eval sequences a run answered wrong (``"misses"`` of its evals, written by
    ``train_retrieval.py`` since 2026-11-26) against all eval sequences of the same distance: the
    value's offset in its first-branch segment and its number of two-layer paths."""
    import json
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_retrieval import eval_distance, value_index

    d = json.load(open(path))
    rc = d["recipe"]
    n, ws, rs, heads = rc["seq_len"], rc["segments"], rc["rates"], rc["n_head"]
    w0 = ws[0]
    nb = -(-rc["eval_samples"] // rc["eval_batch"])
    lines = [f"# The eval sequences answered wrong: `{path}`", "",
             f"N = {n}, w = {ws}, r = {rs}, {heads} heads; value position v = N + 2 - distance; "
             f"offset = v mod {w0} (the first segment); paths = two-layer paths from the value "
             f"to the answer (`retrieval_reach.py`); a sequence counts once per eval it missed", "",
             "| run | acc@d | evals | misses | sequences missed (distance: times) | their offsets "
             "| their median paths | all sequences: median paths, offset >= 7/8 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for run in d["runs"]:
        evals = [ev for ev in run["evals"] if ev.get("stage_n", n) == n]
        for dist_key in (f"acc@{x}" for x in rc["eval_distances"]):
            dd = int(dist_key[4:])
            missed: dict[int, int] = {}
            for ev in evals:
                for dist, _v in ev.get("misses", {}).get(dist_key, []):
                    missed[dist] = missed.get(dist, 0) + 1
            everyone = sorted({eval_distance(rc, dd, i) for i in range(nb)})
            all_paths = [two_hop_count(n, value_index(n, x), ws, rs, heads) for x in everyone]
            late_all = np.mean([value_index(n, x) % w0 >= w0 - w0 // 8 for x in everyone])
            if missed:
                offs = ", ".join(str(value_index(n, x) % w0) for x in sorted(missed))
                paths = f"{np.median([two_hop_count(n, value_index(n, x), ws, rs, heads) for x in missed]):.0f}"
                seqs = ", ".join(f"{x}: {c}" for x, c in sorted(missed.items()))
            else:
                offs, paths, seqs = "-", "-", "-"
            lines.append(f"| {run['attention']} seed {run['seed']} | {dist_key} | {len(evals)} | "
                         f"{sum(missed.values())} | {seqs} | {offs} | {paths} | "
                         f"{np.median(all_paths):.0f}, {late_all:.2f} |")  # fmt: skip
    lines.append("")
    lines.append(f"(a distance stands for the eval batch that has it: {rc['eval_batch']} "
                 "sequence(s), the same value position)")
    return "\n".join(lines) + "\n"


def keys_per_head(n: int, ws, rs, heads: int) -> list[int]:
    i = n - 1
    out = []
    for h in range(heads):
        tot = 0
        for w, r in zip(ws, rs, strict=True):
            if (i % w) % r != h % r:
                continue
            js = np.arange((i // w) * w, i + 1)
            tot += int(((js % w) % r == h % r).sum())
        out.append(tot)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--w", type=ints, default=[1024, 4096, 16384, 32768])
    p.add_argument("--r", type=ints, default=[1, 2, 4, 6])
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--distances", type=ints, default=[512, 2048, 8192, 16384, 32768])
    p.add_argument("--spikes", help="a train_retrieval.py RUN.json: where its loss spikes were")
    p.add_argument("--misses", help="a train_retrieval.py RUN.json: which eval sequences it missed")
    a = p.parse_args(argv)
    if a.spikes:
        print(spike_geometry(a.spikes), end="")
        return 0
    if a.misses:
        print(miss_geometry(a.misses), end="")
        return 0
    print(f"N = {a.n}, w = {a.w}, r = {a.r}, H = {a.heads}")
    print("distance | value pos | 1-hop | 2-hop intermediates")
    for row in reach(a.n, a.w, a.r, a.heads, a.distances):
        print(f"{row['distance']} | {row['value_pos']} | {row['one_hop']} | {row['two_hop']}")
    print("keys in the answer position's softmax, per head:", keys_per_head(a.n, a.w, a.r, a.heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
