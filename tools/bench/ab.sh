#!/usr/bin/env bash
# Throughput of this tree against an earlier commit, side by side in one run:
#   tools/bench/ab.sh REV [ROUNDS]
# Checks REV out into a temporary folder with its own virtual environment (the
# machine's packages, REV's Subway), then alternates the two for ROUNDS rounds
# (default 2) of the headline workload's Subway row (`compare --skip static,hf,cb`,
# bfloat16), then the scheduler's cost per step, then the offline run profile.
# Prints every figure; the JSON of each serving run lands in $OUT (default /tmp/subway-ab).
# BASE_CACHE=DIR runs the base with SUBWAY_CACHE=DIR, so that the two sides do not rebuild
# each other's kernels in a shared cache.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: tools/bench/ab.sh REV [ROUNDS]}
rounds=${2:-2}
out=${OUT:-/tmp/subway-ab}
base=$(mktemp -d /tmp/subway-ab-base.XXXXXX)
trap 'rm -rf "$base"' EXIT
mkdir -p "$out"
git worktree add --detach -q "$base/src" "$rev"
trap 'git worktree remove --force "$base/src"; rm -rf "$base"' EXIT
python -m venv --system-site-packages "$base/venv"
"$base/venv/bin/pip" install --quiet --no-deps -e "$base/src"
old="$base/venv/bin/python"
if [ -n "${BASE_CACHE:-}" ]; then # the base's own cache (its compiled kernels, the default model)
  printf '#!/bin/sh\nSUBWAY_CACHE=%s exec %s "$@"\n' "$BASE_CACHE" "$old" > "$base/py"
  chmod +x "$base/py"
  old="$base/py"
fi
# The modules moved in the structure change: use whichever path the commit has.
mod() { # PYTHON NAME -> its module path
  if "$1" -c "import subway.tools.bench.$2" 2>/dev/null; then echo "subway.tools.bench.$2"
  else echo "subway.tools.$2"; fi
}
for i in $(seq "$rounds"); do
  for side in base this; do
    py=python; [ "$side" = base ] && py=$old
    echo "== round $i: $side"
    (cd /tmp && "$py" -m "$(mod "$py" compare)" --skip static,hf,cb --subway-dtypes bfloat16 \
      --out "$out/compare-$side-$i.json") | grep -E "tok/s|continuous" || true
  done
done
for side in base this; do
  py=python; [ "$side" = base ] && py=$old
  echo "== scheduler cost per step: $side"
  (cd /tmp && "$py" -m "$(mod "$py" bench_scheduler)" --sizes 64 256 --steps 600 --repeat 2)
  echo "== offline run: $side"
  (cd /tmp && "$py" -m "$(mod "$py" profile_run)")
done
