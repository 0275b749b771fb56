#!/usr/bin/env bash
# Create ./.venv (once) and install the package with its test/plot/progress extras.
# torch is installed FIRST and pinned (torch==2.13.0, CPU wheel on the dev/CI machines) so that
# pip never resolves a bare `torch` to a multi-GB CUDA build. A python that already has torch
# (e.g. a GPU image) is reused through --system-site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
# extras: triton (kernels, interpreter tests on CPU), matplotlib (plots), tqdm (progress), pytest
"$VPY" -m pip install -q -e ".[test,plot,progress]" 2>&1 | grep -v -e "^WARNING: Location" -e "is ignored" || true
"$VPY" -c "import torch, dilated_attention; print('setup ok: torch', torch.__version__, '| dilated_attention', dilated_attention.__version__)"
