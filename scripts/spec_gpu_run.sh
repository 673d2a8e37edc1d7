#!/usr/bin/env bash
# Train, evaluate and benchmark the shipped draft head of the default model on one GPU (the H200 run
# recorded in spec/heads/smollm2-135m-instruct/README.md).
#
#   bash scripts/spec_gpu_run.sh GGUF DATA_DIR OUT_DIR
#
# GGUF: SmolLM2-135M-Instruct's file (named smollm2-135m-instruct.gguf, so the model is served under that
# name); DATA_DIR: train.json and heldout.json, written here by
#   python scripts/spec_export_data.py DATA_DIR
# (ShareGPT's first user turns of the training split and of the unseen held-out split).
set -euo pipefail
GGUF=$1 DATA=$2 OUT=$3
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
HEAD=${HEAD_DIR:-$HOME/spec-head} PY=${PYTHON:-python3}

phase() { echo "=== $* ($(date -u +%H:%M:%S))"; }

phase train
"$PY" -m app.cli train-draft --model "$GGUF" --data "$DATA/train.json" --out "$HEAD" \
  --num-prompts "${NUM_PROMPTS:-8192}" --max-new-tokens "${MAX_NEW:-256}" --max-prompt-len 512 --max-num-seqs 512 \
  --gen-time-limit "${GEN_TIME:-120}" --epochs "${EPOCHS:-8}" --train-time-limit "${TRAIN_TIME:-90}" \
  --batch-tokens 16384 --lr 1e-3 --ttt-steps 3 --draft-vocab 8192 2>&1 | tee "$OUT/train.log"
cp "$HEAD/config.json" "$HEAD/model.safetensors" "$OUT/"

phase eval
"$PY" -m app.cli eval-draft --model "$GGUF" --head "$HEAD" --data "$DATA/heldout.json" --split heldout \
  --num-prompts "${EVAL_PROMPTS:-200}" --max-new-tokens "${MAX_NEW:-256}" --num-speculative-tokens 4 --json "$OUT/eval.json" 2>&1 | tee "$OUT/eval.log"

phase bench
"$PY" -m app.bench.spec --model "$GGUF" --head "$HEAD" --data "$DATA/heldout.json" --concurrency 1 \
  --num-prompts "${BENCH1_PROMPTS:-8}" --max-new-tokens "${MAX_NEW:-256}" --out "$OUT/bench_c1.json" 2>&1 | tee "$OUT/bench.log"
"$PY" -m app.bench.spec --model "$GGUF" --head "$HEAD" --data "$DATA/heldout.json" --concurrency 64 \
  --num-prompts "${BENCH64_PROMPTS:-64}" --max-new-tokens "${MAX_NEW:-256}" --out "$OUT/bench_c64.json" 2>&1 | tee -a "$OUT/bench.log"
phase done
