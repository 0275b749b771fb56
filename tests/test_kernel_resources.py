"""benchmarks/kernel_resources.py: launches recorded under the interpreter, compiled for sm_90
without a GPU, registers read from the cubin (a fresh process: the compile phase must not
interpret)."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_parse_config():
    import kernel_resources as kr

    assert kr.parse_config(None) is None
    assert kr.parse_config("dkdv=64,64,4,1; dq=128,64,8,3") == {"dkdv": (64, 64, 4, 1),
                                                                "dq": (128, 64, 8, 3)}


@pytest.mark.timeout(600)
def test_one_sequence_forward_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "res.md"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_resources.py"),
                        "--what", "one", "--causal", "no", "--kernels", "dilated_fwd_folded_kernel",
                        "--out", str(out), "--sass", str(tmp_path / "sass")],
                       env=env, capture_output=True, text=True, timeout=580)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| one |")]
    assert len(rows) == 1, out.read_text()  # one launch: the folded non-causal forward
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "dilated_fwd_folded_kernel" and "BM=128, BN=64" in cells[2], cells
    assert cells[4:6] == ["8", "3"], cells  # the GPU's config, not the interpreter's blocks
    assert 32 <= int(cells[7]) <= 255, cells  # registers per thread, read from the cubin
    assert re.fullmatch(r"\d+", cells[8]), cells
    (sass,) = (tmp_path / "sass").iterdir()  # --sass: the variant's SASS, with its tensor-core MMAs
    assert sass.name == "one_dilated_fwd_folded_kernel_0.sass"
    assert "HGMMA" in sass.read_text() or "HMMA" in sass.read_text()
