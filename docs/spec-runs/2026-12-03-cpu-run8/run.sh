# CPU batch-1 benchmark of the shipped head (run 8), this 2-core machine: bf16, then fp32.
for dt in bfloat16 float32; do
  n=$([ $dt = bfloat16 ] && echo bf16 || echo fp32)
  OMP_NUM_THREADS=2 python -m sluice.app.bench.spec --device cpu --dtype $dt --concurrency 1 --num-prompts 8 --max-new-tokens 128 \
    --out docs/spec-runs/2026-12-03-cpu-run8/bench_c1_$n.json > docs/spec-runs/2026-12-03-cpu-run8/bench_c1_$n.log 2>&1
done
