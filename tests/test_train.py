"""The training loop: loss goes down, logs and checkpoint are written, --resume is exact."""

from __future__ import annotations

import json
import math
import os
import re

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
    # a run killed between checkpoints has logged steps past the checkpoint's; they run again on
    # resume and were logged twice (log.jsonl was appended to)
    with open(tmp_path / "b" / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n" + json.dumps({"step": 5, "loss": 9.0}) + "\n")
    run_train(train_args(*common, "--out-dir", str(tmp_path / "b"), "--resume"))
    logs = [[json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in "ab"]
    assert [r["step"] for r in logs[1]] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in logs[1]] == [r["loss"] for r in logs[0]]
    # time_s goes on from the checkpoint's last step (it restarted at 0 after a resume)
    times = [r["time_s"] for r in logs[1]]
    assert times == sorted(times) and times[3] > times[2] > 0, times
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["train_time_s"] >= times[-1]
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
    # the 1M recipe (issue 25 item 3): its last branch spans N, activations checkpointed
    r1m = dict(mod.RECIPES["h100-1m"], impl="torch")
    with torch.device("meta"):
        m1 = mod.build_model(r1m, "dilated", torch.device("meta"))
    assert m1.cfg.segment_lengths[-1] == r1m["seq_len"] == 1048576 and m1.cfg.checkpoint_activations
    assert mod.parse_curriculum(r1m["curriculum"])[-1] == (1048576, 1, 0)


def test_split_checkpoint_files_round_trip(tmp_path):
    """benchmarks/common.save_split: files of at most max_bytes of tensor data (a device call
    returns files of at most 16 MiB), a tensor larger than that cut in pieces, the same object
    back; a smaller later save removes the extra files of an earlier one."""
    common = _bench("common")
    obj = {"a": torch.randn(300, 100), "b": [torch.arange(7), 3, "x", (torch.ones(2, dtype=torch.bfloat16),)],
           "c": torch.tensor(5.0), "d": torch.zeros(0)}  # fmt: skip
    path = str(tmp_path / "ck.pt")
    files = common.save_split(obj, path, max_bytes=40_000)
    assert len(files) == 4 and common.split_files(path) == files
    assert all(os.path.getsize(f) < 40_000 + 4096 for f in files)
    back = common.load_split(path)
    assert torch.equal(back["a"], obj["a"]) and torch.equal(back["b"][0], obj["b"][0])
    assert back["b"][1:3] == [3, "x"] and back["b"][3][0].dtype == torch.bfloat16
    assert back["c"].item() == 5.0 and back["d"].shape == (0,)
    assert common.save_split({"x": torch.ones(3)}, path) == [path]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


def test_stdlib_trainer_pause_resume_and_presets(tmp_path):
    """train_stdlib_bytes.py: a run paused after 6 of 12 steps and resumed ends at the same step
    with the same losses and evals as one uninterrupted run, keeps the evals of its first call,
    and a finished checkpoint trains no further; the issue-25 presets construct (same size for
    every attention, the position buckets of the issue); --merge puts runs in one report."""
    mod = _bench("train_stdlib_bytes")
    base = ["--tiny", "--attention", "dilated", "--max-steps", "12", "--eval-every-steps", "4",
            "--max-minutes", "10", "--threads", "1", "--impl", "torch", "--seq-len", "256"]  # fmt: skip
    full, a, b = (str(tmp_path / n) for n in ("full", "a", "b"))
    ck = str(tmp_path / "run.pt")
    assert mod.main(base + ["--out", full]) == 0
    assert mod.main(base + ["--out", a, "--pause-after-steps", "6", "--checkpoint", ck]) == 0
    part = json.loads(open(a + ".json").read())["runs"][0]
    assert part["paused"] and part["steps"] == 6 and [e["step"] for e in part["evals"]] == [4]
    assert mod.main(base + ["--out", b, "--resume", ck, "--checkpoint", ck]) == 0
    one = json.loads(open(full + ".json").read())["runs"][0]
    two = json.loads(open(b + ".json").read())["runs"][0]
    assert two["steps"] == one["steps"] == 12 and "paused" not in two and len(two["calls"]) == 2
    assert [e["step"] for e in two["evals"]] == [4, 8, 12] and two["evals"][0] == part["evals"][0]
    assert two["train_bpb_curve"] == one["train_bpb_curve"]
    assert [e["bpb"] for e in two["evals"]] == [e["bpb"] for e in one["evals"]]
    assert mod.main(base + ["--out", b, "--resume", ck]) == 0  # finished: nothing more
    assert json.loads(open(b + ".json").read())["runs"][0]["steps"] == 12
    with pytest.raises(ValueError, match="other settings"):
        mod.main(base[:4] + ["13"] + base[5:] + ["--out", b, "--resume", ck])
    with pytest.raises(SystemExit):  # pausing needs a checkpoint path
        mod.main(base + ["--out", b, "--pause-after-steps", "1"])
    assert mod.main(["--merge", f"{full}.json,{b}.json", "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m.md").read_text().count("| dilated | 0 |") == 2

    for name, n, want in (("h100-32k", 32768, ["dilated", "dense", "local"]),
                          ("h100-128k", 131072, ["dilated", "local"])):  # fmt: skip
        s = dict(mod.PRESETS[name], impl="torch", pack=False, device="cpu")
        assert s["seq_len"] == n and s["attentions"].split(",") == want
        assert s["max_minutes"] >= (20 if n == 32768 else 14) and s["schedule"] == "cosine"
        sizes = set()
        for att in want:
            with torch.device("meta"):  # sizes and branches only: no initialisation
                model, _ = mod.build(s, att, torch.device("meta"), 0)
            sizes.add(model.num_params())
            w = list(model.cfg.segment_lengths)
            assert w == {"dilated": list(s["segments"]), "dense": [w[0]], "local": [1024]}[att]
            assert att != "dense" or w[0] >= n
        assert len(sizes) == 1 and 3e6 < sizes.pop() < 3.5e6
    assert mod.buckets(32768, 1024) == [(0, 1024), (1024, 4096), (4096, 16384), (16384, 32768)]
    bins = mod.position_bins(32768)
    assert bins[0] == (0, 1) and bins[-1][1] == 32768 and all(a < b for a, b in bins)


def test_bench_train_tiny_lengths_dense_steps_and_search(tmp_path, monkeypatch):
    """bench_train.py at a tiny size on the CPU: a --lengths list, fewer timed dense steps, and
    the search for the largest dense length that fits (out-of-memory simulated above 200)."""
    mod = _bench("bench_train")
    orig = mod.time_steps

    def oom_above_200(model, opt, n, *a, **k):
        if len(model.cfg.segment_lengths) == 1 and model.cfg.segment_lengths[0] >= n > 200:
            raise torch.OutOfMemoryError("simulated")
        return orig(model, opt, n, *a, **k)

    monkeypatch.setattr(mod, "time_steps", oom_above_200)
    assert mod.largest_fitting(128, 256, lambda n: n <= 200, 32, 4) == 192
    assert mod.largest_fitting(0, 64, lambda n: False, 32, 4) is None
    out = tmp_path / "bt"
    assert mod.main(["--tiny", "--lengths", "128,256", "--steps", "1", "--dense-steps", "1",
                     "--search-dense", "--search-grain", "32", "--threads", "1",
                     "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    got = [(r["N"], r["attention"], r.get("status"), r.get("note")) for r in rows]
    assert got == [(128, "dilated", None, None), (128, "dense", None, None),
                   (256, "dilated", None, None), (256, "dense", "OOM", None),
                   (192, "dense", None, "largest dense")]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 for r in rows if "status" not in r)
    assert "dense (largest dense)" in out.with_suffix(".md").read_text()


class _Clock:
    """A fake ``time`` for train_retrieval: one second per ``perf_counter`` reading, so that
    pauses fall on known steps and wall time decides nothing else."""

    t = 0.0

    def perf_counter(self):
        self.t += 1.0
        return self.t


def test_train_retrieval_pause_resume_equals_one_run(tmp_path, monkeypatch):
    """A run paused twice mid-stage and resumed gives the losses, steps and evals of the same
    run uninterrupted (constant schedule; a fake clock, one second per reading, so that the
    pauses fall on known steps and wall time decides nothing else)."""
    mod = _bench("train_retrieval")

    r = dict(mod.RECIPES["tiny-check"], curriculum="64:4:12,128:2:12", target=2.0, impl="torch",
             advance_loss=0.0, max_minutes=1e6, eval_every_s=1e9, stage_warmup=3, z_loss=1e-3)  # fmt: skip
    monkeypatch.setattr(mod, "time", _Clock())
    whole = mod.train_one(r, "dilated", 0, log=lambda m: None)
    ck = str(tmp_path / "ck.pt")
    monkeypatch.setattr(mod, "time", _Clock())
    part = mod.train_one(r, "dilated", 0, log=lambda m: None, pause_s=20, checkpoint=ck)
    assert part["paused"] and 0 < part["steps"] < 12
    monkeypatch.setattr(mod, "time", _Clock())
    part = mod.train_one(r, "dilated", 0, log=lambda m: None, pause_s=30, checkpoint=ck, resume=ck)
    assert part["paused"] and 12 < part["steps"] < 24  # the second pause is in the second stage
    monkeypatch.setattr(mod, "time", _Clock())
    done = mod.train_one(r, "dilated", 0, log=lambda m: None, resume=ck)
    assert done["steps"] == whole["steps"] == 24
    assert done["losses"] == whole["losses"]
    assert [s["step"] for s in done["stage_starts"]] == [s["step"] for s in whole["stage_starts"]]
    strip = [{k: v for k, v in e.items() if k != "time_s"} for e in whole["evals"]]
    assert [{k: v for k, v in e.items() if k != "time_s"} for e in done["evals"]] == strip


def test_train_retrieval_ema_evals_resume_and_checkpoint(tmp_path, monkeypatch, capsys):
    """--ema: the evals use an exponential moving average of the weights kept from the last
    stage's start (one update per step there); a run paused in that stage and resumed ends with
    the same averaged weights and evals as the run uninterrupted (the average is in the
    checkpoint); --eval-checkpoint evaluates the averaged weights; a checkpoint written before
    the setting existed resumes as ema 0; --ema 1 is refused."""
    mod = _bench("train_retrieval")

    r = dict(mod.RECIPES["tiny-check"], curriculum="64:4:6,128:2:10", target=2.0, impl="torch",
             advance_loss=0.0, max_minutes=1e6, eval_every_s=1e9, ema=0.8)  # fmt: skip
    whole_ck, ck = str(tmp_path / "whole.pt"), str(tmp_path / "ck.pt")
    monkeypatch.setattr(mod, "time", _Clock())
    whole = mod.train_one(r, "dilated", 0, log=lambda m: None, checkpoint=whole_ck)
    assert whole["steps"] == 16 and whole["eval_weights"] == "ema 0.8"
    w = mod.load_split(whole_ck, map_location="cpu")
    assert int(w["ema"]["n_averaged"]) == 10  # the last stage's steps only
    avg, trained = mod._ema_weights(w["ema"]), w["model"]
    assert avg.keys() == trained.keys()
    assert any(not torch.equal(avg[k], trained[k]) for k in avg)  # averaged, not a copy
    monkeypatch.setattr(mod, "time", _Clock())
    part = mod.train_one(r, "dilated", 0, log=lambda m: None, pause_s=30, checkpoint=ck)
    assert part["paused"] and 6 < part["steps"] < 16  # paused in the last stage
    assert mod.load_split(ck, map_location="cpu")["ema"] is not None
    monkeypatch.setattr(mod, "time", _Clock())
    done = mod.train_one(r, "dilated", 0, log=lambda m: None, checkpoint=ck, resume=ck)
    d = mod.load_split(ck, map_location="cpu")
    for k, v in w["ema"].items():
        assert torch.equal(d["ema"][k], v), k
    strip = lambda evs: [{k: v for k, v in e.items() if k != "time_s"} for e in evs]  # noqa: E731
    assert strip(done["evals"]) == strip(whole["evals"]) and done["losses"] == whole["losses"]
    # --eval-checkpoint: the averaged weights, as the run's evals
    base = ["--recipe", "tiny-check", "--impl", "torch", "--threads", "1"]
    assert mod.main(base + ["--eval-checkpoint", whole_ck, "--out", str(tmp_path / "ev")]) == 0
    ev = json.loads((tmp_path / "ev.json").read_text())["eval"]
    assert ev["weights"] == "ema" and ev["acc@128"] == whole["evals"][-1]["acc@128"]
    # a checkpoint from before --ema (no "ema" in its settings) resumes under ema 0
    old = mod.load_split(ck, map_location="cpu")
    del old["settings"]["ema"]
    assert mod._resume_mismatch(old, dict(r, ema=0.0)) is None
    assert "ema 0.0 (now 0.8)" in mod._resume_mismatch(old, r)
    with pytest.raises(SystemExit) as e:
        mod.main(base + ["--ema", "1", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "--ema must be in [0, 1)" in capsys.readouterr().err


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
        (["--checkpoint", ck, "--seeds", "0,1"], "take one --attention and one --seed"),
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


def test_train_retrieval_jittered_eval_distances_and_decay_minutes():
    """Jittered eval distances lie in (d/2, d], are the same in every call, and spread the
    planted value over the positions of a w = 1024 segment (aligned ones all sit at one
    offset); the cosine of ``decay_minutes`` reaches its floor then and stays there."""
    mod = _bench("train_retrieval")
    r = dict(mod.RECIPES["h100-512k"])
    n = r["seq_len"]
    for d in (512, 8192, 524288):
        got = [mod.eval_distance(r, d, i) for i in range(64)]
        assert got == [mod.eval_distance(r, d, i) for i in range(64)]
        assert all(d // 2 < g <= d for g in got), (d, got)
        if d >= 2048:  # offsets of the value in its 1024-segment: spread, not one place
            assert len({(n + 2 - g) % 1024 for g in got}) > 40
    assert {mod.eval_distance(dict(r, eval_positions="aligned"), 8192, i) for i in range(9)} == {8192}
    assert {mod.eval_distance(r, 6, i) for i in range(32)} == {5, 6}  # (3, 6], at least 5 * 1
    lo = r["min_lr_ratio"] if "min_lr_ratio" in r else 0.1
    f = lambda el, **kw: mod.lr_factor(dict(r, **kw), 10**6, 0, 0, el)  # noqa: E731
    assert r["decay_minutes"] == 10.0 and r["max_minutes"] == 20.0
    assert f(0.0) == pytest.approx(1.0)
    assert f(300.0) == pytest.approx(lo + (1 - lo) * 0.5)  # half of the 10 minutes
    assert f(600.0) == pytest.approx(lo) and f(1100.0) == pytest.approx(lo)
    assert f(600.0, decay_minutes=None) == pytest.approx(lo + (1 - lo) * 0.5)  # over the cap


def test_train_retrieval_eval_checkpoint_and_spike_geometry(tmp_path, capsys):
    """--eval-checkpoint evaluates a paused run's model without training (and refuses another
    model in one line); retrieval_reach.py --spikes finds the planted values of a run's steps
    (its two-hop count equals reach()'s)."""
    mod = _bench("train_retrieval")
    ck, out = str(tmp_path / "ck.pt"), str(tmp_path / "run")
    base = ["--recipe", "tiny-check", "--impl", "torch", "--threads", "1"]
    assert mod.main(base + ["--curriculum", "128:2:0", "--max-minutes", "5", "--out", out,
                            "--pause-after-minutes", "0.005", "--checkpoint", ck]) == 0  # fmt: skip
    assert mod.main(base + ["--eval-checkpoint", ck, "--out", str(tmp_path / "ev")]) == 0
    ev = json.loads((tmp_path / "ev.json").read_text())["eval"]
    assert ev["eval_positions"] == "jittered" and 0.0 <= ev["acc@128"] <= 1.0
    assert "Retrieval accuracy of a checkpoint" in (tmp_path / "ev.md").read_text()
    # every wrong answer is listed once, with its distance and the value's position
    r = mod.RECIPES["tiny-check"]
    n_eval = math.ceil(r["eval_samples"] / r["eval_batch"]) * r["eval_batch"]
    for d in r["eval_distances"]:
        ms = ev["misses"].get(f"acc@{d}", [])
        assert len(ms) == round((1 - ev[f"acc@{d}"]) * n_eval), (d, ms, ev[f"acc@{d}"])
        for dist, pos in ms:
            assert d // 2 < dist <= d and pos == r["seq_len"] + 2 - dist, (d, dist, pos)
    assert any(ev["misses"].values()), "an untrained model answered everything: no miss to check"
    # --checkpoint without a pause keeps the final model of a run that ends at its cap before
    # any periodic eval (0.12 s < eval_every_s): only the end-of-run save writes the file
    ck2 = str(tmp_path / "done.pt")
    assert mod.main(base + ["--curriculum", "128:2:0", "--max-minutes", "0.002", "--checkpoint",
                            ck2, "--out", str(tmp_path / "done")]) == 0  # fmt: skip
    saved = mod.load_split(ck2, map_location="cpu")
    assert saved["rec"]["evals"] and saved["rec"]["evals"][-1]["step"] == saved["state"]["step"]
    with pytest.raises(SystemExit) as e:
        mod.main(base + ["--eval-checkpoint", ck, "--dim", "64", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "has another model: dim 32 (recipe 64)" in capsys.readouterr().err
    reach = _bench("retrieval_reach")
    ws, rs = (16, 64, 128), (1, 2, 4)
    for d in (5, 40, 128):
        want = reach.reach(128, ws, rs, 4, [d])[0]["two_hop"]
        assert reach.two_hop_count(128, 130 - d, ws, rs, 4) == want
    # a run record with logged steps at the last stage: the table counts them
    run = json.loads(open(out + ".json").read())
    rows = [row for row in run["runs"][0]["losses"] if row[1] == 128]
    assert rows, "the paused run logged no step at the last stage"
    # --misses: the sequences the evals missed, counted per eval, with their segment offsets
    rr = dict(mod.RECIPES["tiny-check"])
    dist = mod.eval_distance(rr, 128, 0)
    ev = {"stage_n": 128, "acc@16": 1.0, "acc@128": 0.75, "misses": {"acc@128": [[dist, 130 - dist]] * 2}}
    fake = {"recipe": {k: list(v) if isinstance(v, tuple) else v for k, v in rr.items()},
            "runs": [{"attention": "dilated", "seed": 3, "evals": [ev, {**ev, "misses": {}},
                                                                  {**ev, "stage_n": 64}]}]}  # fmt: skip
    (tmp_path / "fake.json").write_text(json.dumps(fake))
    text = reach.miss_geometry(str(tmp_path / "fake.json"))
    row = next(line for line in text.splitlines() if line.startswith("| dilated seed 3 | acc@128"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:6] == ["2", "2", f"{dist}: 2", str((130 - dist) % 16)], row
    assert int(cells[6]) == reach.two_hop_count(128, 130 - dist, rr["segments"], rr["rates"], rr["n_head"])
    row16 = next(line for line in text.splitlines() if line.startswith("| dilated seed 3 | acc@16"))
    assert "| 0 | - | - |" in row16, row16
    text = reach.spike_geometry(out + ".json")
    quiet, spiky = sum(row[2] <= 1 for row in rows), sum(row[2] > 1 for row in rows)
    assert (f"| dilated seed 0 | {quiet} loss <= 1" in text) == (quiet > 0), text
    assert (f"| dilated seed 0 | {spiky} loss > 1" in text) == (spiky > 0), text


def test_retrieval_offsets_groups_and_a_saved_model(tmp_path):
    """benchmarks/retrieval_offsets.py: its 'end' distances put the value in the last END tokens
    of its first-branch segment and its 'other' ones never; it evaluates a saved model."""
    import random

    ro = _bench("retrieval_offsets")
    ends, others = ro.distances(131072, 16384, 32768, 1024, 32, 50, random.Random(0))
    assert len(ends) == len(others) == 50
    assert all(16384 < d <= 32768 for d in ends + others)
    assert all((131074 - d) % 1024 >= 992 for d in ends)
    assert all((131074 - d) % 1024 < 992 for d in others)
    mod = _bench("train_retrieval")
    ck = str(tmp_path / "ck.pt")
    assert mod.main(["--recipe", "tiny-check", "--attention", "dilated", "--impl", "torch",
                     "--threads", "1", "--curriculum", "64:4:10,128:2:10", "--target", "2",
                     "--max-minutes", "1", "--checkpoint", ck, "--out", str(tmp_path / "a")]) == 0
    res = ro.main(["--recipe", "tiny-check", "--checkpoint", ck, "--bucket", "20,128", "--n", "3",
                   "--end", "4", "--device", "cpu", "--dtype", "float32"])
    assert set(res) == {"end", "other"} and all(0 <= ok <= n == 3 for ok, n in res.values())
    with pytest.raises(SystemExit):
        ro.main(["--recipe", "tiny-check", "--checkpoint", ck, "--bucket", "200,100"])


def test_train_retrieval_hard_fraction_moves_values_late_in_their_segment(capsys, monkeypatch):
    """--hard-fraction F: with F = 1 every training row whose move stays in range has its value
    in the last eighth of its smallest-branch segment, with F = 0 the task draws the distances
    as it always did (the batches of older runs are unchanged); the draw is a function of
    (seed, step); the tensor of distances reaches the batch; F outside [0, 1] is refused."""
    mod = _bench("train_retrieval")
    r = dict(mod.RECIPES["tiny-check"], hard_fraction=1.0)
    w, n, lo = r["segments"][0], 512, r["min_distance"]
    assert w >= 8 and n > 2 * w
    d = mod.train_distances(r, n, 64, seed=3, step=5)
    assert d.shape == (64,) and bool(((d >= lo) & (d <= n)).all())
    off = mod.value_index(n, d) % w
    late = off >= w - w // 8
    assert late.float().mean() > 0.9  # the rest: moves that left [min_distance, n]
    assert torch.equal(d, mod.train_distances(r, n, 64, seed=3, step=5))
    assert not torch.equal(d, mod.train_distances(r, n, 64, seed=3, step=6))
    half = mod.train_distances(dict(r, hard_fraction=0.5), n, 256, seed=3, step=5)
    frac_late = (mod.value_index(n, half) % w >= w - w // 8).float().mean()
    assert 0.4 < frac_late < 0.75  # ~0.5 + 0.5 / 8
    assert mod.train_distances(dict(r, hard_fraction=0.0), n, 4, 3, 5) is None
    task = mod.RetrievalTask(seq_len=n, num_pairs=1, min_distance=lo, max_distance=n)
    x, y = task.batch(64, 3, 5, distance=d)
    key_pos = n + 1 - d  # the planted key, its value right after it
    for b in range(64):
        assert int(x[b, key_pos[b]]) == int(x[b, -1])  # the planted key is the queried one
        assert int(x[b, key_pos[b] + 1]) == int(y[b, -1])  # the answer is the planted value
    # train_one hands every training batch its distances (evals keep theirs: ints)
    seen, batch = [], mod.RetrievalTask.batch
    def spy(self, *a, distance=None):
        seen.append(distance)
        return batch(self, *a, distance=distance)

    monkeypatch.setattr(mod.RetrievalTask, "batch", spy)
    monkeypatch.setattr(mod, "time", _Clock())
    rr = dict(r, curriculum="64:4:3,128:2:3", target=2.0, impl="torch", advance_loss=0.0,
              max_minutes=1e6, eval_every_s=1e9)  # fmt: skip
    mod.train_one(rr, "dilated", 0, log=lambda m: None)
    train = [x for x in seen if isinstance(x, torch.Tensor)]
    assert len(train) == 6 and all(x is not None for x in seen)
    with pytest.raises(SystemExit) as e:
        mod.main(["--recipe", "tiny-check", "--hard-fraction", "1.5", "--out", "/tmp/unused"])
    assert e.value.code == 2 and "--hard-fraction must be in [0, 1]" in capsys.readouterr().err


def test_retrieval_task_takes_one_distance_per_row():
    task = RetrievalTask(seq_len=64, num_pairs=1, min_distance=8, max_distance=64)
    d = torch.tensor([8, 20, 64], dtype=torch.int32)
    x, y = task.batch(3, 0, 0, distance=d)
    for b, dist in enumerate(d.tolist()):
        assert task.key0 <= int(x[b, 64 + 1 - dist]) < task.value0
    x1, _ = task.batch(3, 0, 0, distance=torch.tensor([20, 20, 20]))
    x2, _ = task.batch(3, 0, 0, distance=20)
    assert torch.equal(x1, x2)  # a tensor of equal distances is the int
    for bad, msg in ((torch.tensor([8, 20]), "shape"), (torch.tensor([8.0, 9.0, 10.0]), "integer"),
                     (torch.tensor([8, 4, 10]), "distance 4 must be in [5, 64]")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(msg)):
            task.batch(3, 0, 0, distance=bad)
