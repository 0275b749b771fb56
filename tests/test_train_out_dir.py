"""`train` never silently writes over an earlier run: an --out-dir holding one needs --resume or
--overwrite."""

from __future__ import annotations

import json

import pytest

from dilated_attention.cli import main
from dilated_attention.train import RUN_FILES, check_out_dir

FAST = ["--seq-len", "64", "--batch-size", "4", "--min-distance", "8", "--max-distance", "64",
        "--eval-distances", "16,64", "--eval-samples", "8", "--impl", "torch", "--no-progress",
        "--no-plot", "--threads", "2", "--steps", "2", "--warmup", "1", "--eval-every", "2"]


def test_check_out_dir(tmp_path):
    check_out_dir(str(tmp_path / "new"), resume=False, overwrite=False)  # missing: fine
    check_out_dir(str(tmp_path), resume=False, overwrite=False)  # empty: fine
    (tmp_path / "notes.txt").write_text("mine")
    check_out_dir(str(tmp_path), resume=False, overwrite=False)  # no run files: fine
    for name in RUN_FILES:
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_text("x")
        with pytest.raises(FileExistsError, match=f"already holds a run \\({name}\\).*--resume.*--overwrite"):
            check_out_dir(str(d), resume=False, overwrite=False)
        check_out_dir(str(d), resume=True, overwrite=False)
        check_out_dir(str(d), resume=False, overwrite=True)
    with pytest.raises(ValueError, match="contradict"):
        check_out_dir(str(tmp_path), resume=True, overwrite=True)


def test_train_refuses_then_overwrites(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *FAST, "--out-dir", str(out)]) == 0
    first = (out / "log.jsonl").read_text()
    (out / "loss.png").write_text("stale plot of the first run")
    with pytest.raises(SystemExit) as e:
        main(["train", *FAST, "--out-dir", str(out), "--seed", "1"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dilated-attention train: error: --out-dir") and "--resume" in last
    assert (out / "log.jsonl").read_text() == first  # untouched
    # run_train itself refuses too (it is public API, not only the CLI's)
    from dilated_attention.train import run_train

    ns = _ns(*FAST, "--out-dir", str(out))
    with pytest.raises(FileExistsError, match="already holds a run"):
        run_train(ns)
    assert main(["train", *FAST, "--out-dir", str(out), "--seed", "1", "--overwrite"]) == 0
    assert not (out / "loss.png").exists()  # --no-plot: the old run's plot is gone, not left stale
    assert (out / "log.jsonl").read_text() != first
    assert json.loads((out / "config.json").read_text())["args"]["seed"] == 1


def _ns(*argv):
    import argparse

    from dilated_attention.train import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p.parse_args(list(argv))
