#!/usr/bin/env bash
# Prefill/decode disaggregation on two GPUs (issue 24's GPU half): a DisaggEngine pair (prefill on cuda:0,
# decode on cuda:1) against two independent engines (one per GPU, requests split evenly), dummy:llama3-8b,
# ShareGPT with 10% of ~8k-token prompts, the same Poisson arrivals, at a few request rates. Each rate writes
# docs/benchmarks/disagg/h200x2_rate<R>.json and prints TTFT / ITL / TPOT percentiles and the ratios
# (itl_p99_gain = split / pair, > 1: the pair is better; ttft_median_ratio = pair / split).
#
#   scripts/disagg_gpu_bench.sh                 # rates 2 4 6 8
#   RATES="6" NUM_PROMPTS=300 scripts/disagg_gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-"2 4 6 8"}
NUM_PROMPTS=${NUM_PROMPTS:-600}
OUT=${OUT:-docs/benchmarks/disagg}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/machine.txt"
for rate in $RATES; do
  .venv/bin/sluice bench disagg --model dummy:llama3-8b --prefill-device cuda:0 --decode-device cuda:1 \
      --dataset sharegpt --num-prompts "$NUM_PROMPTS" --request-rate "$rate" \
      --long-fraction 0.1 --long-len 7936 --long-output-len 128 --max-model-len 8192 \
      --out "$OUT/h200x2_rate${rate}.json"
done
