"""Run the Hugging Face continuous-batching peer once on ShareGPT and print its figures.

python -m sluice.app.bench.peer_smoke --num-prompts 64 [--model smollm2-135m-instruct] [--out result.json]
"""

from __future__ import annotations

import argparse
import time

import torch
from sluice.app.bench.datasets import sample_sharegpt, summarize
from sluice.app.bench.hf_peer import DEFAULT_MODEL, load_hf_model, load_hf_tokenizer, run_hf_continuous_batching
from sluice.app.bench.results import command_line, machine_info, print_table, write_result

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    args = ap.parse_args(argv)

    t = time.perf_counter()
    tokenizer = load_hf_tokenizer(args.model)
    requests = sample_sharegpt(tokenizer, args.num_prompts, seed=args.seed)
    data = summarize(requests)
    print(
        f"sharegpt: {data['num_requests']} requests, mean prompt {data['mean_prompt_len']:.1f}, "
        f"mean output {data['mean_output_len']:.1f} tokens ({time.perf_counter() - t:.1f}s)"
    )

    t = time.perf_counter()
    model = load_hf_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    print(
        f"model {args.model} loaded on {args.device} ({args.dtype}) in {time.perf_counter() - t:.1f}s; "
        f"machine: {machine_info()['cpu']}, torch threads {torch.get_num_threads()}"
    )

    result = run_hf_continuous_batching(
        model, requests, max_batch_tokens=args.max_batch_tokens, timeout_s=args.timeout_s
    )
    exact = sum(n == r.output_len for n, r in zip(result.output_lens, requests, strict=True))
    figures = result.figures()
    print_table([figures])
    print(f"finished {result.num_finished}/{result.num_requests}, exact forced lengths {exact}/{len(requests)}")
    if result.incomplete_reason is not None:
        print(f"incomplete: {result.incomplete_reason}")
    if args.out:
        dataset = {"name": "sharegpt", "seed": args.seed, **data}
        write_result(args.out, command_line(), args.model, dataset, {"peer": figures, "dtype": args.dtype})
        print(f"wrote {args.out}")
    return figures


if __name__ == "__main__":
    main()
