#!/usr/bin/env bash
# Run a study's cells at the code its tables started with, while main moves on (a table takes runs of one code only;
# the code key covers fastclip/ and configs/, not benchmarks/):
#   bash benchmarks/study/at_commit.sh COMMIT DIR [SPEC ...]   e.g. 42a1147 /work/wt/study (v2's batch-32 table)
#   cd DIR && .venv/bin/python -m benchmarks.study run benchmarks/study/v2.yaml --cell ... --parallel 2
# Makes DIR a worktree at COMMIT (kept if there) with this tree's study package and specs, this tree's .venv, and
# this tree's study folders linked in (each spec's work folder, results/runs and timing.json, for every spec in
# benchmarks/study/ and each SPEC named, relative to this tree's root or absolute): finished runs land here, ready
# to commit. Re-run it after changing the package here.
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: bash benchmarks/study/at_commit.sh COMMIT DIR [SPEC ...]" >&2; exit 2; }
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
# every study spec of this tree (benchmarks/study/*.yaml, and each SPEC named): its work folder, its results' runs/
# and timing.json (the timing run's figures: `plan --hours` there would price unrun batches from the commit's old
# ones), as paths inside this tree; a folder outside it is the same folder from the worktree
notes=$(mktemp)
listed=$(cd "$main" && .venv/bin/python - "${@:3}" 2>"$notes" <<'EOF'
import glob
import sys
from pathlib import Path

from benchmarks.study.spec import load

root = Path.cwd().resolve()
for path in dict.fromkeys(sorted(glob.glob("benchmarks/study/*.yaml")) + sys.argv[1:]):
    try:
        spec = load(path)
    except Exception as error:  # noqa: BLE001 - a spec that does not load has nothing to link; said
        print(f"at_commit.sh: note: {path}: its folders are not linked ({error})", file=sys.stderr)
        continue
    for kind, folder in (("dir", spec.work), ("dir", spec.results / "runs"), ("file", spec.results / "timing.json")):
        if folder.resolve().is_relative_to(root):
            print(f"{kind} {spec.name} {folder.resolve().relative_to(root)}")
EOF
) || { echo "at_commit.sh: could not list the study specs' folders ($(tail -n 1 "$notes")): nothing linked" >&2
       rm -f "$notes"; exit 2; }
cat "$notes" >&2 && rm -f "$notes"  # (a spec that does not load: its note)
mapfile -t shared <<<"$listed"
names=()
for entry in "${shared[@]}"; do
  [[ -n $entry ]] || continue
  read -r kind name path <<<"$entry"
  [[ " ${names[*]} " == *" $name "* ]] || names+=("$name")
  if [[ $kind == dir ]]; then
    link "$path"
  elif [[ -e $main/$path && ! -L $dir/$path ]]; then
    mkdir -p "$(dirname "$dir/$path")" && ln -sfT "$main/$path" "$dir/$path"
  fi
done
[[ ${#names[@]} -gt 0 ]] || {
  echo "at_commit.sh: no study spec of $main/benchmarks/study (or named) loads: nothing linked; fix the notes above" >&2
  exit 2; }
code=$(cd "$dir" && .venv/bin/python -c "from benchmarks.study import records; print(records.code_version()['code'])")
echo "$dir: commit ${at:0:12}, code $code, with $main's study package; the runs of ${names[*]} land in $main"
