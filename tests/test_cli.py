"""CLI smoke tests: each subcommand runs, prints its table, and writes what it promises."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from dilated_attention.cli import build_parser, main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "reference, torch" in out


@pytest.mark.slow  # every impl x dtype x case vs the reference (~45 s on 2 cores)
def test_verify_passes_on_cpu(tmp_path, capsys):
    assert main(["verify", "--json", str(tmp_path / "v.json")]) == 0
    cap = capsys.readouterr()
    out = cap.out
    assert "all passed" in out and "FAIL" not in out
    data = json.loads((tmp_path / "v.json").read_text())
    assert len(data["rows"]) >= 8
    # one progress line per (case, causal, dtype) on stderr as it ends, numbered to the total,
    # naming each impl's result; none on stdout (the table stays the only thing there)
    progress = [line for line in cap.err.splitlines() if line.startswith("verify ")]
    impls = sorted({r[0] for r in data["rows"]})
    assert len(progress) * len(impls) == len(data["rows"])
    assert progress[-1].startswith(f"verify {len(progress)}/{len(progress)}: ")
    assert all(f"{i} ok" in line for line in progress for i in impls)
    assert not any(line.startswith("verify 1/") for line in out.splitlines())


def test_bench_small(tmp_path, capsys):
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    # --impls torch: under TRITON_INTERPRET=1 (tests/conftest.py) triton would also run, slowly
    rc = main(["bench", "--seqlens", "256", "--causal", "false", "true", "--iters", "1", "--warmup", "0",
               "--impls", "torch", "--markdown", str(md), "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dense SDPA" in out and "torch" in out
    res = json.loads(js.read_text())["results"]
    assert {r["impl"] for r in res} >= {"dense SDPA", "torch"} and all(r["fwd_tflops"] > 0 for r in res)
    assert "command" in md.read_text()
    # CPU rows: GFLOP/s with significant digits (not 0.0 TFLOP/s), memory said to be n/a
    assert "GFLOP/s" in out and "TFLOP/s" not in out and "peak memory: n/a on the CPU" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("256 ")]
    assert len(rows) == len(res) == 4 and all(float(r[-1]) > 0 for r in rows)


def test_verify_dtype_short_names():
    """Parse-only: test_verify_passes_on_cpu runs verify itself (float32 on the CPU)."""
    for name, dtype in (("fp32", torch.float32), ("BF16", torch.bfloat16), ("half", torch.float16)):
        assert build_parser().parse_args(["verify", "--dtype", name]).dtype is dtype


def test_bench_bool_and_branch_parsing():
    ns = build_parser().parse_args(["bench", "--causal", "False", "1", "yes", "--segments", "8", "16",
                                    "--dilations", "1", "2"])
    assert ns.causal == [False, True, True] and ns.segments == [8, 16] and ns.dilations == [1, 2]


BAD = [
    (["bench", "--causal", "maybe"], "argument --causal: 'maybe' is not a bool"),
    (["bench", "--headdim", "0"], "argument --headdim: '0' must be a positive integer"),
    (["bench", "--heads", "-2"], "argument --heads: '-2' must be a positive integer"),
    (["bench", "--seqlens", "0"], "argument --seqlens: '0' must be a positive integer"),
    (["bench", "--batch", "two"], "argument --batch: 'two' is not an integer"),
    (["bench", "--iters", "0"], "argument --iters"),
    (["bench", "--warmup", "-1"], "argument --warmup: '-1' must be 0 or more"),
    (["bench", "--segments", "8", "16", "--dilations", "1"], "--segments has 2 values but --dilations has 1"),
    (["bench", "--segments", "8", "16"], "--segments given without --dilations"),
    (["bench", "--segments", "8", "--dilations", "16"], "dilation rate 16 > segment length 8"),
    (["bench", "--impls", "fast"], "argument --impls: invalid choice: 'fast'"),
    (["bench", "--dtype", "fp33"], "argument --dtype: 'fp33' is not a dtype"),
    (["verify", "--dtype", "int8"], "argument --dtype: 'int8' is not a dtype"),
    (["info", "--device", "gpu0"], "argument --device: 'gpu0' is not a device"),
    (["train", "--steps", "0"], "argument --steps: '0' must be a positive integer"),
    (["train", "--resume", "--overwrite"], "--resume and --overwrite contradict"),
]
# output folders are checked before the (long) run, not when the results are written
for _cmd, _opt in (("bench", "--json"), ("bench", "--markdown"), ("bench", "--plot"), ("verify", "--json")):
    BAD.append(([_cmd, _opt, "/nonexistent-folder-da/out.x"], f"{_opt} /nonexistent-folder-da/out.x: the folder"))
BAD.append((["bench", "--json", "/"], "--json / is a folder"))
# a format matplotlib cannot write failed after the whole run
BAD.append((["bench", "--plot", "/tmp/plot.txt"], "--plot /tmp/plot.txt: the extension must be one of"))
if not torch.cuda.is_available():
    BAD.append((["bench", "--device", "cuda"], "argument --device: 'cuda': no CUDA GPU is available here"))
    BAD.append((["verify", "--device", "cuda:0"], "no CUDA GPU is available here"))


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # one line: no usage block, no traceback
    last = err.strip()
    assert last.startswith(f"dilated-attention {argv[0]}: error: ") and message in last, err
    assert last.endswith(f"(see dilated-attention {argv[0]} --help)"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_through_the_console():
    """A real process: status 2, one error line, no traceback (the case a user hits first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "dilated_attention", "bench", "--device", "cuda"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("dilated-attention bench: error: argument --device")


def _subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


@pytest.mark.parametrize("cmd", ["info", "verify", "bench", "train"])
def test_every_option_has_help_and_its_default(cmd):
    sub = _subparsers(build_parser())[cmd]
    text = sub.format_help()
    assert "``" not in text and "SPEC" not in text
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{cmd} {action.option_strings} has no help"
        shown = action.default is not None and not isinstance(action, argparse._StoreTrueAction)
        if shown:
            assert "default" in sub._get_formatter()._get_help_string(action), action.option_strings
    assert "default" in text


def test_module_entry_point_help_is_plain_text():
    """``python -m dilated_attention --help`` (one process: the entry point and its help text)."""
    r = subprocess.run([sys.executable, "-m", "dilated_attention", "--help"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0 and "verify" in r.stdout
    assert "``" not in r.stdout and "docs/spec.md" in r.stdout
