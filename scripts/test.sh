#!/usr/bin/env bash
# Set up (.venv) and run the whole CPU test suite. Triton kernels run under TRITON_INTERPRET=1,
# distributed tests spawn real gloo processes. Extra args go to pytest. The "test" extra brings
# everything the tests need (pytest plugins, triton for the interpreter tests, transformers, ...).
#   bash scripts/test.sh                 everything
#   bash scripts/test.sh -m "not slow"   without the long cases (marked slow); README gives both times
set -uo pipefail
cd "$(dirname "$0")/.."
SETUP_EXTRAS=test,plot,progress bash scripts/setup_env.sh || { echo "setup failed"; exit 1; }
.venv/bin/python -m pytest -q -rs --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: the setup is broken, not a pass"
  exit 1
fi
exit "$rc"
