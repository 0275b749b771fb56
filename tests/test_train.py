"""The training loop: loss goes down, logs and checkpoint are written, --resume is exact."""

from __future__ import annotations

import json

import pytest
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
    "1",  # one thread: OpenMP threads spin-wait badly on a loaded CI box
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


def test_stdlib_corpus_rule_is_deterministic(tmp_path):
    """The file list and split follow the documented rule exactly, independent of walk order."""
    import zlib

    from dilated_attention.data import StdlibBytes, stdlib_source_files

    names = ["b.py", "a.py", "pkg/__init__.py", "pkg/z.py", "pkg/data.txt", "test/test_x.py",
             "pkg/tests/t.py", "site-packages/foo.py", "idlelib/idle_test/h.py",
             "idlelib/i.py"]  # fmt: skip
    names += [f"m{i}.py" for i in range(40)]
    for n in names:
        p = tmp_path / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# {n}\n" + "x = 1\n" * 40)
    root, train, val = stdlib_source_files(str(tmp_path))
    want = sorted(n for n in names if n.endswith(".py") and not n.startswith(
        ("test/", "pkg/tests/", "site-packages/", "idlelib/idle_test/")))  # fmt: skip
    assert sorted(train + val) == want and train == sorted(train) and val == sorted(val)
    assert val == [n for n in want if zlib.crc32(n.encode()) % 20 == 0] and val
    assert stdlib_source_files(str(tmp_path)) == (root, train, val)
    d1, d2 = StdlibBytes(64, root=str(tmp_path)), StdlibBytes(64, root=str(tmp_path))
    assert torch.equal(d1.train_data, d2.train_data) and torch.equal(d1.val_data, d2.val_data)
    x, y = d1.batch(3, seed=0, step=2)
    assert torch.equal(x, d2.batch(3, seed=0, step=2)[0]) and x.shape == y.shape == (3, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-byte targets
    # the real standard library: the rule gives a non-empty, sorted list with no test files
    _, real_train, real_val = stdlib_source_files()
    assert real_train and real_val and real_train == sorted(real_train)
    assert not any(f.startswith("test/") for f in real_train + real_val)


def _bench(name: str):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_retrieval_script_end_to_end(tmp_path):
    mod = _bench("train_retrieval")
    out = tmp_path / "rt"
    argv = ["--recipe", "tiny-check", "--attention", "dilated,local", "--impl", "torch",
            "--max-minutes", "0.02", "--out", str(out), "--threads", "1"]  # fmt: skip
    assert mod.main(argv) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert [r["attention"] for r in res["runs"]] == ["dilated", "local"]
    for r in res["runs"]:
        assert r["steps"] > 0 and set(r["evals"][-1]) >= {"acc@16", "acc@128"}
    assert "| dilated | 0 |" in out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="N:batch:steps"):
        mod.parse_curriculum("64:4")
    with pytest.raises(ValueError, match="only the last stage"):
        mod.parse_curriculum("64:4:0,128:2:0")


@pytest.mark.parametrize("heads", [3, 2])
def test_retrieval_reach_rule_matches_reference_attention(heads):
    """benchmarks/retrieval_reach.py's pattern (the diagnosis in docs/training.md) equals the
    keys the reference dilated attention gives weight to, for every query (H < r included)."""
    from dilated_attention import dilated_attention

    mod = _bench("retrieval_reach")
    n, ws, rs = 29, (4, 8, 29), (1, 2, 3)
    q = torch.zeros(1, n, heads, n, dtype=torch.float64)  # equal scores: weight > 0 iff m > 0
    v = torch.eye(n, dtype=torch.float64)[None, :, None, :].expand(1, n, heads, n)
    out = dilated_attention(q, q.clone(), v.contiguous(), ws, rs, causal=True, impl="reference")
    seen = (out[0] > 0).any(dim=1)  # (N queries, N keys): some head gives the key weight
    for i in range(n):
        want = seen[i].numpy()
        got = mod.attends(i, torch.arange(n).numpy(), ws, rs, heads)
        assert (got == want).all(), (i, got, want)
    rows = mod.reach(n, ws, rs, heads, [5, 29])
    assert rows[0]["value_pos"] == n - 3 and isinstance(rows[1]["two_hop"], int)


