#!/usr/bin/env bash
# The container's entrypoint: `docker run IMAGE train --config ...` runs `fastclip train --config ...`; a command of
# its own (torchrun, bash launch/single_node.sh ..., python) runs as given; no arguments: fastclip's help.
set -euo pipefail
if [[ $# -eq 0 ]]; then
  exec fastclip --help
fi
if command -v -- "$1" >/dev/null 2>&1; then
  exec "$@"
fi
exec fastclip "$@"
