#!/usr/bin/env bash
# Create ./.venv (once) and install the package into it with the extras in SETUP_EXTRAS
# (default "plot,progress", plus "triton" where a CUDA GPU is visible: the CPU needs triton only
# for the interpreter tests, which scripts/test.sh installs through the "test" extra).
# torch is installed FIRST and pinned (torch==2.13.0, CPU wheel on the dev/CI machines) so that
# pip never resolves a bare `torch` to a multi-GB CUDA build. A python that already has torch
# (e.g. a GPU image) is reused through --system-site-packages.
# Quiet on success; prints pip's output (minus the environment's configuration warnings) on
# failure. The install is skipped when pyproject.toml is what the last successful install used,
# the extras asked for are among those installed (stamp file .venv/.setup-stamp) and the package
# still imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
log=$(mktemp)
trap 'rm -f "$log"' EXIT

quiet() {  # run "$@" with its output held back; show it only if the command fails
  if ! "$@" >"$log" 2>&1; then
    grep -v -e '^WARNING: Location' -e 'is ignored' -e '^WARNING: Ignoring invalid distribution' \
      -e '^\[notice\]' "$log" >&2 || true
    echo "setup_env.sh: failed: $*" >&2
    return 1
  fi
}

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  quiet "$VPY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
if [ -z "${SETUP_EXTRAS:-}" ]; then
  SETUP_EXTRAS="plot,progress"
  if "$VPY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
    SETUP_EXTRAS="triton,$SETUP_EXTRAS"
  fi
fi
stamp=.venv/.setup-stamp
hash="$("$VPY" -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")"
# The stamp holds the pyproject hash and the extras installed so far. A request for extras that
# are all installed already (bench.sh's "plot,progress" after test.sh's "test,plot,progress")
# installs nothing; otherwise the union is installed, so that alternating scripts do not
# reinstall each time.
installed=""
if [ -f "$stamp" ] && [ "$(cut -d' ' -f1 "$stamp")" = "$hash" ]; then
  installed="$(sed -n 's/^[^ ]* \[\(.*\)\]$/\1/p' "$stamp")"
fi
# the extras asked for, in the order asked, then those installed before and not asked for now
union="$(printf '%s\n' "${SETUP_EXTRAS//,/$'\n'}" "${installed//,/$'\n'}" | sed '/^$/d' | awk '!seen[$0]++' | paste -sd, -)"
sorted() { printf '%s\n' "${1//,/$'\n'}" | sed '/^$/d' | sort -u | paste -sd, -; }
if [ -n "$installed" ] && [ "$(sorted "$union")" = "$(sorted "$installed")" ] \
  && "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('dilated_attention') is None)" 2>/dev/null; then
  exit 0
fi
quiet "$VPY" -m pip install -q -e ".[$union]"
printf '%s [%s]\n' "$hash" "$union" >"$stamp"
echo "setup: installed dilated-attention[$union] into .venv"