def test_train_retrieval_stage_rule_schedule_and_resume(tmp_path, monkeypatch):
    """The stage-advance rule looks at the current stage's losses only (50 of them); the
    learning-rate factor (warmup, cosine over the cap, per-stage warmup); pause and resume
    continue the same run (steps, stage, evals)."""
    mod = _bench("train_retrieval")
    r = dict(mod.RECIPES["tiny-check"], max_minutes=10.0, warmup=10, schedule="cosine",
             min_lr_ratio=0.1, stage_warmup=5)  # fmt: skip
    assert mod.lr_factor(r, 0, 0, 0, 0.0) == pytest.approx(0.1)
    assert mod.lr_factor(r, 50, 0, 50, 0.0) == pytest.approx(1.0)
    assert mod.lr_factor(r, 50, 0, 50, 300.0) == pytest.approx(0.55)
    assert mod.lr_factor(r, 50, 0, 50, 600.0) == pytest.approx(0.1)
    assert mod.lr_factor(r, 50, 1, 0, 0.0) == pytest.approx(0.2)  # a later stage warms up again
    assert mod.lr_factor(dict(r, schedule="constant"), 50, 1, 9, 600.0) == pytest.approx(1.0)

    def easy_loss(model, x, y, z_loss):  # every step "learned": each stage ends after 50 steps
        ce = sum(p.sum() for p in model.parameters()) * 0.0 + 0.01
        return ce, ce

    monkeypatch.setattr(mod, "retrieval_loss", easy_loss)
    rec = mod.train_one(dict(mod.RECIPES["tiny-check"], curriculum="64:4:200,128:2:200,128:2:60",
                             target=2.0, impl="torch", advance_loss=0.2, max_minutes=5.0), "dilated", 0,
                        log=lambda m: None)  # fmt: skip
    assert [s["step"] for s in rec["stage_starts"]] == [0, 50, 100]
    assert rec["steps"] == 160

    base = ["--recipe", "tiny-check", "--attention", "dilated", "--impl", "torch", "--threads", "1",
            "--curriculum", "64:4:200,128:2:200,128:2:60", "--target", "2", "--max-minutes", "5"]  # fmt: skip
    ck = str(tmp_path / "ck.pt")
    assert mod.main(base + ["--out", str(tmp_path / "a"), "--pause-after-minutes", "0",
                            "--checkpoint", ck]) == 0  # fmt: skip
    paused = json.loads((tmp_path / "a.json").read_text())["runs"][0]
    assert paused["paused"] and paused["steps"] == 0
    assert mod.main(base + ["--out", str(tmp_path / "b"), "--resume", ck]) == 0
    done = json.loads((tmp_path / "b.json").read_text())["runs"][0]
    assert done["resumed_at"] == [0] and done["steps"] == 160 and "paused" not in done
    with pytest.raises(SystemExit):
        mod.main(base + ["--out", str(tmp_path / "c"), "--pause-after-minutes", "1"])
    # the stage of a run paused before its first step is recorded once, not again on resume
    assert [s["step"] for s in done["stage_starts"]] == [0, 50, 100]


