#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine:
#   set-up -> shards from the embedded data -> fastclip-v3 on 2 processes -> evaluation -> plots, export, summary,
#   then the compositional scenes (distinct captions): fastclip-v3 with the study's setting (configs/scenes.yaml,
#   8 of its 16 epochs) -> retrieval and zero-shot on held-out scenes and on unseen (class, colour) pairs.
#   bash launch/quickstart.sh [--section.key value ...]     (extra arguments override configs/embedded.yaml)
# Run again, it continues each run where it stopped (--train.resume latest); a run that had finished and been
# evaluated trains and evaluates nothing again, and its summary is printed; RUN=... / SCENES_RUN=... start new ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate

DATA=data/embedded
if [ ! -f "$DATA/zeroshot.json" ]; then
    fastclip data embedded --out "$DATA"
fi
trained_steps() {  # the last training step run $1 logged (0 before its first)
    python -c 'import json, sys
rows = [json.loads(x) for x in open(sys.argv[1])] if __import__("os").path.isfile(sys.argv[1]) else []
print(max([r["step"] for r in rows if "loss" in r] or [0]))' "$1/metrics.jsonl"
}
already_done() {  # run $1 trained nothing now ($2: its steps before) and holds the evaluations of an earlier call
    [ "$(trained_steps "$1")" = "$2" ] && [ -s "$1/checkpoints/results.jsonl" ]
}

RUN=${RUN:-runs/quickstart-fastclip-v3}
export OMP_NUM_THREADS=1   # two processes on two cores: one thread each, or they fight for the cores
STARTED=$SECONDS
BEFORE=$(trained_steps "$RUN")
# (launch/single_node.sh: the config and data checks first, so a bad override is one line and status 2)
bash launch/single_node.sh configs/embedded.yaml 2 --train.run_dir "$RUN" --train.resume latest "$@"
TRAIN_SECONDS=$((SECONDS - STARTED))
if already_done "$RUN" "$BEFORE"; then
    echo "$RUN: finished and evaluated by an earlier call; nothing to train or evaluate (RUN=... starts a new run)"
    TIMING=()  # the summary takes the training time from the run's own log, not this call's seconds
else
    fastclip eval "$RUN" --data "$DATA"
    # training curves and the open_clip-loadable model, in the run folder; their paths are in the summary
    fastclip plot "$RUN" --out "$RUN/plots" > /dev/null
    fastclip export "$RUN" --out "$RUN/export/model.pt" > /dev/null
    TIMING=(--train-seconds "$TRAIN_SECONDS")
fi
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
BEFORE=$(trained_steps "$SCENES_RUN")
bash launch/single_node.sh configs/scenes.yaml 2 --train.run_dir "$SCENES_RUN" --train.resume latest --train.epochs 8 \
    --loss.gamma_decay_epochs 4 --optim.warmup_steps 37
if already_done "$SCENES_RUN" "$BEFORE"; then
    echo "$SCENES_RUN: finished and evaluated by an earlier call; nothing to train or evaluate (SCENES_RUN=... starts"
    echo "a new run); its evaluations on test and novel are in $SCENES_RUN/checkpoints/results.jsonl"
    echo
    fastclip summary "$SCENES_RUN"
    exit 0
fi
echo "scenes: trained in $((SECONDS - STARTED)) s"
for split in test novel; do  # novel: each scene holds a (class, colour) pair never seen in training
    echo
    echo "== scenes, $split split"
    fastclip eval "$SCENES_RUN" --data "$SCENES/$split" --classnames "$SCENES/zeroshot.json"
done
