"""Sequence-parallel ``dilated-attention train``: 2 gloo ranks train exactly as one process.

The ranks are real processes (``dist_utils.run_distributed``: forkserver, file:// rendezvous)
that call :func:`run_train` inside an initialised process group, which is what ``torchrun`` gives
the command (the env-based init itself is exercised by ``benchmarks/train_sp_recipe.py --cpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from helpers import train_args

from dilated_attention.train import run_train

REPO = Path(__file__).resolve().parents[1]

# The tiny preset's model (branches w = 32, 128, 256, r = 1, 2, 4) on 128 tokens split over 2
# ranks: the w = 128 and 256 branches span both shards. 2 pairs: answers in the last tail only
# (rank 1), so rank 0 has no scored target (its loss term is 0, its gradients are not).
TINY_SP = [
    "--preset", "tiny", "--attention", "dilated", "--seq-len", "128", "--batch-size", "4",
    "--num-pairs", "2", "--min-distance", "10", "--max-distance", "128",
    "--eval-distances", "16,100", "--eval-samples", "4", "--eval-every", "3",
    "--steps", "6", "--warmup", "2", "--lr", "3e-3", "--impl", "torch", "--threads", "1",
    "--no-progress", "--no-plot",
]  # fmt: skip


def _sp_train_worker(rank: int, world: int, out_dir: str, text_file: str) -> None:
    assert run_train(train_args(*TINY_SP, "--out-dir", out_dir)) == 0
    # interrupted at step 4 and resumed: every rank loads rank 0's checkpoint
    assert run_train(train_args(*TINY_SP, "--out-dir", out_dir + "-resumed", "--stop-at", "4")) == 0
    assert run_train(train_args(*TINY_SP, "--out-dir", out_dir + "-resumed", "--resume")) == 0
    text = [*TINY_SP, "--text-file", text_file, "--steps", "2", "--eval-every", "2"]
    assert run_train(train_args(*text, "--out-dir", out_dir + "-text")) == 0


def _log(path) -> list[dict]:
    return [json.loads(line) for line in (path / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 2 spawned ranks x 4 training runs
@pytest.mark.timeout(120)
def test_sequence_parallel_training_matches_single_process(tmp_path):
    text_file = tmp_path / "t.txt"
    text_file.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    single, sp = tmp_path / "single", tmp_path / "sp"
    run_distributed(_sp_train_worker, 2, str(sp), str(text_file))
    assert run_train(train_args(*TINY_SP, "--out-dir", str(single))) == 0
    text = [*TINY_SP, "--text-file", str(text_file), "--steps", "2", "--eval-every", "2"]
    assert run_train(train_args(*text, "--out-dir", str(single) + "-text")) == 0

    for a_dir, b_dir in ((single, sp), (tmp_path / "single-text", tmp_path / "sp-text")):
        a, b = _log(a_dir), _log(b_dir)
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for ra, rb in zip(a, b, strict=True):
            for key in ra:
                if key == "loss" or key == "grad_norm" or key.startswith(("acc", "val_")):
                    assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (key, ra, rb)
        # The same parameters at the end, to float32 rounding amplified by Adam: an element whose
        # gradient is ~0 (rounding noise) can move by up to lr in one run and not in the other.
        ca = torch.load(a_dir / "ckpt.pt", weights_only=False)["model"]
        cb = torch.load(b_dir / "ckpt.pt", weights_only=False)["model"]
        for k in ca:
            diff = cb[k] - ca[k]
            assert diff.norm() <= 2e-4 * ca[k].norm() + 1e-6, (k, diff.norm(), ca[k].norm())
            assert diff.abs().max() < 3e-3, (k, diff.abs().max())  # < one step of lr 3e-3
    resumed = torch.load(tmp_path / "sp-resumed" / "ckpt.pt", weights_only=False)
    straight = torch.load(sp / "ckpt.pt", weights_only=False)
    assert resumed["step"] == straight["step"] == 6
    for k in straight["model"]:
        assert torch.equal(resumed["model"][k], straight["model"][k]), k
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in _log(sp)]
    losses = [r["loss"] for r in _log(single)]
    assert len(set(losses)) == len(losses)  # the runs really trained (the loss moved)

    summary = json.loads((sp / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["tokens_per_step"] == 4 * 128
    assert summary["tokens_per_s"] > 0
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(summary["tokens_per_s"] / 2)
    assert json.loads((sp / "config.json").read_text())["world_size"] == 2


def test_sequence_length_not_divisible_by_world_size(tmp_path, monkeypatch):
    # torchrun's environment; the check runs before any process group is created
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"--seq-len 128 is not divisible by the world size 3"):
        run_train(train_args(*TINY_SP, "--out-dir", str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # a real torchrun launch
@pytest.mark.timeout(120)
def test_torchrun_recipe_cpu_smoke(tmp_path):
    """The recipe end to end on CPU: ``torchrun --standalone --nproc_per_node=2 -m
    dilated_attention train`` (env-based gloo init) against one process, report written."""
    out = tmp_path / "report.md"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "train_sp_recipe.py"), "--cpu", "--steps", "4",
        "--out", str(out), "--work-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert "| PASS |" in text and "torchrun --standalone --nproc_per_node=2" in text
    raw = json.loads(out.with_suffix(".json").read_text())
    assert len(raw["loss_single"]) == len(raw["loss_sp"]) == 4
    assert raw["loss_sp"] == pytest.approx(raw["loss_single"], rel=1e-5)
    assert raw["summary_sp"]["world_size"] == 2


_GROUP_FREED = """
import os, sys, weakref
from dilated_attention import train
from dilated_attention.cli import main

refs = []
init_sp = train._init_sp


def spy(*args, **kwargs):
    group, device, owns = init_sp(*args, **kwargs)
    refs.append(weakref.ref(group))
    return group, device, owns


train._init_sp = spy
assert main(sys.argv[1:]) == 0
assert len(refs) == 1
# the group the command created is gone once the command returns: no ProcessGroup left for the
# interpreter's shutdown to destroy (gloo can abort there, after a finished run). One file per
# rank: the ranks' printed lines interleave on the shared stdout
with open(os.path.join(os.environ["FREED_DIR"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(refs[0]() is None))
"""


@pytest.mark.slow  # a real torchrun launch
@pytest.mark.timeout(120)
def test_torchrun_train_frees_its_process_group(tmp_path):
    """``dilated-attention train`` under torchrun destroys the group it created, and nothing keeps
    it alive (torch._dynamo, imported by the optimizer after the group exists, kept references
    to it; the group then died in the interpreter's shutdown, where gloo aborted one rank now and
    then: SIGABRT after a finished run)."""
    script = tmp_path / "train_freed.py"
    script.write_text(_GROUP_FREED)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(script), "train", *TINY_SP, "--device", "cpu",
        "--steps", "2", "--eval-every", "2", "--out-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "FREED_DIR": str(tmp_path)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    freed = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert freed == ["True", "True"], freed
