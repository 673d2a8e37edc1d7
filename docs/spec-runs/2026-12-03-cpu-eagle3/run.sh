#!/bin/bash
set -x
cd "$(dirname "$0")/../../.."  # the repository root
export OMP_NUM_THREADS=2 PYTHONPATH=.
PY=.venv/bin/python
COMMON="--model smollm2-135m-instruct --device cpu --num-prompts 192 --max-prompt-len 256 --max-new-tokens 96 --epochs 8 --batch-tokens 4096 --lr 2e-3 --train-time-limit 420"
date
$PY -m sluice.app.cli train-draft $COMMON --feature final --out /tmp/exp/final
mkdir -p /tmp/exp/eagle3 && cp /tmp/exp/final/data.pt /tmp/exp/eagle3/
date
$PY -m sluice.app.cli train-draft $COMMON --feature eagle3 --out /tmp/exp/eagle3
date
for h in final eagle3; do
  $PY -m sluice.app.cli eval-draft --model smollm2-135m-instruct --device cpu --head /tmp/exp/$h --num-prompts 24 --max-new-tokens 64 --json /tmp/exp/eval_$h.json
done
date
