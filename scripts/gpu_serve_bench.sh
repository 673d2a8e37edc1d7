#!/usr/bin/env bash
# Issue 23's serving figures on the GPU machine: `sluice serve` (front end and engine core in two processes)
# with dummy:llama3-8b, driven by `sluice bench serve` over loopback; results under $OUT.
#
#   PYTHONPATH=... scripts/gpu_serve_bench.sh   # needs the server's wheels installed (starlette, uvicorn, ...)
#
# .stage/sharegpt1000.json: the requests of scripts/gpu_engine_bench.sh (a file, so no tokenizer is needed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
REQ=$PWD/.stage/sharegpt1000.json
PORT=${PORT:-8011}
# the same build offline on the same requests first: the served figure is compared with this one (issue 23)
timeout 200 python -m sluice.app.cli bench throughput --model dummy:llama3-8b --requests-file "$REQ" --num-prompts 1000 \
    --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/offline_tp1000.json" 2>&1 | grep -E "output_tokens_per_s|num_finished"
python -m sluice.app.cli serve --model dummy:llama3-8b --max-num-seqs 512 --max-num-batched-tokens 8192 \
    --port "$PORT" >"$OUT/serve.log" 2>&1 &
server=$!
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
echo "server up after ${SECONDS}s"
bench() { timeout 200 python -m sluice.app.cli bench serve --base-url "http://127.0.0.1:$PORT" --requests-file "$REQ" "$@"; }
bench --num-prompts 1000 --request-rate inf --out "$OUT/serve_inf.json" 2>&1 | tail -14
bench --num-prompts 200 --request-rate 16 --out "$OUT/serve_16rps.json" 2>&1 | tail -14
kill -TERM $server; wait $server
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/offline_tp1000.json"))["output_tokens_per_s"]
served = json.load(open(f"{out}/serve_inf.json"))
tok = served.get("output_throughput") or served.get("output_tokens_per_s")
print(f"served / offline, same call: {tok:.0f} / {offline:.0f} = {tok / offline:.3f}")
PY
