"""``dilated-attention train`` and ``python -m dilated_attention.train`` keep the command line's
promise: one parser, one set of checks, and every bad input exits with status 2 and one line,
before anything is written (issue 26, item 7)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dilated_attention import train
from dilated_attention.cli import main as cli_main


# (argv with {tmp} for the test's folder, two parts of the one error line)
BAD = [
    (["--text-file", "{tmp}/missing.txt"], "--text-file", "no such file"),
    (["--text-file", "{tmp}/empty.txt"], "has 0 bytes", "needs at least 514"),
    (["--text-file", "{tmp}/short.txt", "--seq-len", "64"], "has 100 bytes", "needs at least 130"),
    (["--min-distance", "100", "--max-distance", "50"], "--min-distance 100 > max distance --max-distance 50", ""),
    (["--seq-len", "7"], "--seq-len 7 is shorter than the min distance 8", "tiny preset's --min-distance"),
    (["--max-distance", "300"], "--max-distance 300 > --seq-len 256", ""),
    (["--num-pairs", "2", "--min-distance", "8"], "min distance --min-distance 8 < 5 x num pairs = 10", ""),
    (["--num-pairs", "17"], "--num-pairs 17 > 16", ""),
    (["--eval-distances", "2,64"], "--eval-distances [2] < 5 x num pairs", ""),
    (["--eval-distances", "64,x"], "argument --eval-distances: 'x' is not an integer", ""),
    # given distances longer than the sequence were dropped without a word (the preset's are cut)
    (["--eval-distances", "16,1000"], "--eval-distances [1000] > --seq-len 256", ""),
    (["--out-dir", "{tmp}/short.txt"], "--out-dir", "short.txt is a file, not a directory"),
    (["--out-dir", "{tmp}/short.txt/run"], "--out-dir", "cannot be created: "),
    (["--lr", "nan"], "argument --lr: 'nan' must be a finite number", ""),
    (["--lr", "0"], "argument --lr: '0' must be a positive number", ""),
    (["--grad-clip", "-5"], "argument --grad-clip: '-5' must be a positive number", ""),
    (["--min-lr-ratio", "7"], "argument --min-lr-ratio: '7' must be between 0 and 1", ""),
    (["--weight-decay", "-2"], "argument --weight-decay: '-2' must be 0 or more", ""),
    (["--steps", "-5"], "argument --steps: '-5' must be a positive integer", ""),
    (["--warmup", "-1"], "argument --warmup: '-1' must be 0 or more", ""),
    (["--resume", "--out-dir", "{tmp}/nothing"], "--resume: no checkpoint at", "ckpt.pt"),
]
if not torch.cuda.is_available():
    BAD.append((["--impl", "triton"], "--impl triton needs a CUDA GPU", "--impl auto or torch"))


@pytest.mark.parametrize("entry", ["cli", "module"])
@pytest.mark.parametrize("argv, msg1, msg2", BAD, ids=[" ".join(a).replace("{tmp}/", "") for a, _, _ in BAD])
def test_bad_train_input_exits_2_with_one_line(entry, argv, msg1, msg2, tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out-dir" not in argv:
        argv = [*argv, "--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        if entry == "cli":
            cli_main(["train", *argv])
        else:
            train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # one line: no usage block, no traceback
    last = err.strip()
    assert last.startswith("dilated-attention train: error: ") and msg1 in last and msg2 in last, err
    assert not (tmp_path / "out").exists()  # nothing written


def test_run_train_checks_too(tmp_path):
    """run_train is public: it raises the same one-line errors (ValueError) before writing."""
    ns = train.build_parser().parse_args(["--seq-len", "7", "--out-dir", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--seq-len 7 is shorter than the min distance 8"):
        train.run_train(ns)
    assert not (tmp_path / "o").exists()


def test_module_entry_point_checks_like_the_cli():
    """A real ``python -m dilated_attention.train --steps -5``: status 2, one line (it used to
    exit 0 with final_loss null)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "dilated_attention.train", "--steps", "-5"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == (
        "dilated-attention train: error: argument --steps: '-5' must be a positive integer "
        "(see dilated-attention train --help)\n"
    )


def test_one_parser_for_both_entry_points():
    """The subcommand and the module declare the same flags with the same types and defaults."""
    from dilated_attention.cli import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    pt, pm = sub.choices["train"], train.build_parser()

    def spec(p):
        return {a.dest: (tuple(a.option_strings), a.type, a.default, a.choices) for a in p._actions}

    assert spec(pt) == spec(pm)


def test_help_shows_each_preset_default():
    text = " ".join(train.build_parser().format_help().split())  # argparse wraps lines
    for name, preset in train.TRAIN_PRESETS.items():
        assert f"{name} {preset['seq_len']}" in text
        assert f"{name} {preset['steps']}" in text


def test_nccl_nvls_is_not_set_without_the_flag(monkeypatch):
    """The library sets no environment variable unless the user asks (--nccl-nvls)."""
    import inspect

    src = inspect.getsource(train._init_sp)
    assert "setdefault" not in src
    assert train.build_parser().parse_args([]).nccl_nvls is None
    assert train.build_parser().parse_args(["--nccl-nvls", "off"]).nccl_nvls == "off"


def test_resume_errors_exit_2_with_one_line(tmp_path, capsys):
    """--resume from a checkpoint of another model or data, or from an unreadable file: one line
    naming what differs (or the file), status 2 (they were tracebacks with status 1)."""
    from dilated_attention.cli import main as cli

    run = ["train", "--preset", "tiny", "--seq-len", "64", "--batch-size", "4", "--min-distance", "8",
           "--max-distance", "64", "--eval-distances", "16,64", "--eval-samples", "4", "--impl", "torch",
           "--no-progress", "--no-plot", "--threads", "1", "--device", "cpu", "--out-dir", str(tmp_path)]  # fmt: skip
    assert cli([*run, "--steps", "2", "--eval-every", "2"]) == 0
    capsys.readouterr()
    for extra, want in ((["--attention", "dense"], "was written with other model or data settings"),
                        (["--batch-size", "8"], "batch_size 4 -> 8"),
                        (["--seed", "7"], "seed 0 -> 7"),
                        ([], "cannot read the checkpoint")):  # fmt: skip
        if not extra:
            (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
        with pytest.raises(SystemExit) as e:
            cli([*run, "--steps", "4", "--eval-every", "2", "--resume", *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert err.startswith("dilated-attention train: error: --resume: ") and want in err, err
