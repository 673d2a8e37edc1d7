#!/usr/bin/env bash
# The engine-core figures on the GPU machine (issue 20), each a `sluice bench` command, results under $OUT.
#
#   scripts/gpu_engine_bench.sh core   # this build: ShareGPT 1000 and 200 offline, latency b1 and b8, host/GPU per step
#   scripts/gpu_engine_bench.sh peer   # ShareGPT 1000 with the transformers peer in the same run (~6 min)
#   scripts/gpu_engine_bench.sh graphs-a|graphs-b   # mixed-step CUDA graphs on (default) and off, same build
#   scripts/gpu_engine_bench.sh gemv   # the bf16 GEMV's sweep; batch 1 with it and with cuBLAS, alternating
#   scripts/gpu_engine_bench.sh final  # ShareGPT 200 (GEMV and cuBLAS), 1000, batch 1 and 8
#   scripts/gpu_engine_bench.sh rows|rows1000   # the GEMV to 64 rows vs its former 16-row limit: steps at 16-64 and
#                                               # ShareGPT 200 | ShareGPT 1000
#   scripts/gpu_engine_bench.sh fuse   # this build vs the previous kernels (GEMV to 16 rows, reduce kernel), same call
#   scripts/gpu_engine_bench.sh ropekv      # RoPE and the KV write in one kernel vs two: batch 1, ShareGPT 200
#   scripts/gpu_engine_bench.sh graphs2048  # ShareGPT 1000, mixed-step graphs to 2,048 tokens vs 512 (device idle)
#   scripts/gpu_engine_bench.sh graphs8192  # ShareGPT 200 and 1000, mixed-step graphs to 8,192 tokens vs 2,048
#   scripts/gpu_engine_bench.sh gcfreeze  # the heap frozen after start-up (default) vs --no-gc-freeze, ShareGPT 1000/200
#   scripts/gpu_engine_bench.sh stack  # this build vs the previous defaults (GEMV to 32 rows, two RoPE/KV kernels,
#                                      # mixed graphs to 512 tokens): batch 1, ShareGPT 200 and 1000
#   scripts/gpu_engine_bench.sh spec   # EAGLE on the default model: batch 1 (async scheduling on and off), 64 concurrent
#
# Inputs travel in .stage/ (ignored; carried): sharegpt1000.json (made with `sluice $bench throughput --model
# dummy:llama3-8b --dataset sharegpt --num-prompts 1000 --save-requests .stage/sharegpt1000.json
# --only-save-requests`), and for the previous build's run, old/ (`git archive 47cad4b app core kv spec scripts`)
# with cache/tokenizers/ (the tokenizer that build reads for dummy models).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SLUICE_CACHE_DIR=$PWD/.stage/cache
REQ=$PWD/.stage/sharegpt1000.json
M="--model dummy:llama3-8b"
run() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    echo "== $name: $*"
    # each step's shape and device time (core/executor.py), summed by batch size below
    SLUICE_STEP_TRACE=$OUT/$name.trace.json timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    echo "   exit $? after ${SECONDS}s"
    grep -E "speedup|identical|output_tokens_per_s|requests_per_s|num_steps|host_profile|ms per|median|p99|ratio|Error|error" "$OUT/$name.log" | head -20
    [ -s "$OUT/$name.trace.json" ] && python scripts/step_mix.py --trace "$OUT/$name.trace.json"
}
# `timeout` runs programs, not shell functions: the two builds as env command lines
bench="env PYTHONPATH=$(scripts/namespace_path.sh) python -m sluice.app.cli bench"
old_bench="env -C .stage/old PYTHONPATH=$(.stage/old/scripts/namespace_path.sh) python -m sluice.app.cli bench"

case ${1:-core} in
core)
    run tp1000 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000.json"
    run tp1000_prev 150 $old_bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000_prev.json"
    run tp200 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200.json"
    run lat_b1 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1.json"
    run lat_b8 90 $bench latency $M --batch-size 8 --input-len 32 --output-len 128 --max-num-seqs 8 --num-iters 5 --num-iters-warmup 1 --out "$OUT/lat_b8.json"
    run steps 100 $bench steps $M --batch-sizes 64 256 512 --max-num-batched-tokens 8192 --out "$OUT/steps.json"
    ;;
peer)
    run tp1000_peer 500 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --peer hf --peer-timeout 400 --out "$OUT/tp1000_peer.json"
    ;;
