#!/usr/bin/env bash
# Train, evaluate and benchmark the shipped draft head of the default model on one GPU (the H200 runs
# recorded in spec/heads/smollm2-135m-instruct/README.md).
#
#   bash scripts/spec_gpu_run.sh GGUF DATA_DIR OUT_DIR
#
# GGUF: SmolLM2-135M-Instruct's file, named smollm2-135m-instruct.gguf so the model is served under that
# name. DATA_DIR: train.json and heldout.json, written by `python scripts/spec_export_data.py DATA_DIR`
# (ShareGPT's training conversations, cut to what training uses, and the unseen held-out split's first turns).
# Optional: DATA_PT=file (regenerated sequences of an earlier run: skip regeneration), INIT_FROM=head dir
# (continue training it), FEATURE=eagle3 (a head over a low, middle and high layer's hidden states),
# LATER_TURNS=1 (prompts from later user turns too), EXTRA_GIVEN=N (N more examples with the data's own
# replies), GPU_MEM (the training engine's share of the GPU; the features stay on the GPU too), and the
# time/size knobs below (BENCH1_ROUNDS, BENCH_SHIPPED=1: bench the shipped head too, BENCH64_PROMPTS=0: no
# 64-request bench). TRAIN=0 HEAD_DIR=spec/heads/smollm2-135m-instruct: only evaluate and bench that head.
# OUT_DIR receives at most 8 files: run.log, config.json, model.safetensors, data.pt, eval.json, bench_c1.json,
# bench_c1_shipped.json, bench_c64.json.
set -euo pipefail
GGUF=$1 DATA=$2 OUT=$3
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
HEAD=${HEAD_DIR:-$HOME/spec-head} PY=${PYTHON:-python3} LOG=$OUT/run.log
mkdir -p "$HEAD"
if [ -n "${DATA_PT:-}" ]; then cp "$DATA_PT" "$HEAD/data.pt"; fi
OPT=()
if [ -n "${INIT_FROM:-}" ]; then OPT+=(--init-from "$INIT_FROM"); fi
if [ "${LATER_TURNS:-0}" = 1 ]; then OPT+=(--later-turns); fi

phase() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"; }
# A watcher following run.log from another call stops on "=== done" or "=== FAILED".
trap 'phase "FAILED (exit $?) at line $LINENO"' ERR

if [ "${TRAIN:-1}" = 1 ]; then
  phase train
  "$PY" -m sluice.app.commands.cli train-draft --model "$GGUF" --data "$DATA/train.json" --out "$HEAD" "${OPT[@]}" \
    --num-prompts "${NUM_PROMPTS:-8192}" --max-new-tokens "${MAX_NEW:-256}" --max-prompt-len 512 --max-num-seqs 512 \
    --gen-time-limit "${GEN_TIME:-120}" --epochs "${EPOCHS:-8}" --train-time-limit "${TRAIN_TIME:-90}" \
    --batch-tokens 16384 --lr "${LR:-2e-3}" --ttt-steps 3 --draft-vocab "${DRAFT_VOCAB:-0}" --feature "${FEATURE:-final}" \
    --extra-given "${EXTRA_GIVEN:-0}" --gpu-memory-utilization "${GPU_MEM:-0.3}" 2>&1 | tee -a "$LOG"
  cp "$HEAD/config.json" "$HEAD/model.safetensors" "$HEAD/data.pt" "$OUT/"
fi

# From here a failing step is reported and the next one still runs (each writes its own file).
phase eval
"$PY" -m sluice.app.commands.cli eval-draft --model "$GGUF" --head "$HEAD" --data "$DATA/heldout.json" --split heldout \
  --num-prompts "${EVAL_PROMPTS:-200}" --max-new-tokens "${MAX_NEW:-256}" --num-speculative-tokens 4 \
  --json "$OUT/eval.json" 2>&1 | tee -a "$LOG" || phase "eval FAILED"

bench() {  # bench HEAD CONCURRENCY PROMPTS ROUNDS FILE: speculative vs plain on the same prompts
  "$PY" -m sluice.app.bench.spec --model "$GGUF" --head "$1" --data "$DATA/heldout.json" --concurrency "$2" \
    --num-prompts "$3" --rounds "$4" --max-new-tokens "${MAX_NEW:-256}" --out "$OUT/$5" 2>&1 | tee -a "$LOG" \
    || phase "bench $5 FAILED"
}
if [ "${BENCH:-1}" = 1 ]; then
  phase bench
  B1=("${BENCH1_PROMPTS:-8}" "${BENCH1_ROUNDS:-1}")
  if [ "${BENCH_SHIPPED:-0}" = 1 ]; then bench default 1 "${B1[@]}" bench_c1_shipped.json; fi  # same prompts
  bench "$HEAD" 1 "${B1[@]}" bench_c1.json
  if [ "${BENCH64_PROMPTS:-64}" != 0 ]; then bench "$HEAD" 64 "${BENCH64_PROMPTS:-64}" 1 bench_c64.json; fi
fi
phase done
