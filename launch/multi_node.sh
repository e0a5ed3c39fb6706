#!/usr/bin/env bash
# On every node:  NNODES=2 MASTER_ADDR=node01 bash launch/multi_node.sh configs/cc3m-fastclip-v3.yaml [--key value ...]
#
# Several nodes with torchrun's c10d rendezvous: start the same command on each node (any order); ranks are
# assigned at rendezvous. MASTER_ADDR is a host every node reaches (e.g. the first node); NPROC defaults to
# the node's GPU count. The run folder (train.run_dir) must be on a filesystem all nodes share.
set -euo pipefail
if [[ $# -lt 1 || "$1" == --* || -z "${NNODES:-}" || -z "${MASTER_ADDR:-}" ]]; then
  echo "usage: NNODES=N MASTER_ADDR=host bash launch/multi_node.sh CONFIG [--section.key value ...]" \
    "(MASTER_ADDR: the rendezvous host, e.g. the first node)" >&2
  exit 2
fi
CONFIG=$1
shift
MASTER_PORT=${MASTER_PORT:-29500}
source "$(dirname "$0")/python.sh"  # PY: the python with torch and fastclip
NPROC=${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count() or 1)')}
count NNODES "$NNODES"
count NPROC "$NPROC"
RDZV_ID=${RDZV_ID:-fastclip-$(basename "$CONFIG" .yaml)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
# the config, data and checkpoint checks first, in this shell: an error is then one line and exit status 2
# (from inside torchrun it would be followed by torchrun's own ChildFailedError traceback and status 1)
checks --world-size "$(( NNODES * NPROC ))" --config "$CONFIG" "$@"
# torchrun through fastclip.train.launcher: SIGTERM/SIGUSR1 to it reach the ranks (a checkpoint, then status 75),
# and the job's status is the ranks' (75 after such a stop), without torchrun's traceback
stopped_during  # (one after the check's end, held until here)
exec "$PY" -m fastclip.train.launcher --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
  -m fastclip train -- --config "$CONFIG" "$@"
