#!/usr/bin/env bash
# Issue 40 on a two-GPU machine: `sluice serve --data-parallel-size 2 --data-parallel-backend ray` (one
# dummy:llama3-8b replica per GPU) against one replica (`--data-parallel-size 1`, the same Ray path), ShareGPT 1000
# at an infinite request rate through `sluice bench serve`; then the shared-prefix hit-rate comparison served on the
# GPUs (python -m sluice.app.ray.bench). Results under $OUT. Done when the 2-replica throughput is >= 1.9x.
#
#   PYTHONPATH=... scripts/ray_dp_gpu_bench.sh
#
# Needs ray[serve] (pip install 'sluice-llm[ray]') and .stage/sharegpt1000.json (scripts/gpu_engine_bench.sh's
# requests: a file, so no tokenizer is needed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
REQ=$PWD/.stage/sharegpt1000.json
PORT=${PORT:-8021}
mkdir -p "$OUT"
for n in 1 2; do
    python -m sluice.app.commands.cli serve --model dummy:llama3-8b --max-num-seqs 512 --max-num-batched-tokens 8192 \
        --data-parallel-size $n --data-parallel-backend ray --routing kv --port "$PORT" >"$OUT/serve_dp$n.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
    echo "dp=$n: server up after ${SECONDS}s"
    timeout 400 python -m sluice.app.commands.cli bench serve --base-url "http://127.0.0.1:$PORT" --requests-file "$REQ" \
        --num-prompts 1000 --request-rate inf --out "$OUT/serve_dp$n.json" 2>&1 | tail -14
    kill -TERM $server; wait $server
done
python - "$OUT" <<'PY'
import json, sys
one, two = (json.load(open(f"{sys.argv[1]}/serve_dp{n}.json")) for n in (1, 2))
key = next(k for k in ("output_throughput", "output_tokens_per_s") if k in json.dumps(one))
def find(d):
    return d[key] if key in d else next(find(v) for v in d.values() if isinstance(v, dict) and key in json.dumps(v))
print(f"2 replicas / 1 replica ({key}): {find(two) / find(one):.2f}x")
PY
timeout 500 python -m sluice.app.ray.bench --model dummy:llama3-8b --device cuda --blocks-per-replica 400 \
    --groups 32 --prompts-per-group 16 --system-len 1024 --output-len 64 --max-concurrency 32 --cache-sim \
    2>&1 | grep -v -E "^\(|INFO|WARNING" | tee "$OUT/ray_dp_hit_rates.txt"
