#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine:
#   set-up -> shards from the embedded data -> fastclip-v3 on 2 processes -> evaluation -> plots, export, summary.
#   bash launch/quickstart.sh [--section.key value ...]     (extra arguments override configs/embedded.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate

DATA=data/embedded
if [ ! -f "$DATA/zeroshot.json" ]; then
    fastclip data embedded --out "$DATA"
fi
RUN=${RUN:-runs/quickstart-fastclip-v3}
export OMP_NUM_THREADS=1   # two processes on two cores: one thread each, or they fight for the cores
STARTED=$SECONDS
torchrun --standalone --nproc_per_node 2 -m fastclip train -- --config configs/embedded.yaml \
    --train.run_dir "$RUN" "$@"
TRAIN_SECONDS=$((SECONDS - STARTED))
fastclip eval "$RUN" --data "$DATA"
# training curves and the open_clip-loadable model, in the run folder; their paths are in the summary
fastclip plot "$RUN" --out "$RUN/plots" > /dev/null
fastclip export "$RUN" --out "$RUN/export/model.pt" > /dev/null
echo
fastclip summary "$RUN" --train-seconds "$TRAIN_SECONDS" --plots "$RUN/plots" --export "$RUN/export/model.pt"
