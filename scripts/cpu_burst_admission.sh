#!/usr/bin/env bash
# A burst's admission on the CPU machine (issue 20): `sluice bench host` (the model's forward stubbed) over a
# burst of N requests, with a burst's callers reaching the scheduler 64 at a time (the default) and all at once
# (SLUICE_ADMITTING=0), alternating, ROUNDS times each; each run's JSON under OUT. Its figure is
# first_forward_ms: from submitting the burst to the first forward (the device's idle time on a GPU).
#
#   scripts/cpu_burst_admission.sh [N] [ROUNDS]     # defaults: 1000 3
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
ROUNDS=${2:-3}
OUT=${OUT:-docs/benchmarks}
for i in $(seq "$ROUNDS"); do
    for at_once in 64 0; do
        SLUICE_ADMITTING=$at_once .venv/bin/sluice bench host --num-seqs "$N" --input-len 243 --output-len 16 \
            --rounds 1 --stub-ms 5 --out "$OUT/cpu_host_burst${N}_admitting${at_once}_$i.json" |
            grep -E "first_forward|wall_ms" | tr -s ' ' | tr '\n' ' ' | sed "s/^/admitting $at_once, round $i:/"
        echo
    done
done
