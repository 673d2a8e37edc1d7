"""What quantization buys in speed: each option beside its unquantized peer, in one run, with the ratio.

    python scripts/quant_gpu_bench.py --requests-file bench_data/sharegpt500.json --out-dir out/

* batch-1 decode (``sluice bench latency``, ``--batch-size 1``): bf16 weights, then int4 weights
  (``--quantization int4``); the figure is the median decode step (ms per output token) and the ratio
  int4 / bf16 (the issue's target: <= 0.45).
* offline ShareGPT throughput (``sluice bench throughput`` on a saved request file): bf16 KV, then fp8 KV
  (``--kv-cache-dtype fp8``); the ratio fp8 / bf16 of output tokens per second (target: >= 1).

Each benchmark is its own ``python -m sluice.app.commands.cli bench ...`` process (a fresh engine and GPU memory), in
that order; every result file is kept in ``--out-dir`` with its command, machine and versions, and the
summary (``quant_gpu_bench.json``) repeats the pairs and ratios. A pair whose run fails is reported as such.
Extra engine flags for every run go after ``--`` (e.g. ``-- --max-num-batched-tokens 8192``). A
``dummy:`` model borrows the default model's tokenizer: without the model package, carry
``~/.cache/sluice/tokenizers/`` and point ``SLUICE_CACHE_DIR`` at its parent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run(args: list[str], out: Path, log, env: dict[str, str] | None = None) -> dict | None:
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "bench", *args, "--out", str(out)]
    print("$", *(f"{k}={v}" for k, v in (env or {}).items()), " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-20000:]}\n")
    log.flush()
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode != 0 or not out.is_file():
        print(f"FAILED (exit {proc.returncode}) after {time.perf_counter() - t0:.0f}s:\n{proc.stderr[-3000:]}")
        return None
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama3-8b")
    p.add_argument("--requests-file", required=True, help="saved ShareGPT requests (bench throughput --save-requests)")
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=256, help="throughput runs")
    p.add_argument("--input-len", type=int, default=128, help="latency runs")
    p.add_argument("--output-len", type=int, default=256, help="latency runs")
    p.add_argument("--num-iters", type=int, default=3, help="latency runs")
    p.add_argument("--skip", choices=("latency", "throughput"), action="append", default=[])
    p.add_argument(
        "--without-pdl-too",
        action="store_true",
        help="latency: the pair once more with SLUICE_PDL=0 (kv/attention/pdl.py)",
    )
    p.add_argument("--out-dir", default=".")
    p.add_argument("extra", nargs="*", help="engine flags for every run (after --)")
    ns = p.parse_args()
    from sluice.app.bench.results import command_line, write_result
    from sluice.core import envs
    from sluice.core.errors import ModelLoadError
    from sluice.core.models.loader import resolve_model

    try:  # fail here, not four times over: random-weight models borrow the default model's tokenizer
        resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    except ModelLoadError as e:
        print(f"{ns.model}: {e}. A machine without the model package needs a copy of the tokenizer folder")
        print("$SLUICE_CACHE_DIR/tokenizers/ (~/.cache/sluice/tokenizers/ by default) from one that has it.")
        return 2

    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"pairs": {}}
    with open(out / "quant_gpu_bench.log", "w") as log:
        if "latency" not in ns.skip:
            lat = [
                "latency", "--model", ns.model, "--batch-size", "1", "--input-len", str(ns.input_len),
                "--output-len", str(ns.output_len), "--num-iters", str(ns.num_iters), "--num-iters-warmup", "1",
                "--max-num-seqs", "1", *ns.extra,
            ]  # fmt: skip

            def latency_pair(suffix: str = "", env: dict[str, str] | None = None) -> dict:
                base = _run(lat, out / f"latency_b1_bf16{suffix}.json", log, env)
                quant = _run([*lat, "--quantization", "int4"], out / f"latency_b1_int4{suffix}.json", log, env)
                pair = {"bf16_ms_per_token": base and base["ms_per_output_token"]}
                pair["int4_ms_per_token"] = quant and quant["ms_per_output_token"]
                if base and quant:
                    pair["ratio_int4_over_bf16"] = quant["ms_per_output_token"] / base["ms_per_output_token"]
                return pair

            pair = latency_pair()
            if "ratio_int4_over_bf16" in pair:
                pair["target"] = "<= 0.45"
                pair["met"] = pair["ratio_int4_over_bf16"] <= 0.45
            if ns.without_pdl_too:  # the same pair again, programmatic dependent launch off
                pair["no_pdl"] = latency_pair("_no_pdl", {"SLUICE_PDL": "0"})
            summary["pairs"]["batch1_decode"] = pair
            print("batch-1 decode:", json.dumps(pair), flush=True)
        if "throughput" not in ns.skip:
            thr = [
                "throughput", "--model", ns.model, "--requests-file", ns.requests_file,
                "--num-prompts", str(ns.num_prompts), "--max-num-seqs", str(ns.max_num_seqs), *ns.extra,
            ]  # fmt: skip
            base = _run(thr, out / "throughput_kv_bf16.json", log)
            quant = _run([*thr, "--kv-cache-dtype", "fp8"], out / "throughput_kv_fp8.json", log)
            pair = {"bf16_kv_output_tok_s": base and base["output_tokens_per_s"]}
            pair["fp8_kv_output_tok_s"] = quant and quant["output_tokens_per_s"]
            pair["kv_tokens"] = {"bf16": base and base.get("kv_tokens"), "fp8": quant and quant.get("kv_tokens")}
            if base and quant:
                pair["ratio_fp8_over_bf16"] = quant["output_tokens_per_s"] / base["output_tokens_per_s"]
                pair["target"] = ">= 1.0"
                pair["met"] = pair["ratio_fp8_over_bf16"] >= 1.0
            summary["pairs"]["sharegpt_throughput"] = pair
            print("ShareGPT throughput:", json.dumps(pair), flush=True)
    write_result(out / "quant_gpu_bench.json", command_line(), ns.model, {"requests_file": ns.requests_file}, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
