#!/usr/bin/env bash
# The README's "Test your prefix-cache hit rate" walk-through, end to end, on this machine's CPU:
# record chat traffic through `sluice serve --record-trace`, size the pool with `sluice cache-sim`, and measure
# the engine's hit rate on the same trace with `sluice bench prefix`. Every figure the README quotes comes from
# the files this writes (default: docs/benchmarks/hit-rate/).
#
#   PATH=.venv/bin:$PATH scripts/hit_rate_walkthrough.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-docs/benchmarks/hit-rate}
PORT=${PORT:-8123}
POOL=${POOL:-1024}            # the served engine's KV pool (blocks of 16)
BENCH_POOL=${BENCH_POOL:-182} # the pool the engine replays the trace on: 128 MiB, where cache-sim shows eviction
mkdir -p "$OUT"

# 1. Serve, recording a trace; the traffic (scripts/chat_traffic.py) stands in for your users.
sluice serve --port "$PORT" --device cpu --num-kv-blocks "$POOL" --record-trace "$OUT/traffic.jsonl" \
    --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $SERVER || { cat "$OUT/serve.log"; exit 1; }
    sleep 1
done
python scripts/chat_traffic.py --base-url "http://127.0.0.1:$PORT/v1" --conversations 12 --turns 4 \
    | tee "$OUT/traffic-summary.json"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sluice:(prefix_cache|prompt_tokens|generation_tokens)' \
    > "$OUT/served-metrics.txt"
kill -INT $SERVER
wait $SERVER || true  # the trace is complete once the server has stopped

# 2. The simulator: hit rate for many pool sizes (as memory, fp32 KV as the CPU engine keeps it), one request at
#    a time in arrival order, the fake model "generating" the recorded replies.
sluice cache-sim --trace "$OUT/traffic.jsonl" --recorded-replies --max-concurrency 1 --kv-dtype fp32 \
    --kv-memory 8MiB,16MiB,32MiB,64MiB,128MiB,256MiB \
    --plot "$OUT/cache-sim.png" --out "$OUT/cache-sim.json" | tee "$OUT/cache-sim.txt"
sluice cache-sim --trace "$OUT/traffic.jsonl" --recorded-replies --max-concurrency 1 --pool-blocks "$BENCH_POOL" \
    --out "$OUT/cache-sim-bench-pool.json" | tee "$OUT/cache-sim-bench-pool.txt"

# 3. The engine on the same trace and pool: cache on and off.
sluice bench prefix --trace "$OUT/traffic.jsonl" --device cpu --num-kv-blocks "$BENCH_POOL" --max-concurrency 1 \
    --out "$OUT/bench-prefix.json" | tee "$OUT/bench-prefix.txt"
