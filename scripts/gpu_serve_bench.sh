#!/usr/bin/env bash
# Issue 23's serving figures on the GPU machine: `sluice serve` (front end and engine core in two processes)
# with dummy:llama3-8b, driven by `sluice bench serve` over loopback; results under $OUT.
#
#   PYTHONPATH=... scripts/gpu_serve_bench.sh           # throughput config: offline, then served at inf and 16 req/s
#   PYTHONPATH=... scripts/gpu_serve_bench.sh latency   # latency config (512-token steps): served at 16 req/s
#
# Needs the server's wheels installed (starlette, uvicorn, ...). .stage/sharegpt1000.json: the requests of
# scripts/gpu_engine_bench.sh (a file, so no tokenizer is needed).
#
# The latency config caps a step at 512 tokens (chunked prefill), the step size the mixed-step CUDA graphs
# cover by default: a long prompt's prefill then delays every running stream's next token by one such step
# (~15 ms of device time on this model) instead of one of up to 8,192 tokens.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
REQ=$PWD/.stage/sharegpt1000.json
PORT=${PORT:-8011}
MODE=${1:-throughput}
BUDGET=8192
[ "$MODE" = latency ] && BUDGET=512
if [ "$MODE" = throughput ]; then
    # the same build offline on the same requests first: the served figure is compared with this one (issue 23)
    timeout 200 python -m sluice.app.commands.cli bench throughput --model dummy:llama3-8b --requests-file "$REQ" --num-prompts 1000 \
        --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/offline_tp1000.json" 2>&1 | grep -E "output_tokens_per_s|num_finished"
fi
python -m sluice.app.commands.cli serve --model dummy:llama3-8b --max-num-seqs 512 --max-num-batched-tokens $BUDGET \
    --port "$PORT" >"$OUT/serve_$MODE.log" 2>&1 &
server=$!
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
echo "server up after ${SECONDS}s"
bench() { timeout 200 python -m sluice.app.commands.cli bench serve --base-url "http://127.0.0.1:$PORT" --requests-file "$REQ" "$@"; }
if [ "$MODE" = throughput ]; then
    bench --num-prompts 1000 --request-rate inf --out "$OUT/serve_inf.json" 2>&1 | tail -14
    bench --num-prompts 200 --request-rate 16 --out "$OUT/serve_16rps.json" 2>&1 | tail -14
else
    bench --num-prompts 200 --request-rate 16 --out "$OUT/serve_16rps_latency.json" 2>&1 | tail -14
fi
kill -TERM $server; wait $server
if [ "$MODE" = throughput ]; then
    python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/offline_tp1000.json"))["output_tokens_per_s"]
served = json.load(open(f"{out}/serve_inf.json"))
tok = served.get("output_throughput") or served.get("output_tokens_per_s")
print(f"served / offline, same call: {tok:.0f} / {offline:.0f} = {tok / offline:.3f}")
PY
fi
