#!/usr/bin/env bash
# Set up (.venv) and run the whole CPU test suite. Triton kernels run under TRITON_INTERPRET=1,
# distributed tests spawn real gloo processes. Extra args go to pytest. The "test" extra brings
# everything the tests need (pytest plugins, triton for the interpreter tests, transformers, ...).
#   bash scripts/test.sh                 everything
#   bash scripts/test.sh -m "not slow"   without the long cases (marked slow); README gives both times
set -uo pipefail
cd "$(dirname "$0")/.."
SETUP_EXTRAS=test,plot,progress bash scripts/setup_env.sh || { echo "setup failed"; exit 1; }
# TEST_WORKERS (default 2, this project's 2-core CI machine) pytest-xdist processes, each test
# file in one of them (--dist loadfile: a file's tests run in order in one process); one torch
# thread each (OMP_NUM_THREADS, unless set), so the processes do not fight for the cores.
# TEST_WORKERS=0: one process, as before.
workers=${TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  .venv/bin/python -m pytest -q -rs --durations=15 "$@"
else
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -q -rs --durations=15 -n "$workers" --dist loadfile "$@"
fi
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: the setup is broken, not a pass"
  exit 1
fi
exit "$rc"
