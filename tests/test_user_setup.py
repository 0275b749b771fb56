"""What a new user runs first: the README's CPU quick start, scripts/setup_env.sh, the test
suite's skip messages and warning filters."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, f"no python block under '## {heading}'"
    return m.group(1)


def test_readme_cpu_quick_start_runs_as_written(tmp_path):
    code = _readme_block("Quick start on a laptop (CPU)")
    assert "cuda" not in code
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # a user's laptop: not the test suite's interpreter mode
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # the printed shapes are the ones the README's comments promise
    promised = re.findall(r"# (torch\.Size\(.*)$", code, re.M)
    assert r.stdout.splitlines() == [p.strip() for p in promised], (r.stdout, promised)


def test_readme_cites_the_users_spec():
    text = (ROOT / "README.md").read_text()
    assert "docs/spec.md" in text
    assert "SPEC section" not in text and "shared/SPEC" not in text


# --------------------------------------------------------------------------- setup_env.sh
SHIM = """#!/usr/bin/env bash
# stands in for .venv/bin/python: records pip calls, answers everything else with the real python
echo "$*" >> "$SHIM_LOG"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "WARNING: Location '/nowhere/site-packages' is ignored" >&2
  echo "Successfully installed something"
  if [ -n "${SHIM_PIP_FAIL:-}" ]; then echo "ERROR: boom" >&2; exit 1; fi
  exit 0
fi
exec "%s" "$@"
"""


@pytest.fixture
def fake_checkout(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup_env.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(SHIM % sys.executable)
    (venv_bin / "python").chmod(0o755)
    return tmp_path


def _setup(checkout, **env):
    log = checkout / "calls.log"
    full = {k: v for k, v in os.environ.items() if k != "SETUP_EXTRAS"}
    full.update(SHIM_LOG=str(log), PYTHONPATH=os.pathsep.join(sys.path), CUDA_VISIBLE_DEVICES="", **env)
    before = log.read_text() if log.exists() else ""
    r = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=checkout, capture_output=True,
                       text=True, timeout=280, env=full)
    calls = (log.read_text() if log.exists() else "")[len(before):]
    pips = [c for c in calls.splitlines() if c.startswith("-m pip")]
    return r, pips


@pytest.mark.slow  # five venv setups (10 s)
def test_setup_env_quiet_and_skips_when_nothing_changed(fake_checkout):
    r, pips = _setup(fake_checkout)
    assert r.returncode == 0, r.stderr
    assert pips == ["-m pip install -q -e .[plot,progress]"]  # CPU: no triton, no test tools
    assert r.stderr == "" and r.stdout == "setup: installed dilated-attention[plot,progress] into .venv\n"

    r, pips = _setup(fake_checkout)  # nothing changed: no pip, no output
    assert r.returncode == 0 and pips == [] and r.stdout == "" and r.stderr == ""

    with open(fake_checkout / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    r, pips = _setup(fake_checkout)
    assert r.returncode == 0 and len(pips) == 1

    r, pips = _setup(fake_checkout, SETUP_EXTRAS="test,plot,progress")  # what scripts/test.sh asks
    assert r.returncode == 0 and pips == ["-m pip install -q -e .[test,plot,progress]"]


def test_setup_env_shows_pip_errors_without_config_noise(fake_checkout):
    r, _ = _setup(fake_checkout, SHIM_PIP_FAIL="1")
    assert r.returncode != 0
    assert "ERROR: boom" in r.stderr and "WARNING: Location" not in r.stderr
    assert not (fake_checkout / ".venv" / ".setup-stamp").exists()  # a failed install is retried


def test_test_script_installs_the_test_extra_and_keeps_exit_5():
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert "SETUP_EXTRAS=test" in text and '"$rc" -eq 5' in text
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["test"])  # the interpreter tests need it
    assert any(d.startswith("triton") for d in extras["triton"])
    assert (ROOT / ".ci" / "run").read_text().count("scripts/test.sh") == 1


# ------------------------------------------------------------------ the suite's own messages
def test_gpu_skip_reason_is_user_language():
    from conftest import CUDA_SKIP_REASON

    assert CUDA_SKIP_REASON == "needs a CUDA GPU"


def test_warning_filters_are_specific():
    filters = _pyproject()["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters
    for f in filters:
        action, message, *rest = f.split(":", 2)
        assert action == "ignore" and message and rest and rest[0], f"blanket filter: {f!r}"
