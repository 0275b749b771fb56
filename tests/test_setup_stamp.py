"""scripts/setup_env.sh installs once: running the README's two commands one after the other
(bench.sh asks for "plot,progress", test.sh for "test,plot,progress") does not reinstall the
package each time. pip is replaced by a recorder; no venv is built."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _checkout(tmp: pathlib.Path) -> pathlib.Path:
    root = tmp / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup_env.sh", root / "scripts")
    shutil.copy(REPO / "pyproject.toml", root)
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "python"
    # the real interpreter for -c, a recorder for "-m pip install"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "$(dirname "$0")/../pip.log"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    return root


def _setup(root: pathlib.Path, extras: str) -> list[str]:
    env = dict(os.environ, SETUP_EXTRAS=extras, PYTHONPATH=str(REPO / "src"), CUDA_VISIBLE_DEVICES="")
    subprocess.run(["bash", "scripts/setup_env.sh"], cwd=root, env=env, check=True, timeout=120,
                   capture_output=True)
    log = root / ".venv" / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.slow  # six setups, each starting python with torch a few times
def test_alternating_bench_and_test_setups_install_once_each_set(tmp_path):
    root = _checkout(tmp_path)
    assert len(_setup(root, "plot,progress")) == 1  # bench.sh: first install
    assert len(_setup(root, "test,plot,progress")) == 2  # test.sh: one more (the union)
    assert "progress" in _setup(root, "test,plot,progress")[-1]  # the union keeps bench's extras
    for extras in ("plot,progress", "test,plot,progress", "plot,progress"):
        assert len(_setup(root, extras)) == 2  # nothing more: every extra is installed
