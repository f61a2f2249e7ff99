#!/usr/bin/env bash
# Subway against llama.cpp's server, same model (bfloat16), same workload, same concurrency.
#
# No prebuilt llama-server is installable here, so this builds one from the llama.cpp sources
# vendored in the PyPI sdist of llama-cpp-python (CPU only, native, ~10 min on 2 cores, cached
# under ~/.cache/subway/llama.cpp), converts the default model to a bfloat16 GGUF file with
# llama.cpp's own converter, then runs tools/bench/bench_serving.py against each server in turn.
#   tools/bench/bench_llamacpp.sh        (SLOTS_LIST="16 64": the concurrencies compared;
#                                          TAG=_x: results as docs/bench/llamacpp_x_c16.json ...)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=${SUBWAY_CACHE:-$HOME/.cache/subway}/llama.cpp
mkdir -p "$root" docs/bench
if [ ! -x "$root/build/bin/llama-server" ]; then
  python -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$root"
  tar xzf "$root"/llama_cpp_python-0.3.36.tar.gz -C "$root"
  src="$root/llama_cpp_python-0.3.36/vendor/llama.cpp"
  cmake -S "$src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$root/build" --target llama-server -j"$(nproc)" >/dev/null
fi
model=$(python -c "from subway.worker.default_model import ensure_default_model as e; print(e())")
gguf="$root/SmolLM2-135M-Instruct-bf16.gguf"
if [ ! -f "$gguf" ]; then
  python -m pip install --quiet sentencepiece  # llama.cpp's converter imports it
  PYTHONPATH="$root/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py" python \
    "$root/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" "$model" \
    --outtype bf16 --outfile "$gguf" >/dev/null
fi
python -m subway.tools.bench.workload --num-requests 64 --seed 0 --rate inf --out /tmp/llamacpp-wl.jsonl
for conc in ${SLOTS_LIST:-16 64}; do
  "$root/build/bin/llama-server" -m "$gguf" --port 18201 -np "$conc" -c $((conc * 2048)) \
    -t "$(nproc)" --no-webui > /tmp/llama-server.log 2>&1 &
  lpid=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:18201/health >/dev/null && break; sleep 1; done
  python -m subway.tools.bench.bench_serving --base-url http://127.0.0.1:18201 \
    --workload /tmp/llamacpp-wl.jsonl --max-concurrency "$conc" --out "docs/bench/llamacpp${TAG:-}_c$conc.json"
  kill $lpid; wait $lpid 2>/dev/null || true
  subway serve --port 18202 --dtype bfloat16 --threads "$(nproc)" --max-num-seqs "$conc" \
    --max-model-len 2048 --dist-init-addr 127.0.0.1:18203 > /tmp/subway-vs-llamacpp.log 2>&1 &
  spid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18202/health >/dev/null && break; sleep 1; done
  python -m subway.tools.bench.bench_serving --base-url http://127.0.0.1:18202 \
    --workload /tmp/llamacpp-wl.jsonl --max-concurrency "$conc" --out "docs/bench/subway${TAG:-}_c$conc.json"
  kill $spid; wait $spid 2>/dev/null || true
done
