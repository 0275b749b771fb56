#!/usr/bin/env bash
# Set up (.venv) and run the main job: `dilated-attention bench` with its defaults
# (small sizes on CPU; LongNet-like sizes on a GPU). Extra args go to the bench command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/dilated-attention bench "$@"
