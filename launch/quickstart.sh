#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine:
#   set-up -> shards from the embedded data -> fastclip-v3 on 2 processes -> evaluation -> plots, export, summary,
#   then the compositional scenes (distinct captions): fastclip-v3 with the study's setting (configs/scenes.yaml,
#   8 of its 16 epochs) -> retrieval and zero-shot on held-out scenes and on unseen (class, colour) pairs.
#   bash launch/quickstart.sh [--section.key value ...]     (extra arguments override configs/embedded.yaml)
# Run again, it continues each run where it stopped (--train.resume latest) and evaluates only what an earlier call
# has not evaluated at the run's last step (launch/run_state.py); RUN=... / SCENES_RUN=... start new ones.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    case "$arg" in --train.run_dir|--train.run_dir=*)
        echo "launch/quickstart.sh: $arg: the run folder is RUN=... (RUN=runs/mine bash launch/quickstart.sh)" >&2
        exit 2;;
    esac
done
bash launch/setup.sh
. .venv/bin/activate

DATA=data/embedded
if [ ! -f "$DATA/zeroshot.json" ]; then
    fastclip data embedded --out "$DATA"
fi

RUN=${RUN:-runs/quickstart-fastclip-v3}
export OMP_NUM_THREADS=1   # two processes on two cores: one thread each, or they fight for the cores
STARTED=$SECONDS
BEFORE=$(python launch/run_state.py steps "$RUN")
# (launch/single_node.sh: the config and data checks first, so a bad override is one line and status 2)
bash launch/single_node.sh configs/embedded.yaml 2 --train.run_dir "$RUN" --train.resume latest "$@"
TIMING=()  # a resumed run's time: its steps' own, from its log (this call's seconds would be only its share)
[ "$BEFORE" = 0 ] && TIMING=(--train-seconds "$((SECONDS - STARTED))")
if python launch/run_state.py evaluated "$RUN" "$DATA"; then
    echo "$RUN: evaluated on $DATA at its last step by an earlier call (its checkpoints/results.jsonl)"
else
    fastclip eval "$RUN" --data "$DATA"
fi
# training curves and the open_clip-loadable model, in the run folder; their paths are in the summary
fastclip plot "$RUN" --out "$RUN/plots" > /dev/null
fastclip export "$RUN" --out "$RUN/export/model.pt" > /dev/null
echo
fastclip summary "$RUN" ${TIMING[@]+"${TIMING[@]}"} --plots "$RUN/plots" --export "$RUN/export/model.pt"

echo
echo "== scenes: 6,000 compositional scenes with distinct captions; fastclip-v3 at global batch 64 with the"
echo "   setting the statistical-efficiency study chose (configs/scenes.yaml), 8 of its 16 epochs"
SCENES=data/scenes
if [ ! -f "$SCENES/zeroshot.json" ]; then
    fastclip data embedded --source scenes --out "$SCENES" --num-train 6000 --num-val 500 --num-test 2000 \
        --num-novel 1000
fi
SCENES_RUN=${SCENES_RUN:-runs/quickstart-scenes}
STARTED=$SECONDS
BEFORE=$(python launch/run_state.py steps "$SCENES_RUN")
bash launch/single_node.sh configs/scenes.yaml 2 --train.run_dir "$SCENES_RUN" --train.resume latest --train.epochs 8 \
    --loss.gamma_decay_epochs 4 --optim.warmup_steps 37
[ "$BEFORE" = 0 ] && echo "scenes: trained in $((SECONDS - STARTED)) s"
for split in test novel; do  # novel: each scene holds a (class, colour) pair never seen in training
    echo
    echo "== scenes, $split split"
    if python launch/run_state.py evaluated "$SCENES_RUN" "$SCENES/$split"; then
        echo "evaluated at its last step by an earlier call (in $SCENES_RUN/checkpoints/results.jsonl)"
    else
        fastclip eval "$SCENES_RUN" --data "$SCENES/$split" --classnames "$SCENES/zeroshot.json"
    fi
done
echo
fastclip summary "$SCENES_RUN"
