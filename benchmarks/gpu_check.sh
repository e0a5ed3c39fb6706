#!/usr/bin/env bash
# The GPU checks of issue 14 in one call, for a session that is lent a GPU machine (which reaches no registry):
# the CUDA-only tests, then fastclip against OpenCLIP's trainer on one GPU (NCCL, bf16, ViT-B-32, 256 per step).
#
#   bash benchmarks/gpu_check.sh prepare   # here, where pip reaches PyPI: wheels -> .whl/, shards -> .gpu/embedded
#   bash benchmarks/gpu_check.sh run       # there (the repo root, torch with CUDA installed): logs and tables -> $OUT
#
# With the device tool: run(command="bash benchmarks/gpu_check.sh run", carry=[".whl", ".gpu"], timeout_s=540).
# Every step has its own time limit and its own log, so one that fails or hangs still leaves the others' results.
# `run` on a machine without CUDA stops at once (exit 2).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DATA=.gpu/embedded
# fastclip's requirements that the GPU image lacks (its torch, torchvision, timm, transformers, numpy, pillow,
# pyyaml, tqdm, pytest, matplotlib and pandas are used as they are); pure-Python wheels, any Python 3.
WHEELS=(open_clip_torch==3.3.0 webdataset==0.2.86 braceexpand ftfy wcwidth)

case "${1:-}" in
prepare)
    set -e
    mkdir -p .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "${WHEELS[@]}"
    # 200 training samples per class (4,000 pairs: a run of 51,200 samples goes round them 13 times) and 1,000
    # held out, about 21 MB: the working tree and all it carries travel within 64 MiB
    [ -f "$DATA/train/manifest.json" ] || .venv/bin/python -m fastclip data embedded --out "$DATA" --max-per-class 200
    du -sh .whl "$DATA"
    ;;
run)
    OUT=${OUT:-gpu-check-out}
    mkdir -p "$OUT"
    if ls .whl/*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
        export PYTHONPATH=/tmp/site:$PWD
    else
        export PYTHONPATH=$PWD
    fi
    # the environment, and the stop for a machine without CUDA
    "$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys, torch
import fastclip.train.cli, webdataset  # noqa: F401  (the wheels resolved)
from fastclip.compat import import_open_clip
open_clip = import_open_clip()
import open_clip_train.main  # noqa: F401  (OpenCLIP's trainer, bench_e2e's peer)
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| open_clip", open_clip.__version__)
if not torch.cuda.is_available():
    print("gpu_check: torch sees no CUDA device: run this on the GPU machine", file=sys.stderr)
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", "| bf16", torch.cuda.is_bf16_supported(),
      "| nccl", torch.distributed.is_nccl_available())
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || exit 2
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/env.txt" 2>&1
    status=0
    step() {  # step NAME SECONDS COMMAND...: the command's output to $OUT/NAME.log, its exit status kept
        local name=$1 limit=$2
        shift 2
        echo "== $name (limit ${limit}s)"
        local start=$SECONDS
        timeout --kill-after 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
        local rc=$?
        tail -n 15 "$OUT/$name.log"
        echo "== $name: exit $rc after $((SECONDS - start)) s"
        [ "$rc" = 0 ] || status=1
    }
    # the files of the tests that skip without CUDA (TF32/cudnn defaults, channels_last RN towers, the loss's exact
    # float32 under TF32 and autocast, the fused Triton kernels against the eager loss), less the one test that
    # writes shards from the offline datasets, which are not there
    step cuda_tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -o tmp_path_retention_policy=none \
        tests/test_gpu_defaults.py tests/test_losses_autocast.py tests/test_losses_fused.py \
        -k "not test_training_with_channels_last_follows_the_nchw_run"
    # end to end on one GPU: OpenCLIP's trainer (amp_bf16) against ours (bf16 autocast), ViT-B-32, 256 per step
    step e2e_gpu 360 "$PY" benchmarks/bench_e2e.py --arch ViT-B-32 --batch 256 --precision bf16 --device cuda \
        --nproc 1 --workers 6 --samples 51200 --reps 1 --data "$DATA" --out "$OUT"
    exit $status
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh prepare|run (see the comment at its top)" >&2
    exit 2
    ;;
esac
