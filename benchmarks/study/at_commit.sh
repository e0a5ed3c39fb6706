#!/usr/bin/env bash
# Run a study's cells at the code its tables started with, while main moves on (a table takes runs of one code only;
# the code key covers fastclip/ and configs/, not benchmarks/):
#   bash benchmarks/study/at_commit.sh COMMIT DIR      e.g. 42a1147 /work/wt/study (study v2's batch-32 table)
#   cd DIR && .venv/bin/python -m benchmarks.study run benchmarks/study/v2.yaml --cell ... --parallel 2
# Makes DIR a worktree at COMMIT (kept if there) with this tree's study package and specs, this tree's .venv, and
# this tree's study folders (benchmarks/out/<study>, benchmarks/results/<study>/runs and timing.json for each of
# STUDIES) linked in: finished runs land here, ready to commit. Re-run it after changing the package here.
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: bash benchmarks/study/at_commit.sh COMMIT DIR" >&2; exit 2; }
commit=$1 dir=$2
main=$(cd "$(dirname "$0")/../.." && pwd)
git -C "$main" rev-parse --verify --quiet "$commit^{commit}" >/dev/null || {
  echo "at_commit.sh: $commit is no commit of $main: name one the tables' runs record (run JSON \"commit\")" >&2; exit 2; }
[[ -d $main/.venv ]] || { echo "at_commit.sh: no $main/.venv: run \`bash launch/setup.sh\` first" >&2; exit 2; }
if [[ ! -e $dir ]]; then
  git -C "$main" worktree add --quiet --detach "$dir" "$commit"
fi
at=$(git -C "$dir" rev-parse HEAD)
[[ $at == $(git -C "$main" rev-parse "$commit^{commit}") ]] || {
  echo "at_commit.sh: $dir is at ${at:0:12}, not $commit: name another DIR" >&2; exit 2; }
cp "$main"/benchmarks/study/*.py "$main"/benchmarks/study/*.yaml "$dir/benchmarks/study/"
# commits before 2026-11-29 have no mean_r1 / mean_top1 in fastclip: the runner gets the same arithmetic locally
if ! grep -q "def mean_r1" "$dir/fastclip/eval/retrieval.py"; then
  "$main/.venv/bin/python" - "$dir/benchmarks/study/runner.py" <<'EOF'
import sys
from pathlib import Path

path = Path(sys.argv[1])
old = "from fastclip.eval.retrieval import mean_r1\nfrom fastclip.eval.zeroshot import mean_top1\n"
new = '''

def mean_r1(values: dict) -> float | None:  # (at_commit.sh: fastclip at this commit has none)
    keys = ("retrieval/image_to_text_R@1", "retrieval/text_to_image_R@1")
    return sum(values[k] for k in keys) / 2 if all(k in values for k in keys) else None


def mean_top1(values: dict) -> float | None:  # (at_commit.sh: fastclip at this commit has none)
    tops = [v for k, v in values.items() if k.startswith("zeroshot/") and k.endswith("/top1")]
    return sum(tops) / len(tops) if tops else None
'''
text = path.read_text()
assert old in text, f"{path}: the imports at_commit.sh replaces are gone; update at_commit.sh"
path.write_text(text.replace(old, new))
EOF
fi
link() {  # $1: a path relative to the repository root, made a link to this tree's
  mkdir -p "$main/$1" "$(dirname "$dir/$1")"
  if [[ -L $dir/$1 ]]; then return; fi
  if [[ -d $dir/$1 ]]; then
    # only what the worktree made (untracked): its commit's tracked records may be ones this tree has since moved
    # to stale/ or off the grid, and must not come back
    (cd "$dir" && git ls-files --others -z -- "$1") | while IFS= read -r -d '' file; do
      [[ -e $main/$file ]] || { mkdir -p "$(dirname "$main/$file")" && cp "$dir/$file" "$main/$file"; } || exit 1
    done || { echo "at_commit.sh: could not copy $dir/$1's untracked files into $main/$1: nothing linked" >&2; exit 2; }
    rm -rf "${dir:?}/$1"
  fi
  ln -sT "$main/$1" "$dir/$1"
}
[[ -e $dir/.venv ]] || ln -s "$main/.venv" "$dir/.venv"
STUDIES="study_v2 study_v2_revisits"  # the specs' `name`s (v2.yaml, v2-revisits.yaml)
for study in $STUDIES; do
  link "benchmarks/out/$study"
  link "benchmarks/results/$study/runs"
  # the timing run's figures too: `plan --hours` here would price the unrun batches from the commit's old ones
  timing="benchmarks/results/$study/timing.json"
  if [[ -e $main/$timing && ! -L $dir/$timing ]]; then
    mkdir -p "$(dirname "$dir/$timing")" && ln -sfT "$main/$timing" "$dir/$timing"
  fi
done
code=$(cd "$dir" && .venv/bin/python -c "from benchmarks.study import records; print(records.code_version()['code'])")
echo "$dir: commit ${at:0:12}, code $code, with $main's study package; runs land in $main/benchmarks/results/<study>/runs ($STUDIES)"
