"""The training loop: loss goes down, logs and checkpoint are written, --resume is exact."""

from __future__ import annotations

import json

import torch
from helpers import train_args

from dilated_attention.data import IGNORE, RetrievalTask
from dilated_attention.train import load_checkpoint, run_train

# Small enough for a few seconds on a busy CPU: 64 tokens, batch 8.
FAST = [
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--min-distance",
    "8",
    "--max-distance",
    "64",
    "--eval-distances",
    "16,64",
    "--eval-samples",
    "16",
    "--impl",
    "torch",
    "--no-progress",
    "--no-plot",
    "--threads",
    "2",
]


def test_retrieval_task_is_seeded_and_well_formed():
    task = RetrievalTask(seq_len=100, num_pairs=3, min_distance=20, max_distance=90)
    x1, y1 = task.batch(4, seed=0, step=5)
    x2, y2 = task.batch(4, seed=0, step=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(task.batch(4, seed=0, step=6)[0], x1)
    assert x1.shape == y1.shape == (4, 100)
    assert ((y1 != IGNORE).sum(1) == 3).all()  # one answer per pair
    x, y = task.batch(2, seed=1, step=0, distance=50)
    for b in range(2):
        # the queried key (input at an answer position) sits, followed by its value, 50 back
        for t in (y[b] != IGNORE).nonzero().flatten().tolist():
            key, val = x[b, t].item(), y[b, t].item()
            pos = (x[b, : 100 - 9] == key).nonzero().flatten().tolist()
            assert len(pos) == 1 and x[b, pos[0] + 1] == val
            assert 100 - 50 <= pos[0] + 1 < 100 - 50 + 2 * 3 + 1


def test_loss_decreases_and_outputs(tmp_path):
    out = tmp_path / "run"
    assert (
        run_train(
            train_args(
                *FAST,
                "--attention",
                "dense",
                "--steps",
                "40",
                "--lr",
                "3e-3",
                "--warmup",
                "5",
                "--eval-every",
                "20",
                "--out-dir",
                str(out),
            )
        )
        == 0
    )
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(log) == 40
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert (out / "log.csv").read_text().startswith("step,")
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["acc"] <= 1.0 and "acc@64" in summary
    model, ck = load_checkpoint(str(out / "ckpt.pt"))
    assert ck["step"] == 40 and model.cfg.segment_lengths == (64,)


def test_resume_is_exact(tmp_path):
    common = [*FAST, "--steps", "6", "--warmup", "2", "--eval-every", "3"]
    run_train(train_args(*common, "--out-dir", str(tmp_path / "a")))
    run_train(train_args(*common, "--out-dir", str(tmp_path / "b"), "--stop-at", "3"))
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["step"] == 3
    run_train(train_args(*common, "--out-dir", str(tmp_path / "b"), "--resume"))
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)
    assert [r["loss"] for r in a["history"]] == [r["loss"] for r in b["history"]]


def test_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    out = tmp_path / "txt"
    run_train(
        train_args(
            *FAST, "--text-file", str(f), "--steps", "3", "--eval-every", "3", "--out-dir", str(out)
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] > 0
