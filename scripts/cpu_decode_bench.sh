#!/usr/bin/env bash
# Batch-1 decode and 512-token prefill of the default model on the CPU (issue 41), the old path and the new one
# side by side, alternating in one command so a noisy machine moves both alike; compare ratios within a round.
#   old: fp32 (the CPU's dtype before), and bf16 dense (--dtype bfloat16, the issue's 23.9 tok/s figure)
#   new: --quantization auto (int4 on the GGUF's Q4_1 blocks, bf16 activations, packed kernels, CPU kernels)
# at OMP_NUM_THREADS=2 and 1 (THREADS="2 1"); each run's JSON under OUT, with `uptime` beside each figure (the
# machine's load).
#
#   scripts/cpu_decode_bench.sh [ROUNDS] [OUTPUT_LEN]     # defaults: 3 256
#   THREADS=1 scripts/cpu_decode_bench.sh 2 64            # a shorter run at one thread
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
THREADS=${THREADS:-2 1}
OUTPUT_LEN=${2:-256}
OUT=${OUT:-docs/benchmarks/cpu_decode}
SLUICE=${SLUICE:-.venv/bin/sluice}
mkdir -p "$OUT"
declare -A FLAGS=([fp32]="--dtype float32" [bf16]="--dtype bfloat16" [auto]="--quantization auto")
for i in $(seq "$ROUNDS"); do
    for threads in $THREADS; do
        for path in fp32 bf16 auto; do
            # shellcheck disable=SC2086
            OMP_NUM_THREADS=$threads $SLUICE bench latency --device cpu --batch-size 1 --input-len 128 \
                --output-len "$OUTPUT_LEN" --num-iters 2 --num-iters-warmup 1 ${FLAGS[$path]} \
                --out "$OUT/decode_${path}_t${threads}_$i.json" | grep -E "ms_per_output_token|decode_step_median" |
                tr -s ' ' | tr '\n' ' ' | sed "s/^/decode $path, $threads threads, round $i: /"
            echo "| $(uptime | sed 's/.*load/load/')"
            # shellcheck disable=SC2086
            OMP_NUM_THREADS=$threads $SLUICE bench latency --device cpu --batch-size 1 --input-len 512 \
                --output-len 1 --num-iters 3 --num-iters-warmup 1 ${FLAGS[$path]} \
                --out "$OUT/prefill512_${path}_t${threads}_$i.json" | grep -E "prefill_median" |
                tr -s ' ' | tr '\n' ' ' | sed "s/^/prefill-512 $path, $threads threads, round $i: /"
            echo "| $(uptime | sed 's/.*load/load/')"
        done
    done
done
