#!/usr/bin/env bash
# The engine-core figures on the GPU machine (issue 20), each a `sluice bench` command, results under $OUT.
#
#   scripts/gpu_engine_bench.sh core   # this build: ShareGPT 1000 and 200 offline, latency b1 and b8, host/GPU per step
#   scripts/gpu_engine_bench.sh peer   # ShareGPT 1000 with the transformers peer in the same run (~6 min)
#   scripts/gpu_engine_bench.sh families  # issue 38: ShareGPT 1000 offline for dummy:qwen3-8b and dummy:llama3-8b,
#                   # alternating (PAIRS, default 1), their per-parameter rates compared (~5 min)
#   scripts/gpu_engine_bench.sh families-greedy  # each dense family's greedy tokens against transformers at real
#                   # head sizes, fp32 (scripts/gpu_families_check.py; ~3 min)
#   scripts/gpu_engine_bench.sh graphs-a|graphs-b   # mixed-step CUDA graphs on (default) and off, same build
#   scripts/gpu_engine_bench.sh gemv   # the bf16 GEMV's sweep; batch 1 with it and with cuBLAS, alternating
#   scripts/gpu_engine_bench.sh final  # ShareGPT 200 (GEMV and cuBLAS), 1000, batch 1 and 8
#   scripts/gpu_engine_bench.sh rows|rows1000   # the GEMV to 64 rows vs its former 16-row limit: steps at 16-64 and
#                                               # ShareGPT 200 | ShareGPT 1000
#   scripts/gpu_engine_bench.sh fuse   # this build vs the previous kernels (GEMV to 16 rows, reduce kernel), same call
#   scripts/gpu_engine_bench.sh ropekv      # RoPE and the KV write in one kernel vs two: batch 1, ShareGPT 200
#   scripts/gpu_engine_bench.sh graphs2048  # ShareGPT 1000, mixed-step graphs to 512 tokens vs 2,048 (device idle)
#   scripts/gpu_engine_bench.sh graphs8192  # ShareGPT 200 and 1000, mixed-step graphs to 8,192 tokens vs 2,048
#   scripts/gpu_engine_bench.sh gcfreeze  # the heap frozen after start-up (default) vs --no-gc-freeze, ShareGPT 1000/200
#   scripts/gpu_engine_bench.sh warmup  # the largest eager step run once at start-up (default) vs not
#                                       # (SLUICE_EAGER_WARMUP=0): ShareGPT 1000 first on its machine, then 200
#   scripts/gpu_engine_bench.sh launchwait  # ShareGPT 200 traced, then with torch's sync debug mode
#   scripts/gpu_engine_bench.sh idle   # burst admission 64 at a time, the head's padding and the graph routes,
#                                      # each vs its switch: ShareGPT 1000 and 200 (~8 min)
#   scripts/gpu_engine_bench.sh attn   # decode attention's key tile 64 vs 128: steps at 1-512 running, ShareGPT 1000
#   scripts/gpu_engine_bench.sh fold|fold200  # RMSNorms and SiLU-and-mul folded into GEMVs vs their own
#                                             # kernels: steps and batch 1 | ShareGPT 200
#   scripts/gpu_engine_bench.sh rope|rope-short|rope200|rope1000  # RoPE and the KV write in the decode attention
#                         # kernel (default) vs their own kernel: steps and batch 1 | in 5 min | ShareGPT 200 | 1000
#   scripts/gpu_engine_bench.sh lat    # batch 1 and batch 8 only
#   scripts/gpu_engine_bench.sh structured  # issue 37: 64 concurrent ShareGPT requests unconstrained vs every one
#                       # under a JSON schema, same call (ratio, mask ms per step), then batch 256's mask share
#   scripts/gpu_engine_bench.sh grammar-fill  # issue 37: the host's mask fill at 256 rows, 1/8/14 threads, walk and warm
#   scripts/gpu_engine_bench.sh structured-threads  # issue 37: batch 256's figures with llguidance on GRAMMAR_THREADS
#                       # threads (default 14)
#   scripts/gpu_engine_bench.sh submit  # callers spawned 64 at a time vs all at once: ShareGPT 1000 (and 200)
#   scripts/gpu_engine_bench.sh stack  # this build vs the previous defaults (GEMV to 32 rows, two RoPE/KV kernels,
#                                      # mixed graphs to 512 tokens): batch 1, ShareGPT 200 and 1000
#   scripts/gpu_engine_bench.sh spec-short  # EAGLE batch 1 x3 and 64 concurrent, shorter (GGUF at $HOME/stage)
#   scripts/gpu_engine_bench.sh regroup|regroup-eq  # issue 35: this build vs 07bb7c6 (.stage/old), alternating:
#                       # ShareGPT 200 and batch 1 | greedy equality on the real model (after stage1, stage2, stage3)
#   scripts/gpu_engine_bench.sh spec   # EAGLE on the default model: batch 1 (async scheduling on and off), 64 concurrent
#   scripts/gpu_engine_bench.sh moe    # issue 38, mixture of experts (H200: Mixtral-8x7B bf16 is ~94 GB): the fused-MoE
#                   # kernel check and greedy equality with transformers (fp32, head size 128), then per model
#                   # (MOE_MODELS, default both) ShareGPT 1000 offline beside the transformers peer on the first
#                   # PEER_PROMPTS (default 100) of the same requests (output tok/s rates compared), batch 1 and its
#                   # weight-read floor (active experts only); ~17 min, so over calls of at most 10 min each:
#                   # moe-1 (kernels, greedy; ~5 min), moe-2 (Qwen3-30B-A3B; ~6 min), moe-3 (Mixtral-8x7B; ~7 min)
#   scripts/gpu_engine_bench.sh moe-b1  # issue 38: dummy:qwen3-30b-a3b batch 1 and its floor alone (~1.5 min)
#   scripts/gpu_engine_bench.sh probe-fp8  # issue 39: fp8 kernels and their one-row sweep, batch 1 bf16/fp8, a batch-1
#                                          # profile of fp8 (~7 min)
#   scripts/gpu_engine_bench.sh probe-moe  # issue 38: a batch-1 profile of dummy:qwen3-30b-a3b, the MoE tile sweep
#   scripts/gpu_engine_bench.sh moe-decode  # issue 38: the few-token MoE path checked and swept, greedy parity, Qwen3-30B-A3B
#                   # batch 1 with it and without (MOE_REPEATS alternations, default 2) against the floor, the bf16
#                   # GEMV swept at its attention shapes (~7 min); QUICK=1: checks and batch 1 only; PROFILE=1: the
#                   # b1 profile last
#   scripts/gpu_engine_bench.sh moe-tiles   # issue 38: the few-token MoE path's tiles swept in CUDA graphs
#   scripts/gpu_engine_bench.sh fp8-agree  # issue 39: greedy agreement with bf16, fp8 weights and fp8 KV (after stage1-3)
#   scripts/gpu_engine_bench.sh fp8-split  # issue 39: fp8 batch 1, split-K ranges >= 1024 (default) vs >= 2048
#   scripts/gpu_engine_bench.sh fp8-b1 # issue 39: the fp8 kernels' check, batch 1 bf16 then fp8 (~3 min)
#   scripts/gpu_engine_bench.sh fp8    # issue 39: --quantization fp8 beside bf16 (kernel check first, then batch 1, batch 8,
#                                      # ShareGPT 200 and 1000, each bf16 then fp8; greedy agreement on the real model
#                                      # when stage1-3 left its GGUF in $HOME/stage), ~8 min
#
# Inputs travel in .stage/ (ignored; carried): sharegpt1000.json (made with `sluice $bench throughput --model
# dummy:llama3-8b --dataset sharegpt --num-prompts 1000 --save-requests .stage/sharegpt1000.json
# --only-save-requests`), and for the previous build's run, old/ (`git archive 47cad4b app core kv spec scripts`)
# with cache/tokenizers/ (the tokenizer that build reads for dummy models). DRY=1 prints the commands only;
# PACK=1 leaves one archive under $OUT at the end.
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
    if [ -n "${DRY:-}" ]; then echo "$name $secs: $*"; return; fi  # DRY=1: print the commands only
    echo "== $name: $*"
    # each step's shape and device time (core/engine_core/executor.py), summed by batch size below
    SLUICE_STEP_TRACE=$OUT/$name.trace.json timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    echo "   exit $? after ${SECONDS}s"
    grep -E "speedup|identical|output_tokens_per_s|requests_per_s|num_steps|host_profile|ms per|median|p99|ratio|Error|error" "$OUT/$name.log" | head -20
    [ -s "$OUT/$name.trace.json" ] && python scripts/step_mix.py --trace "$OUT/$name.trace.json"
}
# `timeout` runs programs, not shell functions: the build as an env command line (BENCH: another build's)
bench="env PYTHONPATH=$(scripts/namespace_path.sh) python -m sluice.app.commands.cli bench"
# The workloads, each `NAME [PREFIX [FLAGS]]`: PREFIX an env command line setting switches, FLAGS more bench
# flags; the result goes to $OUT/NAME.json.
tp200() {  # ShareGPT 200 offline
    run "$1" 120 ${2:-} ${BENCH:-$bench} throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 8192 ${3:-} --out "$OUT/$1.json"
}
tp1000() {  # ShareGPT 1000 offline
    run "$1" 150 ${2:-} ${BENCH:-$bench} throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 ${3:-} --out "$OUT/$1.json"
}
lat_b1() {  # batch 1, 128 in / 256 out
    run "$1" 90 ${2:-} ${BENCH:-$bench} latency $M --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --num-iters 3 --num-iters-warmup 1 ${3:-} --out "$OUT/$1.json"
}
lat_b8() {  # batch 8, 32 in / 128 out
    run "$1" 90 ${2:-} ${BENCH:-$bench} latency $M --batch-size 8 --input-len 32 --output-len 128 --max-num-seqs 8 --num-iters 5 --num-iters-warmup 1 ${3:-} --out "$OUT/$1.json"
}
pyx() {  # wheels the device lacks (.whl, carried) into $HOME/pyx, on every python's path (a .pth file: the bench
    # command lines set PYTHONPATH themselves)
    [ -n "${DRY:-}" ] || [ ! -d .whl ] || {
        pip install -q --no-index --no-deps --target "$HOME/pyx" .whl/*.whl 2>/dev/null
        echo "$HOME/pyx" >"$(python -c 'import site; print(site.getsitepackages()[0])')/zz_pyx.pth"
    }
}
kernel_tests() {  # the Triton kernels' tests on the GPU
    run kernel_tests 300 env PYTHONPATH=$(scripts/namespace_path.sh) python -m pytest -q -p no:cacheprovider "$@"
}
rope_steps() {  # device time per step at 1-256 running with RoPE in the decode kernel (the default) and without
    for side in rope off; do
        local prefix="" name=steps_rope
        [ $side = off ] && prefix="env SLUICE_DECODE_ROPE=0" name=steps
        run $name 150 $prefix $bench steps $M --batch-sizes 1 16 64 256 --max-num-batched-tokens 8192 --out "$OUT/$name.json"
    done
}

moe_model() {  # one MoE dummy: ShareGPT 1000 with the peer's sample, batch 1, the floor (names from $1: qwen3|mixtral)
    local name=$1 model=$2 req=$REQ
    if [ "$name" = mixtral ]; then  # its vocabulary is 32,000: the borrowed tokenizer's ids above, folded into it
        req=$PWD/.stage/sharegpt1000_v32000.json  # (random weights: only the lengths make the workload)
        [ -n "${DRY:-}" ] || [ -s "$req" ] || python -c "import json,sys; r=json.load(open(sys.argv[1]))
for q in r['requests']: q['prompt_token_ids'] = [t % 32000 for t in q['prompt_token_ids']]
json.dump(r, open(sys.argv[2], 'w'))" "$REQ" "$req"
    fi
    run moe_${name}_tp1000 330 $bench throughput --model $model --requests-file "$req" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --peer hf --peer-num-prompts ${PEER_PROMPTS:-100} --peer-timeout 150 --out "$OUT/moe_${name}_tp1000.json"
    moe_b1 $name $model
}
moe_b1() {  # one MoE dummy's batch 1 (128/128) and its weight-read floor (the active experts' parameters)
    local name=$1 model=$2
    run moe_${name}_lat_b1 120 $bench latency --model $model --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8 --num-iters 2 --num-iters-warmup 1 --out "$OUT/moe_${name}_lat_b1.json"
    run moe_${name}_floor 60 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py floor --model $model --latency "$OUT/moe_${name}_lat_b1.json" --out "$OUT/moe_${name}_floor.json"
    [ -n "${DRY:-}" ] || cat "$OUT/moe_${name}_floor.log"
}
fp8_agree() {  # greedy agreement of variant $1 (gpu_fp8_check.py's VARIANTS) with bf16 on the real default model:
    # 32 held-out prompts x 64 tokens (the GGUF from stage1-3, heldout.json from .stage/g3)
    local G=$HOME/stage/smollm2-135m-instruct.gguf D=$HOME/stage/heldout.json name=fp8_agree${1#fp8}
    name=${name//-/_}  # fp8 -> fp8_agree, fp8-kv -> fp8_agree_kv
    [ -f .stage/g3/heldout.json ] && D=.stage/g3/heldout.json
    if [ -f "$G" ] && [ -f "$D" ]; then
        run $name 150 env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python scripts/gpu_fp8_check.py agree --variant $1 --model "$G" --data "$D" --num-prompts 32 --tokens 64 --out "$OUT/$name.json"
        [ -n "${DRY:-}" ] || grep -E "^agreement|Error" "$OUT/$name.log"
    else
        echo "fp8 agreement skipped: $G or $D missing (run stage1, stage2, stage3 first)"
    fi
}
moe_kernel_check() {  # the fused-MoE kernels at real shapes (against the torch loop, in a CUDA graph, timed)
    run moe_kernels 180 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py kernels ${MOE_SWEEP:+--sweep} --out "$OUT/moe_kernels.json"
    [ -n "${DRY:-}" ] || cat "$OUT/moe_kernels.log"
}
moe_kernels() {  # the kernel check, then greedy parity
    moe_kernel_check
    run moe_greedy 240 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py greedy --out "$OUT/moe_greedy.json"
    [ -n "${DRY:-}" ] || grep -E "family|PASS|FAIL|Error" "$OUT/moe_greedy.log"
}

case ${1:-core} in
moe)
    moe_kernels
    for m in ${MOE_MODELS:-qwen3 mixtral}; do
        [ $m = qwen3 ] && moe_model qwen3 dummy:qwen3-30b-a3b
        [ $m = mixtral ] && moe_model mixtral dummy:mixtral-8x7b
    done
    ;;
moe-1)
    moe_kernels
    ;;
moe-2)
    pyx  # msgspec (the engine's wire), which the bench commands import
    moe_model qwen3 dummy:qwen3-30b-a3b
    ;;
moe-3)
    pyx  # msgspec (the engine's wire), which the bench commands import
    moe_model mixtral dummy:mixtral-8x7b
    ;;
moe-b1)  # issue 38 (~1.5 min): dummy:qwen3-30b-a3b's batch 1 against its weight-read floor only
    pyx  # msgspec (the engine's wire), which the bench commands import
    moe_b1 qwen3 dummy:qwen3-30b-a3b
    ;;
core)
    tp1000 tp1000
    # the previous build, from .stage/old
    BENCH="env -C .stage/old PYTHONPATH=$(.stage/old/scripts/namespace_path.sh) python -m sluice.app.cli bench" tp1000 tp1000_prev
    tp200 tp200
    lat_b1 lat_b1
    lat_b8 lat_b8
    run steps 100 $bench steps $M --batch-sizes 64 256 512 --max-num-batched-tokens 8192 --out "$OUT/steps.json"
    ;;
peer)
    run tp1000_peer 500 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 512 --max-num-batched-tokens 8192 --peer hf --peer-timeout 400 --out "$OUT/tp1000_peer.json"
    ;;
families)  # issue 38: Qwen3-8B's per-parameter output rate against Llama-3-8B's (within 5%), same call, alternating
    for i in ${PAIRS:-1}; do
        M="--model dummy:qwen3-8b" tp1000 families_qwen3_$i
        M="--model dummy:llama3-8b" tp1000 families_llama3_$i
        [ -n "${DRY:-}" ] || env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_families_check.py rate \
            --runs "$OUT/families_qwen3_$i.json" "$OUT/families_llama3_$i.json" --out "$OUT/families_rate_$i.json"
    done
    ;;
families-greedy)  # Mistral, Gemma 2/3, Phi-3, Qwen3: greedy equality with transformers on random weights
    run families_greedy 300 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_families_check.py greedy --out "$OUT/families_greedy.json"
    [ -n "${DRY:-}" ] || cat "$OUT/families_greedy.log"
    ;;
graphs-a)  # steps with prefill rows as CUDA graphs (default) against eager (--max-graph-tokens 0), same build, same call
    run kernels 120 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_kernel_check.py --no-bench --out "$OUT/kernels.json"
    tp1000 tp1000
    tp1000 tp1000_g0 "" "--max-graph-tokens 0"
    lat_b1 lat_b1
    lat_b1 lat_b1_g0 "" "--max-graph-tokens 0"
    ;;
graphs-b)
    tp200 tp200
    tp200 tp200_g0 "" "--max-graph-tokens 0"
    lat_b8 lat_b8
    ;;
gemv)  # the few-row bf16 GEMV (core/models/gemv.py): its sweep, then batch 1 with it and with cuBLAS (SLUICE_GEMV=0), alternating
    run dense 300 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_kernel_sweep.py dense --time-limit 60 --out "$OUT/dense.json"
    for i in 1 2; do
        lat_b1 lat_b1_cublas$i "env SLUICE_GEMV=0"
        lat_b1 lat_b1_gemv$i
    done
    ;;
final)  # this build's figures, with ShareGPT 200 also under cuBLAS (SLUICE_GEMV=0) in the same call
    tp200 tp200
    tp200 tp200_cublas "env SLUICE_GEMV=0"
    tp1000 tp1000
    lat_b1 lat_b1
    lat_b8 lat_b8
    ;;
tp200ab)  # ShareGPT 200 with the GEMV and with cuBLAS, alternating twice (a first run also compiles Triton variants)
    for i in 1 2; do
        tp200 tp200_gemv$i
        tp200 tp200_cublas$i "env SLUICE_GEMV=0"
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
spec-short)  # `spec` in ~2 min, as run on 2026-12-05 (three calls, each carrying one part of the GGUF, the
    # last with .stage/g3 and .whl, its gguf installed aside): batch 1 three times (a machine's first run also
    # compiles inside its timed run), 64 concurrent once
    [ -n "${DRY:-}" ] || pip install -q --no-index --no-deps --target "$HOME/pyx" .whl/gguf-*.whl
    S="env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python -m sluice.app.bench.spec --model $HOME/stage/smollm2-135m-instruct.gguf --head default --data .stage/g3/heldout.json --max-new-tokens 256"
    for i in 1 2 3; do
        run spec_c1_run$i 80 $S --concurrency 1 --num-prompts 8 --rounds 2 --out "$OUT/spec_c1_run$i.json"
    done
    run spec_c64 100 $S --concurrency 64 --num-prompts 64 --rounds 1 --out "$OUT/spec_c64.json"
    ;;
rows)  # the bf16 GEMV up to 64 rows (default) against its former limit of 16 (SLUICE_GEMV_ROWS=16), same build, alternating
    run steps 150 $bench steps $M --batch-sizes 16 24 32 48 64 --max-num-batched-tokens 8192 --out "$OUT/steps.json"
    run steps_r16 150 env SLUICE_GEMV_ROWS=16 $bench steps $M --batch-sizes 16 24 32 48 64 --max-num-batched-tokens 8192 --out "$OUT/steps_r16.json"
    for i in 1 2; do
        tp200 tp200_r64_$i
        tp200 tp200_r16_$i "env SLUICE_GEMV_ROWS=16"
    done
    ;;
rows1000)  # the same pair on ShareGPT 1000
    tp1000 tp1000_r64
    tp1000 tp1000_r16 "env SLUICE_GEMV_ROWS=16"
    ;;
fuse)  # this build against the previous one's kernels in the same call (SLUICE_GEMV_ROWS=16: the GEMV to 16 rows;
    # SLUICE_FUSED_REDUCE=0: decode attention's split reduce as a second kernel), alternating; kernel tests first
    kernel_tests ${KERNEL_TESTS:-tests/test_triton_attention.py tests/test_fused_kernels.py}
    prev="env SLUICE_GEMV_ROWS=16 SLUICE_FUSED_REDUCE=0"
    lat_b1 lat_b1
    lat_b1 lat_b1_prev "$prev"
    for i in 1 2; do
        tp200 tp200_$i
        tp200 tp200_prev_$i "$prev"
    done
    tp1000 tp1000
    tp1000 tp1000_prev "$prev"
    lat_b8 lat_b8
    ;;
ropekv)  # RoPE and the KV write in one kernel (the default) against two (SLUICE_FUSED_ROPE_KV=0), alternating; tests first
    kernel_tests tests/test_fused_kernels.py
    for i in 1 2; do
        lat_b1 lat_b1_ropekv$i
        lat_b1 lat_b1_two$i "env SLUICE_FUSED_ROPE_KV=0"
        tp200 tp200_ropekv$i
        tp200 tp200_two$i "env SLUICE_FUSED_ROPE_KV=0"
    done
    ;;
graphs2048)  # ShareGPT 1000 with mixed-step graphs to 512 tokens against 2,048 (the default), alternating; the host
    # profile's gpu_idle / gpu_idle_eager say how long the device waited between steps, and before eager ones
    for i in ${PAIRS:-1 2}; do
        tp1000 tp1000_g512_$i "" "--max-graph-tokens 512"
        tp1000 tp1000_g2048_$i "" "--max-graph-tokens 2048"
    done
    ;;
graphs8192)  # mixed-step graphs to 8,192 tokens (every step of these runs a graph) against 2,048, ShareGPT 200 and 1000
    for n in 8192 2048; do
        tp200 tp200_g$n "" "--max-graph-tokens $n"
    done
    for n in 8192 2048; do
        tp1000 tp1000_g$n "" "--max-graph-tokens $n"
    done
    ;;
stack)  # this build against the previous defaults in one call (SLUICE_GEMV_ROWS=32: the GEMV to 32 rows;
    # SLUICE_FUSED_ROPE_KV=0: RoPE and the KV write as two kernels; --max-graph-tokens 512), alternating; tests first
    kernel_tests tests/test_fused_kernels.py tests/test_triton_attention.py
    prev="env SLUICE_GEMV_ROWS=32 SLUICE_FUSED_ROPE_KV=0"
    lat_b1 lat_b1
    lat_b1 lat_b1_prev "$prev" "--max-graph-tokens 512"
    for i in 1 2; do
        tp200 tp200_$i
        tp200 tp200_prev_$i "$prev" "--max-graph-tokens 512"
    done
    tp1000 tp1000
    tp1000 tp1000_prev "$prev" "--max-graph-tokens 512"
    ;;
gcfreeze)  # the engine's heap frozen after start-up (the default) against --no-gc-freeze: ShareGPT 1000, then 200
    tp1000 tp1000
    tp1000 tp1000_nofreeze "" "--no-gc-freeze"
    tp200 tp200
    tp200 tp200_nofreeze "" "--no-gc-freeze"
    ;;
warmup)  # the engine's eager warm-up (ModelRunner.warm_up_eager, the default) against none: ShareGPT 1000 first
    # on a fresh machine (Triton compiles what the warm-up does not cover inside the timed run), then ShareGPT 200
    tp1000 tp1000
    tp1000 tp1000_nowarm "env SLUICE_EAGER_WARMUP=0"
    for i in ${PAIRS:-1 2}; do
        tp200 tp200_$i
        tp200 tp200_nowarm_$i "env SLUICE_EAGER_WARMUP=0"
    done
    ;;
launchwait)  # ShareGPT 200 with where each launch's host time goes (the step trace), then with every synchronizing
    # call warned about (SLUICE_SYNC_DEBUG=1: torch's sync debug mode, each with where it was called)
    tp200 tp200
    tp200 tp200_syncdebug "env SLUICE_SYNC_DEBUG=1"
    ;;
idle)  # three mechanisms against their switches in one call, each read in the traces: a burst's callers reaching
    # the scheduler 64 at a time (default; SLUICE_ADMITTING=0 all at once: idle before the first step), the LM
    # head's rows padded (SLUICE_PAD_HEAD_ROWS=0: launches that wait for the device) and the graph routes; then
    # ShareGPT 1000 with every kernel loaded at start-up (CUDA_MODULE_LOADING=EAGER: whether lazy loading is why
    # its eager prompt steps' launches waited, ~94 ms in the last trace)
    tp1000 tp1000
    tp1000 tp1000_noadmit "env SLUICE_ADMITTING=0"
    tp1000 tp1000_nopad "env SLUICE_PAD_HEAD_ROWS=0"
    tp1000 tp1000_noroutes "env SLUICE_GRAPH_ROUTES=0"
    tp200 tp200
    tp200 tp200_noadmit "env SLUICE_ADMITTING=0"
    tp200 tp200_nopad "env SLUICE_PAD_HEAD_ROWS=0"
    tp1000 tp1000_eagerload "env CUDA_MODULE_LOADING=EAGER"
    ;;
attn)  # the decode attention kernel's key tile, 64 against 128 (the default; the attention sweep timed them at 64
    # and 128 sequences only, before the fused reduce), alternating: device time per step at 1-512 running over
    # 512-token contexts (16 and 32 running: 4 and 2 splits), then ShareGPT 1000, whose large batches attention
    # weighs on
    for i in 1 2; do
        for tile in 64 128; do
            run steps_dec${tile}_$i 150 env SLUICE_DECODE_BLOCK_N=$tile $bench steps $M --batch-sizes 1 16 32 64 256 512 --input-len 512 --max-num-batched-tokens 8192 --out "$OUT/steps_dec${tile}_$i.json"
        done
    done
    for tile in 64 128; do
        tp1000 tp1000_dec$tile "env SLUICE_DECODE_BLOCK_N=$tile"
    done
    ;;
fold)  # each decoder layer's RMSNorms folded into the GEMV after them and its SiLU-and-mul into the gate/up GEMV's
    # epilogue at <= 16 rows (SLUICE_GEMV_FOLD=norm,silu) against their own kernels (the default), alternating: the
    # kernels' GPU tests first, device time per step at 1-16 rows, batch 1, then each side's kernels at 1 and 16
    # rows (scripts/gpu_engine_check.py profile: the graph's step time beside its kernels' own, so a fold that loses
    # says whether its GEMVs or the gaps did) (ShareGPT 200: fold200)
    kernel_tests tests/test_fused_kernels.py
    fold="env SLUICE_GEMV_FOLD=norm,silu"
    run steps_fold 150 $fold $bench steps $M --batch-sizes 1 4 8 16 --max-num-batched-tokens 8192 --out "$OUT/steps_fold.json"
    run steps 150 $bench steps $M --batch-sizes 1 4 8 16 --max-num-batched-tokens 8192 --out "$OUT/steps.json"
    for i in 1 2; do
        lat_b1 lat_b1_fold_$i "$fold"
        lat_b1 lat_b1_$i
    done
    check="env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_engine_check.py profile $M --batch-sizes 1 16"
    run profile_fold 120 $fold $check --out "$OUT/profile_fold.json"
    run profile 120 $check --out "$OUT/profile.json"
    ;;
rope)  # a decode step's RoPE and KV write done by the decode attention kernel at up to 16 running (the default since
    # 2026-12-05; one launch fewer per layer) against their own kernel (SLUICE_DECODE_ROPE=0), alternating: the
    # kernels' GPU tests first, device time per step at 1-256 running, batch 1 (ShareGPT 1000: rope1000)
    kernel_tests tests/test_triton_attention.py tests/test_fused_kernels.py -k "rope or decode"
    off="env SLUICE_DECODE_ROPE=0"
    rope_steps
    for i in 1 2; do
        lat_b1 lat_b1_rope_$i
        lat_b1 lat_b1_$i "$off"
    done
    ;;
rope-short)  # `rope` in ~5 min: its own GPU tests only, steps, one batch-1 pair and one ShareGPT 200 pair (run on
    # 2026-12-05 with the RoPE at every batch size and off by default: then its sides were SLUICE_DECODE_ROPE=1 and
    # the default)
    kernel_tests tests/test_triton_attention.py tests/test_fused_kernels.py -k "rope"
    off="env SLUICE_DECODE_ROPE=0"
    rope_steps
    lat_b1 lat_b1_rope
    lat_b1 lat_b1 "$off"
    tp200 tp200_rope
    tp200 tp200 "$off"
    ;;
rope200)  # ShareGPT 200 with and without it, alternating
    for i in ${PAIRS:-1 2}; do
        tp200 tp200_rope_$i
        tp200 tp200_$i "env SLUICE_DECODE_ROPE=0"
    done
    ;;
rope1000)  # the same pair on ShareGPT 1000
    for i in ${PAIRS:-1}; do
        tp1000 tp1000_rope_$i
        tp1000 tp1000_$i "env SLUICE_DECODE_ROPE=0"
    done
    ;;
submit)  # the benchmark's callers spawned 64 at a time (default, `drive_engine`) vs all before any runs
    # (SLUICE_SUBMIT_CHUNK=0): ShareGPT 200 first (on a fresh machine it compiles what the others then read), 1000
    # twice and once all at once, the previous build (.stage/old) on 1000, ShareGPT 200 again
    tp200 tp200_1
    tp1000 tp1000_1
    tp1000 tp1000_all "env SLUICE_SUBMIT_CHUNK=0"
    tp1000 tp1000_2
    BENCH="env -C .stage/old PYTHONPATH=$(.stage/old/scripts/namespace_path.sh) python -m sluice.app.cli bench" tp1000 tp1000_prev
    tp200 tp200_2
    ;;
lat)  # batch 1 and batch 8, this build
    lat_b1 lat_b1
    lat_b8 lat_b8
    ;;
fold200)  # the same pair on ShareGPT 200 (a call of its own: `fold` fills most of one)
    for i in ${PAIRS:-1 2}; do
        tp200 tp200_fold_$i "env SLUICE_GEMV_FOLD=norm,silu"
        tp200 tp200_$i
    done
    ;;
regroup)  # issue 35: this build against the one before the regrouping (.stage/old: `git archive 07bb7c6 app core
    # kv spec scripts`), alternating: ShareGPT 200 offline and batch 1, PAIRS pairs (default 2), the order swapped
    # in every other pair. Wheels for what the device lacks (msgspec, pyzmq) travel in .whl and go to $HOME/pyx.
    pyx
    now="env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python -m sluice.app.commands.cli bench"
    prev="env -C .stage/old PYTHONPATH=$(.stage/old/scripts/namespace_path.sh):$HOME/pyx python -m sluice.app.cli bench"
    for i in $(seq 1 "${PAIRS:-2}"); do
        order="now prev"
        [ $((i % 2)) = 0 ] && order="prev now"
        for side in $order; do
            [ $side = now ] && b=$now || b=$prev
            BENCH="$b" tp200 tp200_${side}_$i
        done
        for side in $order; do
            [ $side = now ] && b=$now || b=$prev
            BENCH="$b" lat_b1 lat_b1_${side}_$i
        done
    done
    ;;
stage1|stage2|stage3)  # the default model's GGUF in three parts (.stage/g1..g3, one carried per call, calls back to
    # back on one warm machine) joined under $HOME/stage; stage3 checks its sha256
    mkdir -p "$HOME/stage" && cp .stage/g${1#stage}/* "$HOME/stage/"
    if [ "$1" = stage3 ]; then
        cat "$HOME"/stage/gguf.part0{0,1,2} >"$HOME/stage/smollm2-135m-instruct.gguf"
        sha256sum "$HOME/stage/smollm2-135m-instruct.gguf" | tee "$OUT/gguf.sha256"
        grep -q '^b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ' "$OUT/gguf.sha256" || exit 3
    fi
    ls -la "$HOME/stage"
    ;;
regroup-eq)  # issue 35: greedy equality on the real model (GGUF from stage1-3), this build and the previous one
    # (.stage/old); each must pass, and their per-prompt rows must be the same
    pyx
    G=$HOME/stage/smollm2-135m-instruct.gguf
    run eq_now 300 env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python scripts/gpu_engine_check.py equality --model "$G" --out "$OUT/eq_now.json"
    run eq_prev 300 env -C .stage/old PYTHONPATH=$(.stage/old/scripts/namespace_path.sh):$HOME/pyx python scripts/gpu_engine_check.py equality --model "$G" --out "$OUT/eq_prev.json"
    python - "$OUT/eq_now.json" "$OUT/eq_prev.json" <<'PY'
import json, sys
now, prev = (json.load(open(f)) for f in sys.argv[1:3])
same = now["rows"] == prev["rows"]
print(f"equality: this build pass={now['pass']} equal={now['equal']} near_ties={now['near_ties']} "
      f"mismatches={now['mismatches']}; previous pass={prev['pass']}; rows identical: {same}")
PY
    ;;
structured)  # issue 37: grammar-constrained throughput against unconstrained, in one engine, alternating
    pyx  # llguidance, msgspec
    run structured64 300 $bench structured $M --requests-file "$REQ" --num-prompts 64 --max-num-seqs 64 --max-num-batched-tokens 8192 --repeats ${REPEATS:-3} --out "$OUT/structured64.json"
    run structured256 300 $bench structured $M --requests-file "$REQ" --num-prompts 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeats 1 --out "$OUT/structured256.json"
    ;;
grammar-fill)  # issue 37, host only (~2 min): a step's grammar masks at 256 rows on llguidance's executor at 1, 8 and
    # 14 threads, rows forked from as many starts, from one, from their own (scripts/grammar_fill_cost.py), in a walk
    # and --warm
    pyx
    for w in "" --warm; do
        run grammar_fill${w#--} 150 env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python scripts/grammar_fill_cost.py --rows 256 --steps 40 --threads 1 8 14 $w
        [ -n "${DRY:-}" ] || tail -8 "$OUT/grammar_fill${w#--}.log"
    done
    ;;
structured-threads)  # issue 37: batch 256 again with llguidance on GRAMMAR_THREADS threads (default 14, as unset on 16 cores)
    pyx
    run structured256_t${GRAMMAR_THREADS:-14} 300 env SLUICE_GRAMMAR_THREADS=${GRAMMAR_THREADS:-14} $bench structured $M --requests-file "$REQ" --num-prompts 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeats 1 --out "$OUT/structured256_t${GRAMMAR_THREADS:-14}.json"
    ;;
fp8)  # issue 39: dummy:llama3-8b with --quantization fp8 beside bf16 in one call. The fp8 kernels' check comes
    # first and stops the mode when a GPU path is wrong; then batch 1 (128/256) and batch 8 (32/128) latency,
    # ShareGPT 200 and 1000 offline, each bf16 then fp8; last, greedy agreement of fp8 with bf16 on the real default
    # model (32 held-out prompts x 64 tokens; needs the GGUF from stage1-3 and heldout.json from .stage/g3).
    pyx
    export PYTHONPATH=$HOME/pyx${PYTHONPATH:+:$PYTHONPATH}  # wheels the device lacks, for every command below
    F="env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python scripts/gpu_fp8_check.py"
    BENCH="env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python -m sluice.app.commands.cli bench"
    # FP8_SWEEP=1 adds the GEMV config sweep (~1 min)
    run fp8_kernels 240 $F kernels ${FP8_SWEEP:+--sweep} --out "$OUT/fp8_kernels.json"
    if [ -z "${DRY:-}" ]; then
        python - "$OUT/fp8_kernels.json" <<'PY' || { echo "fp8 kernels FAILED: stopping (see $OUT/fp8_kernels.log)"; exit 3; }
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # no JSON: the check crashed before writing it
    print(f"fp8 kernels: no result ({e})"); sys.exit(1)
print(f"fp8 kernels: pass={r.get('pass')} {r.get('error', '')} batch1={r.get('batch1')}")
sys.exit(0 if r.get("pass") else 1)
PY
    fi
    Q="--quantization fp8"
    lat_b1 lat_b1_bf16
    lat_b1 lat_b1_fp8 "" "$Q"
    lat_b8 lat_b8_bf16
    lat_b8 lat_b8_fp8 "" "$Q"
    tp200 tp200_bf16
    tp200 tp200_fp8 "" "$Q"
    tp1000 tp1000_bf16
    tp1000 tp1000_fp8 "" "$Q"
    fp8_agree fp8
    [ -n "${DRY:-}" ] || python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def get(name, key):
    try:
        return json.loads((out / f"{name}.json").read_text()).get(key)
    except Exception:
        return None
rows = [("batch 1 128/256 ms/token (median step)", "lat_b1", "ms_per_output_token", "<= 2.5"),
        ("batch 1 128/256 ms/token (end to end)", "lat_b1", "e2e_ms_per_output_token", ""),
        ("batch 8 32/128 ms/token (median step)", "lat_b8", "ms_per_output_token", "reported"),
        ("ShareGPT 200 offline req/s", "tp200", "requests_per_s", ">= 31"),
        ("ShareGPT 1000 offline output tok/s", "tp1000", "output_tokens_per_s", ">= 13,500")]
print(f"{'figure':42} {'bf16':>10} {'fp8':>10} {'fp8/bf16':>9}  target (fp8)")
for label, name, key, target in rows:
    a, b = get(f"{name}_bf16", key), get(f"{name}_fp8", key)
    ratio = f"{b / a:9.3f}" if a and b else f"{'-':>9}"
    fmt = lambda v: f"{v:10.3f}" if isinstance(v, (int, float)) else f"{'-':>10}"
    print(f"{label:42} {fmt(a)} {fmt(b)} {ratio}  {target}")
agree = out / "fp8_agree.json"
if agree.is_file():
    a = json.loads(agree.read_text())
    print(f"greedy agreement fp8 vs bf16, default model: {a['equal']} of {a['prompts']} prompts equal over "
          f"{a['tokens']} tokens ({a['near-tie']} part at a near-tie, {a['diverged']} wider)")
PY
    ;;
fp8-agree)  # issue 39 (~3 min, after stage1-3): every fp8 GPU path checked at the default model's shapes too (K = 576),
    # then greedy agreement with bf16 of fp8 weights, and of the fp8 KV cache
    pyx
    run fp8_kernels_small 150 env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python scripts/gpu_fp8_check.py kernels --small --no-bench --out "$OUT/fp8_kernels_small.json"
    [ -n "${DRY:-}" ] || grep -E "correctness|kernels:" "$OUT/fp8_kernels_small.log"
    fp8_agree fp8
    fp8_agree fp8-kv
    ;;
fp8-split)  # issue 39 (~4 min): the fp8 kernels' check, then fp8 batch 1 with split-K ranges of at least 1024 (the
    # default) and of 2048 (SLUICE_FP8_GEMV_SPLIT_MIN_K=2048, the rule before), alternating twice
    pyx
    run fp8_kernels 240 env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python scripts/gpu_fp8_check.py kernels --small --out "$OUT/fp8_kernels.json"
    for i in 1 2; do
        lat_b1 lat_b1_fp8_split1024_$i "" "--quantization fp8"
        lat_b1 lat_b1_fp8_split2048_$i "env SLUICE_FP8_GEMV_SPLIT_MIN_K=2048" "--quantization fp8"
    done
    ;;
fp8-b1|probe-fp8)  # issue 39: the fp8 kernels' check (batch 1's bandwidth per projection), then batch 1 bf16 and
    # fp8 (~3 min); probe-fp8 (~7 min) also sweeps the GEMV's configs at one row and profiles an fp8 batch-1 step
    # (eager kernels by class, `gpu_engine_check.py profile`)
    pyx
    P="env PYTHONPATH=$(scripts/namespace_path.sh):$HOME/pyx python"
    sweep=""
    [ "$1" = probe-fp8 ] && sweep=--sweep
    run fp8_kernels 300 $P scripts/gpu_fp8_check.py kernels --small $sweep --out "$OUT/fp8_kernels.json"
    lat_b1 lat_b1_bf16
    lat_b1 lat_b1_fp8 "" "--quantization fp8"
    [ "$1" = probe-fp8 ] && run profile_fp8 180 $P scripts/gpu_engine_check.py profile --quantization fp8 --batch-sizes 1 8 --prefills 1x128 --out "$OUT/profile_fp8.json"
    ;;
probe-moe)  # issue 38 in one call (~5 min): where a batch-1 step of dummy:qwen3-30b-a3b goes (eager kernels by class),
    # then the fused-MoE kernels' tile sweep at real shapes
    run profile_moe 240 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_engine_check.py profile --model dummy:qwen3-30b-a3b --batch-sizes 1 8 --prefills 1x128 --out "$OUT/profile_moe.json"
    MOE_SWEEP=1 moe_kernel_check
    ;;
moe-decode)  # issue 38 (~7 min): the few-token MoE path (core/models/moe_decode.py) checked and its tiles swept at
    # real shapes, dummy:qwen3-30b-a3b batch 1 with it (SLUICE_MOE_DECODE=1) and without (=0: the router GEMM
    # and grouped GEMMs), alternating twice, each against the weight-read floor; greedy parity with transformers; the
    # bf16 GEMV's configs at its attention shapes (QUICK=1: no sweeps); PROFILE=1: the as-served b1 profile last
    pyx  # msgspec (the engine's wire), which the bench commands import
    run moe_kernels 240 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py kernels $([ -n "${QUICK:-}" ] || echo --decode-sweep) --tokens 1 8 --out "$OUT/moe_kernels.json"
    [ -n "${DRY:-}" ] || grep -E "decode|PASS|FAIL|Error" "$OUT/moe_kernels.log"
    Q3="--model dummy:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8 --num-iters 2 --num-iters-warmup 1"
    for r in $(seq ${MOE_REPEATS:-2}); do
        for side in on off; do
            prefix="env SLUICE_MOE_DECODE=0"
            [ $side = on ] && prefix="env SLUICE_MOE_DECODE=1"
            run moe_b1_${side}_$r 120 $prefix $bench latency $Q3 --out "$OUT/moe_b1_${side}_$r.json"
            run moe_floor_${side}_$r 60 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py floor --model dummy:qwen3-30b-a3b --latency "$OUT/moe_b1_${side}_$r.json" --out "$OUT/moe_floor_${side}_$r.json"
            [ -n "${DRY:-}" ] || grep -E "step_ms|ratio_vs_floor_copy" "$OUT/moe_floor_${side}_$r.json"
        done
    done
    # greedy against transformers (fp32): a solo request's decode steps take the few-token path, batched ones not
    run moe_greedy 240 env SLUICE_MOE_DECODE=1 PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py greedy --out "$OUT/moe_greedy.json"
    [ -n "${DRY:-}" ] || grep -E "family|PASS|FAIL|Error" "$OUT/moe_greedy.log"
    # the bf16 GEMV's configs at Qwen3-30B-A3B's attention projections (q/k/v 5120 x 2048, o 2048 x 4096), batch 1
    [ -n "${SKIP_DENSE:-}${QUICK:-}" ] || run dense_qwen3moe 150 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_kernel_sweep.py dense --nk qkv:5120:2048 o:2048:4096 --rows 1 --time-limit 45 --out "$OUT/dense_qwen3moe.json"
    [ -z "${PROFILE:-}" ] || run profile_moe 240 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_engine_check.py profile --model dummy:qwen3-30b-a3b --batch-sizes 1 --prefills 1x128 --out "$OUT/profile_moe.json"
    ;;
moe-tiles)  # issue 38 (~6 min): the few-token MoE path's tiles by coordinate descent, each config timed in a CUDA
    # graph over cold layers beside the router GEMM + grouped GEMMs (Qwen3-30B-A3B two rounds, Mixtral one)
    run moe_tiles_qwen3 330 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py decode-sweep --shapes qwen3-30b-a3b --rounds 2 --out "$OUT/moe_tiles_qwen3.json"
    [ -n "${DRY:-}" ] || grep -E "^\{|Error" "$OUT/moe_tiles_qwen3.log"
    run moe_tiles_mixtral 200 env PYTHONPATH=$(scripts/namespace_path.sh) python scripts/gpu_moe_check.py decode-sweep --shapes mixtral-8x7b --rounds 1 --out "$OUT/moe_tiles_mixtral.json"
    [ -n "${DRY:-}" ] || grep -E "^\{|Error" "$OUT/moe_tiles_mixtral.log"
    ;;
configs)  # the same workloads at other batch limits
    run tp1000_s1024 120 $bench throughput $M --requests-file "$REQ" --num-prompts 1000 --max-num-seqs 1024 --max-num-batched-tokens 8192 --out "$OUT/tp1000_s1024.json"
    run tp200_t16k 90 $bench throughput $M --requests-file "$REQ" --num-prompts 200 --max-num-seqs 256 --max-num-batched-tokens 16384 --out "$OUT/tp200_t16k.json"
    ;;
*)
    echo "unknown mode: $1 (the modes are listed at the top of $0)" >&2
    exit 2
    ;;
esac
# PACK=1: everything under $OUT in one archive (the device returns at most 8 files)
if [ -n "${PACK:-}" ] && [ -z "${DRY:-}" ]; then
    pack=$(mktemp -d)/all_${1:-core}.tgz
    tar czf "$pack" -C "$OUT" --exclude='*.tgz' . && find "$OUT" -type f ! -name '*.tgz' -delete && mv "$pack" "$OUT/"
    ls -la "$OUT"
fi

