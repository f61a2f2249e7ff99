#!/usr/bin/env bash
# One prepared GPU check: Triton kernels against their references (error, time), greedy
# equality with transformers, engine throughput on Llama-3-8B shapes, and the 8-bit paths
# (`--sections quant`: --quantization int8 and --kv-cache-dtype int8). See tools/gpu_check.py.
#
#   tools/gpu_check.sh             on a machine with a CUDA GPU (under 8 minutes)
#   tools/gpu_check.sh --dry-run   on the CPU: tiny sizes, Triton interpreted, no CUDA parts
#
# The full log goes to $OUT/gpu_check.log when OUT is set (else ./gpu_check.log); the
# short table is printed last. Works from a plain checkout: when `subway` is not installed,
# a throwaway package tree of links to this checkout is put on PYTHONPATH.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then export TRITON_INTERPRET=1; fi
done

if ! "$py" -c "import subway.kernels.dispatch" 2>/dev/null; then
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  mkdir "$site/subway"
  cp subway_pkg/__init__.py "$site/subway/__init__.py"
  for d in frontend scheduler worker ipc tools; do ln -s "$repo/$d" "$site/subway/$d"; done
  ln -s "$repo/subway_kernels" "$site/subway/kernels"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
missing="$("$py" - <<'PY'
import importlib.util
need = ["torch", "triton", "numpy", "msgspec", "safetensors", "transformers"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)"
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages: $missing (carry them as wheels)" >&2
  exit 2
fi
log="${OUT:+$OUT/gpu_check.log}"
exec timeout -k 10 480 "$py" -m subway.tools.gpu_check --log "${log:-gpu_check.log}" "$@"