graphs-a)  # steps with prefill rows as CUDA graphs (default) against eager (--max-graph-tokens 0), same build, same call
    run kernels 120 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_kernel_check.py --no-bench --out "$OUT/kernels.json"
    run tp1000 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000.json"
    run tp1000_g0 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-tokens 0 --out "$OUT/tp1000_g0.json"
    run lat_b1 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1.json"
    run lat_b1_g0 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --max-graph-tokens 0 --out "$OUT/lat_b1_g0.json"
    ;;
graphs-b)
    run tp200 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200.json"
    run tp200_g0 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --max-graph-tokens 0 --out "$OUT/tp200_g0.json"
    run lat_b8 90 $bench latency $M --batch-size 8 --input-len 32 --output-len 128 --max-num-seqs 8 --num-iters 5 --num-iters-warmup 1 --out "$OUT/lat_b8.json"
    ;;
gemv)  # the few-row bf16 GEMV (core/models/gemv.py): its sweep, then batch 1 with it and with cuBLAS (SLUICE_GEMV=0), alternating
    run dense 300 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_kernel_sweep.py dense --time-limit 60 --out "$OUT/dense.json"
    for i in 1 2; do
        run lat_b1_cublas$i 90 env SLUICE_GEMV=0 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1_cublas$i.json"
        run lat_b1_gemv$i 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1_gemv$i.json"
    done
    ;;
final)  # this build's figures, with ShareGPT 200 also under cuBLAS (SLUICE_GEMV=0) in the same call
    run tp200 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200.json"
    run tp200_cublas 90 env SLUICE_GEMV=0 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_cublas.json"
    run tp1000 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000.json"
    run lat_b1 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1.json"
    run lat_b8 90 $bench latency $M --batch-size 8 --input-len 32 --output-len 128 --max-num-seqs 8 --num-iters 5 --num-iters-warmup 1 --out "$OUT/lat_b8.json"
    ;;
tp200ab)  # ShareGPT 200 with the GEMV and with cuBLAS, alternating twice (a first run also compiles Triton variants)
    for i in 1 2; do
        run tp200_gemv$i 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_gemv$i.json"
        run tp200_cublas$i 90 env SLUICE_GEMV=0 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_cublas$i.json"
    done
    ;;
spec)  # EAGLE, default model + shipped head (GGUF joined at $HOME/stage): batch 1 with a third side, speculation
    # with asynchronous scheduling off (every step waits: the previous build's speculative steps); 64 concurrent
    G=$HOME/stage/smollm2-135m-instruct.gguf
    S="env PYTHONPATH=$(scripts/namespace_path.sh)${PYTHONPATH:+:$PYTHONPATH} python -m sluice.app.bench.spec --model $G --head default --data .stage/g3/heldout.json --max-new-tokens 256"
    for i in 1 2; do
        run spec_c1_run$i 200 $S --concurrency 1 --num-prompts 8 --rounds 2 --also-sync --out "$OUT/spec_c1_run$i.json"
    done
    run spec_c64 200 $S --concurrency 64 --num-prompts 64 --rounds 3 --out "$OUT/spec_c64.json"
    ;;
rows)  # the bf16 GEMV up to 64 rows (default) against its former limit of 16 (SLUICE_GEMV_ROWS=16), same build, alternating
    run steps 150 $bench steps $M --batch-sizes 16 24 32 48 64 --max-num-batched-tokens 8192 --out "$OUT/steps.json"
    run steps_r16 150 env SLUICE_GEMV_ROWS=16 $bench steps $M --batch-sizes 16 24 32 48 64 --max-num-batched-tokens 8192 --out "$OUT/steps_r16.json"
    for i in 1 2; do
        run tp200_r64_$i 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_r64_$i.json"
        run tp200_r16_$i 90 env SLUICE_GEMV_ROWS=16 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_r16_$i.json"
    done
    ;;
rows1000)  # the same pair on ShareGPT 1000
    run tp1000_r64 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000_r64.json"
    run tp1000_r16 150 env SLUICE_GEMV_ROWS=16 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000_r16.json"
    ;;
