#!/usr/bin/env bash
# bash launch/single_node.sh configs/embedded.yaml 2 [--section.key value ...]
#
# One node, NPROC processes (default: one per GPU, or 2 on a CPU-only machine). Extra arguments are config
# overrides. The "--" after `train` keeps torchrun from claiming flags of ours that prefix-match its own.
set -euo pipefail
if [[ $# -lt 1 || "$1" == --* ]]; then
  echo "usage: bash launch/single_node.sh CONFIG [NPROC] [--section.key value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
source "$(dirname "$0")/python.sh"  # PY: the python with torch and fastclip
NPROC=${1:-}
if [[ -n "$NPROC" && "$NPROC" != --* ]]; then shift; else NPROC=""; fi
if [[ -z "$NPROC" ]]; then
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
count NPROC "$NPROC"
# one intra-op thread pool per process, sized so the processes do not fight over the cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
# the config, data and checkpoint checks first, in this shell: an error is then one line and exit status 2
# (from inside torchrun it would be followed by torchrun's own ChildFailedError traceback and status 1)
checks --world-size "$NPROC" --config "$CONFIG" "$@"
# torchrun through fastclip.train.launcher: SIGTERM/SIGUSR1 to it reach the ranks (a checkpoint, then status 75),
# and the job's status is the ranks' (75 after such a stop), without torchrun's traceback
stopped_during  # (one after the check's end, held until here)
exec "$PY" -m fastclip.train.launcher --standalone --nproc_per_node "$NPROC" -m fastclip train -- --config "$CONFIG" "$@"
