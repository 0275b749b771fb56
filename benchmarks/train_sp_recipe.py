"""Recipe: sequence-parallel training on 2 GPUs vs 1 GPU, same seed (GitHub issue 7).

Runs the same short ``dilated-attention train`` twice with identical flags and seed:

1. one process, one GPU:   ``python -m dilated_attention train ...``
2. sequence-parallel:      ``torchrun --standalone --nproc_per_node=2 -m dilated_attention train ...``
   (launched as ``python -m torch.distributed.run``, which is ``torchrun``)

then compares the two loss logs step by step (|delta loss| at step 1, max, mean, final; eval
accuracies; tokens/s of each) and writes a markdown report to ``--out`` (or ``$TRAIN_SP_OUT``)
and the raw per-step losses next to it (same name, ``.json``).

On a machine with >= 2 GPUs (no network needed; the package from ``src/`` is put on PYTHONPATH)::

    python3 benchmarks/train_sp_recipe.py --out $OUT/train_sp_h200x2.md
    # on 2 of 4 GPUs:
    CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/train_sp_recipe.py --out $OUT/train_sp.md

GPU defaults: ``small`` preset (10.7M parameters), N = 32768 tokens, batch 8, 8 key-value pairs
per sequence, 100 steps, bf16 autocast (the trainer's GPU default), ``--impl torch`` in both runs
(the sequence-parallel path runs the torch kernels on each rank, so the single-GPU run uses the
same kernels and the comparison is about the parallelism, not the kernel). In bf16 the two runs
agree to rounding at step 1 (same weights, same batch) and then drift apart as rounding
differences compound, so the check is statistical: ``|delta|`` at step 1 below ``--tol-first``
and the mean ``|delta|`` over all steps below ``--tol-mean``. ``--noise-ref`` adds a third run
(single device, float32) whose distance to the bf16 single-device run shows the scale of bf16
noise. ``-- --dtype float32`` makes the whole comparison float32 and tight (and slower).

CPU smoke mode (gloo, tiny preset, 8 steps, float32; about 30 s on 2 cores)::

    PYTHONPATH=src python benchmarks/train_sp_recipe.py --cpu --out /tmp/train_sp_cpu.md

Arguments after ``--`` are passed to both training runs (e.g. ``-- --lr 1e-3``).
Exit status: 0 when both runs finished and the check passed, 1 when the check failed (the report
is written either way), 2 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the runs use the package from src/ (PYTHONPATH below); the report's header helper comes from it too
sys.path[:0] = [os.path.join(REPO, "src"), os.path.join(REPO, "benchmarks")]
from common import results_header  # noqa: E402

GPU_FLAGS = [
    "--preset", "small", "--attention", "dilated", "--seq-len", "32768", "--batch-size", "8",
    "--num-pairs", "8", "--min-distance", "64", "--max-distance", "32768",
    "--eval-distances", "2048,32768", "--eval-samples", "16",
    "--steps", "100", "--warmup", "20", "--lr", "2e-3", "--impl", "torch",
    "--device", "cuda", "--dtype", "bfloat16",
]  # fmt: skip
CPU_FLAGS = [
    "--preset", "tiny", "--attention", "dilated", "--seq-len", "128", "--batch-size", "4",
    "--num-pairs", "2", "--min-distance", "10", "--max-distance", "128",
    "--eval-distances", "16,100", "--eval-samples", "4",
    "--steps", "8", "--warmup", "2", "--lr", "3e-3", "--impl", "torch",
    "--device", "cpu", "--dtype", "float32", "--threads", "1",
]  # fmt: skip


def _flag(flags: list[str], name: str, default=None):
    """The last value of ``name`` in an argv list (later flags win, as argparse does)."""
    val = default
    for i, a in enumerate(flags[:-1]):
        if a == name:
            val = flags[i + 1]
    return val


def _run(cmd: list[str], env: dict, log_path: str) -> tuple[int, float]:
    print("+ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - t0
    with open(log_path) as f:
        tail = f.read()[-3000:]
    print(tail if rc else tail[-600:], flush=True)
    return rc, wall


def _load(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    return {"log": log, "summary": summary, "config": config}


def _fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("TRAIN_SP_OUT"), help="markdown report path")
    p.add_argument("--cpu", action="store_true", help="CPU smoke mode: gloo, tiny preset")
    p.add_argument("--nproc", type=int, default=2, help="sequence-parallel ranks")
    p.add_argument("--steps", type=int, help="override the recipe's --steps")
    p.add_argument("--work-dir", help="run directories (default: a temporary directory)")
    p.add_argument("--tol-first", type=float, help="max |delta loss| at step 1")
    p.add_argument("--tol-mean", type=float, help="max mean |delta loss| over all steps")
    p.add_argument(
        "--noise-ref",
        action="store_true",
        help="also run the single device in float32: its distance to the bf16 single-device run "
        "is the scale of bf16 noise (slower: a third run)",
    )
    a = p.parse_args(argv)
    if not a.out:
        p.error("give --out PATH (or set TRAIN_SP_OUT)")

    flags = list(CPU_FLAGS if a.cpu else GPU_FLAGS)
    if a.steps:
        flags += ["--steps", str(a.steps)]
    flags += extra
    steps = int(_flag(flags, "--steps"))
    if _flag(flags, "--eval-every") is None:
        flags += ["--eval-every", str(steps)]  # one eval, at the end
    flags += ["--seed", _flag(flags, "--seed", "0"), "--no-progress", "--no-plot"]
    fp32 = _flag(flags, "--dtype") == "float32"
    tol_first = a.tol_first if a.tol_first is not None else (1e-5 if fp32 else 0.05)
    tol_mean = a.tol_mean if a.tol_mean is not None else (1e-4 if fp32 else 0.05)

    work = a.work_dir or tempfile.mkdtemp(prefix="train_sp_")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (os.path.join(REPO, "src"), env.get("PYTHONPATH")) if x
    )
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    py = sys.executable
    single_dir, sp_dir = os.path.join(work, "single"), os.path.join(work, f"sp{a.nproc}")
    train = ["-m", "dilated_attention", "train", *flags]
    cmd_single = [py, *train, "--out-dir", single_dir]
    cmd_sp = [
        py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
        *train, "--out-dir", sp_dir,
    ]  # fmt: skip
    env_single = dict(env)
    if not a.cpu:  # the single-GPU run on the first visible GPU
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible:
            env_single["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0]
    else:
        env_single.setdefault("OMP_NUM_THREADS", "1")  # as torchrun gives each rank

    rc1, wall1 = _run(cmd_single, env_single, os.path.join(work, "single.out"))
    rc2, wall2 = _run(cmd_sp, env, os.path.join(work, "sp.out"))
    ref = None
    if a.noise_ref and not fp32:
        ref_dir = os.path.join(work, "single_fp32")
        cmd_ref = [py, *train, "--dtype", "float32", "--out-dir", ref_dir]
        rc3, _ = _run(cmd_ref, env_single, os.path.join(work, "single_fp32.out"))
        if rc3:
            print(f"the float32 reference run failed (rc={rc3}); logs in {work}")
            return 2
        ref = [r["loss"] for r in _load(ref_dir)["log"]]
    if rc1 or rc2:
        print(f"a run failed (single rc={rc1}, sequence-parallel rc={rc2}); logs in {work}")
        return 2
    r1, r2 = _load(single_dir), _load(sp_dir)

    l1 = [r["loss"] for r in r1["log"]]
    l2 = [r["loss"] for r in r2["log"]]
    if len(l1) != len(l2):
        print(f"different numbers of steps: {len(l1)} vs {len(l2)}")
        return 2
    d = [abs(x - y) for x, y in zip(l1, l2, strict=True)]
    k = min(10, len(l1))
    tail1, tail2 = sum(l1[-k:]) / k, sum(l2[-k:]) / k
    s1, s2 = r1["summary"], r2["summary"]
    first_ok, mean_ok = d[0] <= tol_first, sum(d) / len(d) <= tol_mean
    ok = first_ok and mean_ok
    cfg = r2["config"]
    evals = sorted(k_ for k_ in s1 if k_.startswith(("acc", "val_")))

    shown = sorted({1, 2, 3, 5, 10, 20, 30, 50, 75, len(l1)} & set(range(1, len(l1) + 1)))
    recipe = shlex.join(["python", "benchmarks/train_sp_recipe.py", *sys.argv[1:]])
    lines = results_header("Sequence-parallel training vs one device, same seed", "cpu" if a.cpu else "cuda", recipe, [
        f"single: `{shlex.join(['python', *train, '--out-dir', 'runs/single'])}`",
        f"sequence-parallel: `{shlex.join(['torchrun', '--standalone', f'--nproc_per_node={a.nproc}', *train, '--out-dir', f'runs/sp{a.nproc}'])}`",
        f"ranks: {cfg['world_size']} x {cfg['device_name']} (single run: 1 x "
        f"{r1['config']['device_name']}); backend {'gloo' if a.cpu else 'nccl'}; the runs' torch {cfg['torch']}",
        f"model: {s1['preset']} preset, {s1['params'] / 1e6:.2f}M parameters, branches "
        f"w={cfg['model']['segment_lengths']} r={cfg['model']['dilation_rates']}, "
        f"impl {cfg['model']['impl']}",
        f"N = {cfg['settings']['seq_len']} tokens x batch {cfg['settings']['batch_size']} = "
        f"{s1['tokens_per_step']} tokens/step ({s2['tokens_per_step'] // cfg['world_size']} per "
        f"rank in the SP run), {len(l1)} steps, autocast {cfg['settings']['dtype']}, "
        f"seed {_flag(flags, '--seed')}",
        "tokens/s: global batch tokens per second of optimizer-step time (eval excluded), "
        f"leaving out the first {s1['throughput_steps_skipped']} / "
        f"{s2['throughput_steps_skipped']} steps (warm-up); wall = the whole command "
        "(startup, model build, steps, eval, checkpoint)",
    ])
    lines += [
        "",
        "| run | ranks | final loss | mean loss, last "
        f"{k} steps | {' | '.join(evals)} | step ms | tokens/s (all ranks) | tokens/s per GPU "
        "| wall s |",
        "|---|---:|---:|---:|" + "---:|" * len(evals) + "---:|---:|---:|---:|",
    ]
    for name, r, s, wall in (
        ("single device", r1, s1, wall1),
        ("sequence-parallel", r2, s2, wall2),
    ):
        lines.append(
            f"| {name} | {r['config']['world_size']} | {s['final_loss']:.4f} | "
            f"{sum(x['loss'] for x in r['log'][-k:]) / k:.4f} | "
            + "".join(f"{_fmt(s.get(e), '.3f')} | " for e in evals)
            + f"{_fmt(s['step_s'] and 1000 * s['step_s'], '.1f')} | "
            f"{_fmt(s['tokens_per_s'], ',.0f')} | {_fmt(s['tokens_per_s_per_gpu'], ',.0f')} | "
            f"{wall:.1f} |"
        )
    speed = (
        s2["tokens_per_s"] / s1["tokens_per_s"]
        if s1["tokens_per_s"] and s2["tokens_per_s"]
        else None
    )
    lines += [
        "",
        f"Speed-up of the {a.nproc}-rank run over one device (tokens/s): {_fmt(speed, '.2f')}x.",
        "",
        "| loss comparison | value |",
        "|---|---:|",
        f"| \\|delta\\| at step 1 (same weights, same batch) | {d[0]:.3g} |",
        f"| max \\|delta\\| over {len(d)} steps | {max(d):.3g} (step {d.index(max(d)) + 1}) |",
        f"| mean \\|delta\\| | {sum(d) / len(d):.3g} |",
        f"| \\|delta\\| at the last step | {d[-1]:.3g} |",
        f"| delta of the last-{k}-step means | {abs(tail1 - tail2):.3g} |",
        f"| check: step 1 <= {tol_first:g} and mean <= {tol_mean:g} | {'PASS' if ok else 'FAIL'} |",
    ]
    if ref is not None:
        dr = [abs(x - y) for x, y in zip(l1, ref, strict=True)]
        lines += [
            "",
            "bf16 noise scale: the same single-device run in float32 vs in bf16 (autocast), "
            f"|delta| at step 1 {dr[0]:.3g}, max {max(dr):.3g}, mean {sum(dr) / len(dr):.3g}, "
            f"last {dr[-1]:.3g}.",
        ]
    lines += [
        "",
        "| step | loss, single | loss, sequence-parallel | delta |"
        + (" loss, single float32 |" if ref is not None else ""),
        "|---:|---:|---:|---:|" + ("---:|" if ref is not None else ""),
    ]
    lines += [
        f"| {i} | {l1[i - 1]:.5f} | {l2[i - 1]:.5f} | {l2[i - 1] - l1[i - 1]:+.2e} |"
        + (f" {ref[i - 1]:.5f} |" if ref is not None else "")
        for i in shown
    ]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    raw = {
        "flags": flags, "loss_single": l1, "loss_sp": l2,
        "loss_single_fp32": ref,
        "summary_single": s1, "summary_sp": s2, "wall_s": [wall1, wall2], "pass": ok,
    }  # fmt: skip
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(raw, f, indent=1)
    print(text)
    print(f"report: {a.out}; run directories: {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
