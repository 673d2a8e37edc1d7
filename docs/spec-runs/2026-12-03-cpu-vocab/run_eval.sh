# The draft vocabulary of run 8's head, evaluated on this 2-core CPU in fp32 (2026-12-03, torch 2.13.0+cpu).
# Run 8's head as trained (8,192 draft ids) is commit f6a0233's spec/heads/smollm2-135m-instruct.
set -e
H8=/tmp/head8k; HW=/tmp/head_whole; H16=/tmp/head16k
mkdir -p $H8 && for f in config.json model.safetensors; do git show f6a0233:spec/heads/smollm2-135m-instruct/$f > $H8/$f; done
python scripts/spec_widen_draft_vocab.py $H8 $HW
# (eval60_draft_vocab_16384: $H8's 8,192 ids plus the 8,192 most frequent others in run 7's regenerated responses)
D=docs/spec-runs/2026-12-03-cpu-vocab
for pair in "$HW whole_vocab" "$H8 draft_vocab_8192"; do set -- $pair
  OMP_NUM_THREADS=2 sluice eval-draft --device cpu --head $1 --num-prompts 200 --max-new-tokens 256 --json $D/eval_$2.json
  OMP_NUM_THREADS=2 sluice eval-draft --device cpu --head $1 --num-prompts 60 --max-new-tokens 128 --json $D/eval60_$2.json
done
