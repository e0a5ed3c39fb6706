# Sourced by the launch scripts: sets PY to the python that runs fastclip. The project's .venv (launch/setup.sh)
# when present, so a script works without activating it; else python3 or python on PATH (an activated
# environment). torchrun is then run as `$PY -m torch.distributed.run`: the same python.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=""
for candidate in "$ROOT/.venv/bin/python" python3 python; do
  # found, not imported (an import of torch costs 2-3 s of CPU; the check that follows imports what it needs)
  if "$candidate" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("fastclip")))' \
    2>/dev/null; then PY=$candidate; break; fi
done
if [[ -z "$PY" ]]; then
  echo "launch/${0##*/}: error: found no python with torch and fastclip (tried $ROOT/.venv/bin/python, then" \
    "python3 and python on PATH); run \`bash launch/setup.sh\` first" >&2
  exit 2
fi

# count NAME VALUE: VALUE is a whole number >= 1, or the script stops with one line naming NAME (exit 2)
count() {
  if [[ ! "$2" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch/${0##*/}: error: $1 '$2' is not a number >= 1" >&2
    exit 2
  fi
}

# checks ARGS...: `$PY -m fastclip train --check ARGS` with this shell's stop signals held from here to the exec of
# the launcher (exec gives the signals back). A SIGTERM to the script alone during the checks killed it with no line
# (143); one to its process group stops the check too, which says so itself (status 75). Any status but 0 ends the
# script with it; a stop held ends it with one line (stopped_during).
checks() {
  local status=0
  stop=""
  trap 'stop=${stop:-SIGTERM}' TERM
  trap 'stop=${stop:-SIGUSR1}' USR1
  trap 'stop=${stop:-SIGINT}' INT
  "$PY" -m fastclip train --check "$@" >/dev/null || status=$?
  if [[ $status -ne 0 ]]; then exit "$status"; fi
  export FASTCLIP_CONFIG_NOTES_SAID=1  # (fastclip/train/config.py) the check said them: the run does not again
  stopped_during
}

# stopped_during: a stop signal held since `checks` began ends the script in one line, 75 (130 for SIGINT); said
# again just before the exec, for one that came after the check's end
stopped_during() {
  if [[ -n ${stop:-} ]]; then
    local code=75
    if [[ $stop == SIGINT ]]; then code=130; fi
    echo "launch/${0##*/}: stopped by $stop during the checks (config ok, nothing started); exit status $code," \
      "start the job again" >&2
    exit "$code"
  fi
}
