#!/usr/bin/env bash
# Every figure in the serving sections of docs/bench/log/2026-12-serving.md, in one run on a quiet machine:
#   1. the headline comparison (Subway vs static batching vs transformers), one workload;
#   2. the Subway rows again, for the run-to-run spread;
#   3. a request-rate sweep of Subway continuous vs Subway static, with plots;
#   4. the profiles and kernel tables of "What made it fast, and what holds it back".
# Outputs land in docs/bench/ and docs/img/. Takes about 50 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p docs/bench docs/img
python -m subway.tools.bench.compare --out docs/bench/compare.json 2>&1 | tee docs/bench/compare.log
python -m subway.tools.bench.compare --skip static,hf,cb --out docs/bench/compare_repeat.json \
  2>&1 | tee docs/bench/compare_repeat.log

p1=18101; p2=18102
subway serve --port $p1 --dtype bfloat16 --threads 2 --max-model-len 2048 --allow-client-priority \
  --dist-init-addr 127.0.0.1:18111 > /tmp/sweep-cb.log 2>&1 &
s1=$!
subway serve --port $p2 --dtype bfloat16 --threads 2 --max-model-len 2048 --policy static \
  --allow-client-priority \
  --static-batch-window-ms 500 --dist-init-addr 127.0.0.1:18112 > /tmp/sweep-static.log 2>&1 &
s2=$!
trap 'kill $s1 $s2 2>/dev/null; wait' EXIT
for port in $p1 $p2; do
  for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
done
python -m subway.tools.bench.sweep --url subway=http://127.0.0.1:$p1 \
  --url subway-static=http://127.0.0.1:$p2 --rates 1,2,4,8,inf --num-requests 32 \
  --out-dir docs/img 2>&1 | tee docs/bench/sweep.log
kill $s1 $s2 2>/dev/null; wait 2>/dev/null || true
trap - EXIT
python -m subway.tools.bench.profile_run 2>&1 | tee docs/bench/profile_run.log
python -m subway.tools.bench.profile_step --dtype bfloat16 --batch 64 --context 256 2>&1 | tee docs/bench/profile_bf16.log
python -m subway.tools.bench.profile_step --dtype float32 --batch 64 --context 256 2>&1 | tee docs/bench/profile_fp32.log
python -m subway.tools.bench.profile_step --dtype bfloat16 --batch 4 --context 128 2>&1 | tee docs/bench/profile_bf16_b4.log
python -m subway.tools.bench.bench_linear 2>&1 | tee docs/bench/linear.log
python -m subway.tools.bench.bench_decode_kernel 2>&1 | tee docs/bench/decode_kernel.log