fuse)  # this build against the previous one's kernels in the same call (SLUICE_GEMV_ROWS=16: the GEMV to 16 rows;
    # SLUICE_FUSED_REDUCE=0: decode attention's split reduce as a second kernel), alternating; kernel tests first
    run kernel_tests 300 env PYTHONPATH=$(scripts/namespace_path.sh) python -m pytest -q -p no:cacheprovider ${KERNEL_TESTS:-tests/test_triton_attention.py tests/test_fused_kernels.py}
    prev="env SLUICE_GEMV_ROWS=16 SLUICE_FUSED_REDUCE=0"
    run lat_b1 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1.json"
    run lat_b1_prev 90 $prev $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1_prev.json"
    for i in 1 2; do
        run tp200_$i 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_$i.json"
        run tp200_prev_$i 90 $prev $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_prev_$i.json"
    done
    run tp1000 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000.json"
    run tp1000_prev 150 $prev $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000_prev.json"
    run lat_b8 90 $bench latency $M --batch-size 8 --input-len 32 --output-len 128 --max-num-seqs 8 --num-iters 5 --num-iters-warmup 1 --out "$OUT/lat_b8.json"
    ;;
ropekv)  # RoPE and the KV write in one kernel (SLUICE_FUSED_ROPE_KV=1) against two (the default), alternating; tests first
    run kernel_tests 300 env PYTHONPATH=$(scripts/namespace_path.sh) python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py
    for i in 1 2; do
        run lat_b1_ropekv$i 90 env SLUICE_FUSED_ROPE_KV=1 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1_ropekv$i.json"
        run lat_b1_default$i 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1_default$i.json"
        run tp200_ropekv$i 90 env SLUICE_FUSED_ROPE_KV=1 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_ropekv$i.json"
        run tp200_default$i 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_default$i.json"
    done
    ;;
graphs2048)  # ShareGPT 1000 with mixed-step graphs to 2,048 tokens against the default 512, alternating; the host
    # profile's gpu_idle / gpu_idle_eager say how long the device waited between steps, and before eager ones
    for i in ${PAIRS:-1 2}; do
        run tp1000_g512_$i 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000_g512_$i.json"
        run tp1000_g2048_$i 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-tokens 2048 --out "$OUT/tp1000_g2048_$i.json"
    done
    ;;
graphs8192)  # mixed-step graphs to 8,192 tokens (every step of these runs a graph) against 2,048, ShareGPT 200 and 1000
    for n in 8192 2048; do
        run tp200_g$n 120 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --max-graph-tokens $n --out "$OUT/tp200_g$n.json"
    done
    for n in 8192 2048; do
        run tp1000_g$n 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-tokens $n --out "$OUT/tp1000_g$n.json"
    done
    ;;
stack)  # this build against the previous defaults in one call (SLUICE_GEMV_ROWS=32: the GEMV to 32 rows;
    # SLUICE_FUSED_ROPE_KV=0: RoPE and the KV write as two kernels; --max-graph-tokens 512), alternating; tests first
    run kernel_tests 300 env PYTHONPATH=$(scripts/namespace_path.sh) python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_triton_attention.py
    prev="env SLUICE_GEMV_ROWS=32 SLUICE_FUSED_ROPE_KV=0"
    run lat_b1 90 $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --out "$OUT/lat_b1.json"
    run lat_b1_prev 90 $prev $bench latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 --max-graph-tokens 512 --out "$OUT/lat_b1_prev.json"
    for i in 1 2; do
        run tp200_$i 120 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200_$i.json"
        run tp200_prev_$i 120 $prev $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --max-graph-tokens 512 --out "$OUT/tp200_prev_$i.json"
    done
    run tp1000 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000.json"
    run tp1000_prev 150 $prev $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-tokens 512 --out "$OUT/tp1000_prev.json"
    ;;
gcfreeze)  # the engine's heap frozen after start-up (the default) against --no-gc-freeze: ShareGPT 1000, then 200
    run tp1000 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --out "$OUT/tp1000.json"
    run tp1000_nofreeze 150 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --no-gc-freeze --out "$OUT/tp1000_nofreeze.json"
    run tp200 120 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --out "$OUT/tp200.json"
    run tp200_nofreeze 120 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --no-gc-freeze --out "$OUT/tp200_nofreeze.json"
    ;;
configs)  # the same workloads at other batch limits
    run tp1000_s1024 120 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 1024 --max-num-batched-tokens 8192 --out "$OUT/tp1000_s1024.json"
    run tp200_t16k 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 16384 --out "$OUT/tp200_t16k.json"
    ;;
esac
