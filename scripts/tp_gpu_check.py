"""Tensor parallelism on a machine with two or more GPUs (NCCL), the part CI cannot run.

1. Greedy tokens at ``--tp`` ranks against one process, for the default model in fp32 (its 9 query heads
   over 3 KV heads exercise the uneven split and the replicated KV head) and a random ``dummy:llama3-8b``
   (an even split); every prompt must match token for token.
2. Throughput of ``dummy:llama3-8b`` at TP=1 and TP=``--tp`` on the same random requests, in one run
   (`sluice bench throughput --compare-tp`).

    python scripts/tp_gpu_check.py --tp 2 --out /tmp/tp
    python scripts/tp_gpu_check.py --device cpu --tp 2 --models dummy:tiny --bench-model dummy:tiny \\
        --num-prompts 4 --input-len 16 --output-len 8       # the same on the CPU (gloo), at toy scale

Results are printed and written to ``--out`` (JSON), with machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    "The three longest rivers in the world are",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "In 1969, the first people to walk on the moon",
]


def greedy(model: str, device: str, dtype: str, tp: int, max_tokens: int) -> tuple[list[list[int]], float]:
    from sluice.core import LLM, SamplingParams

    t = time.perf_counter()
    with LLM(
        model=model, device=device, dtype=dtype, tensor_parallel_size=tp, max_model_len=1024, num_kv_blocks=512
    ) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", help="parity runs in fp32, where reduction order rarely flips a token")
    p.add_argument("--models", default="smollm2-135m-instruct,dummy:llama3-8b")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--bench-model", default="dummy:llama3-8b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default=None, help="a folder for parity.json and throughput.json")
    ns = p.parse_args()

    from sluice.app.bench.results import machine_info, versions
    from sluice.app.commands.cli import main as sluice

    result: dict = {"machine": machine_info(), "versions": versions(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    ok = True
    for model in [m for m in ns.models.split(",") if m]:
        one, t1 = greedy(model, ns.device, ns.dtype, 1, ns.max_tokens)
        many, tn = greedy(model, ns.device, ns.dtype, ns.tp, ns.max_tokens)
        same = [a == b for a, b in zip(one, many)]
        ok &= all(same)
        result["runs"].append({"model": model, "tp": ns.tp, "equal": same, "tp1_s": t1, "tpn_s": tn})
        print(f"{model}: TP={ns.tp} vs TP=1 greedy tokens equal for {sum(same)}/{len(same)} prompts")
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "parity.json"), "w") as f:
            json.dump(result, f, indent=2)
    bench = ["bench", "throughput", "--model", ns.bench_model, "--device", ns.device, "--dataset", "random"]
    bench += ["--num-prompts", str(ns.num_prompts), "--input-len", str(ns.input_len)]
    bench += ["--output-len", str(ns.output_len), "--compare-tp", f"1,{ns.tp}"]
    if ns.out:
        bench += ["--out", os.path.join(ns.out, "throughput.json")]
    sluice(bench)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
