#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: bash launch/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q "$@"
