#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite: bash launch/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ruff check .           # lint (rules in pyproject.toml); fails on any violation
.venv/bin/ruff format --check .  # formatting; `ruff format .` fixes it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# bytecode once, for the suite's hundreds of fresh interpreters (~0.5 s each without it, when the environment sets
# PYTHONDONTWRITEBYTECODE as ours does)
.venv/bin/python -m compileall -q -j 0 fastclip benchmarks >/dev/null
# one worker per core by default (FASTCLIP_TEST_WORKERS=0: in this process); a test file runs on one worker, so its
# module fixtures (a 2-process training run shared by its tests) are built once
WORKERS=${FASTCLIP_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}  # (nproc obeys OMP_NUM_THREADS)
exec .venv/bin/python -m pytest -q --durations=15 -n "$WORKERS" --dist loadfile "$@"