def test_train_retrieval_pause_resume_equals_one_run(tmp_path, monkeypatch):
    """A run paused twice mid-stage and resumed gives the losses, steps and evals of the same
    run uninterrupted (constant schedule; a fake clock, one second per reading, so that the
    pauses fall on known steps and wall time decides nothing else)."""
    mod = _bench("train_retrieval")

    class Clock:
        t = 0.0

        def perf_counter(self):
            self.t += 1.0
            return self.t

    r = dict(mod.RECIPES["tiny-check"], curriculum="64:4:12,128:2:12", target=2.0, impl="torch",
             advance_loss=0.0, max_minutes=1e6, eval_every_s=1e9, stage_warmup=3, z_loss=1e-3)  # fmt: skip
    monkeypatch.setattr(mod, "time", Clock())
    whole = mod.train_one(r, "dilated", 0, log=lambda m: None)
    ck = str(tmp_path / "ck.pt")
    monkeypatch.setattr(mod, "time", Clock())
    part = mod.train_one(r, "dilated", 0, log=lambda m: None, pause_s=20, checkpoint=ck)
    assert part["paused"] and 0 < part["steps"] < 12
    monkeypatch.setattr(mod, "time", Clock())
    part = mod.train_one(r, "dilated", 0, log=lambda m: None, pause_s=30, checkpoint=ck, resume=ck)
    assert part["paused"] and 12 < part["steps"] < 24  # the second pause is in the second stage
    monkeypatch.setattr(mod, "time", Clock())
    done = mod.train_one(r, "dilated", 0, log=lambda m: None, resume=ck)
    assert done["steps"] == whole["steps"] == 24
    assert done["losses"] == whole["losses"]
    assert [s["step"] for s in done["stage_starts"]] == [s["step"] for s in whole["stage_starts"]]
    strip = [{k: v for k, v in e.items() if k != "time_s"} for e in whole["evals"]]
    assert [{k: v for k, v in e.items() if k != "time_s"} for e in done["evals"]] == strip


def test_train_retrieval_bad_flags_one_line_errors(tmp_path, capsys):
    """Bad values and combinations exit with one argparse line before training (they used to
    raise mid-run, or train silently wrong: a negative stage warmup gave a negative learning
    rate); a resume under other settings is refused."""
    mod = _bench("train_retrieval")
    base = ["--recipe", "tiny-check", "--impl", "torch", "--threads", "1", "--out", str(tmp_path / "o")]
    ck = str(tmp_path / "ck.pt")
    bad = [
        (["--warmup", "0"], "--warmup must be >= 1"),
        (["--stage-warmup", "-1"], "--stage-warmup must be >= 0"),
        (["--z-loss", "-1"], "--z-loss must be >= 0"),
        (["--min-lr-ratio", "2"], r"--min-lr-ratio must be in \[0, 1\]"),
        (["--max-minutes", "0"], "--max-minutes must be > 0"),
        (["--curriculum", "64:4:5,100:2:0"], "last curriculum stage has N = 100"),
        (["--curriculum", "abc"], "must be N:batch:steps"),
        (["--eval-distances", "16,4096"], "eval distance 4096"),
        (["--attention", "foo"], "--attention takes"),
        (["--checkpoint", ck], "--checkpoint is where --pause-after-minutes saves"),
        (["--pause-after-minutes", "1", "--checkpoint", str(tmp_path / "no" / "ck.pt")], "does not exist"),
        (["--resume", str(tmp_path / "none.pt")], "no such file"),
    ]
    for extra, msg in bad:
        with pytest.raises(SystemExit) as e:
            mod.main(base + extra)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "error:" in err and __import__("re").search(msg, err), (extra, err)
    run = base + ["--curriculum", "64:4:5,128:2:5", "--max-minutes", "5"]
    assert mod.main(run + ["--pause-after-minutes", "0", "--checkpoint", ck]) == 0
    for extra, msg in ((["--lr", "3e-3"], r"other settings: lr 0.001 \(now 0.003\)"),
                       (["--seeds", "1"], "is for --attention dilated --seeds 0")):  # fmt: skip
        with pytest.raises(SystemExit):
            mod.main(run + ["--resume", ck] + extra)
        assert __import__("re").search(msg, capsys.readouterr().err), extra
    assert mod.main(run + ["--resume", ck]) == 0
