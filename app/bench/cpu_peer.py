"""`sluice bench cpu-peer`: sluice on the CPU beside llama.cpp, the same GGUF and the same threads, alternating.

For each thread count of ``--threads`` (1 and 2), ``--repeats`` times (3), a sluice run then a llama.cpp run,
each in a child process of its own, so that its peak RSS (``ru_maxrss``, reported by the child) is its own and
its threads start fresh. The model is one GGUF file (``--model``: the default model's, or a path): llama.cpp
runs it as stored (the default's Q4_1 blocks); sluice loads it as the engine does (converted once, then
``--dtype`` / ``--quantization`` as given; ``--engine-args`` passes any other `EngineArgs` field as JSON).

What is timed, the same on both sides (greedy decoding, one sequence, after one unmeasured warm-up of each
phase in the same process):

* prefill: a ``--prefill-len`` (512) token prompt of random ids, from handing it over to the first sampled
  token (sluice: `AsyncEngine.generate` with ``max_tokens=1``, its first token's arrival; llama.cpp:
  ``llama_decode`` of the prompt as one batch (``n_batch`` = the prompt) and the argmax of its last logits);
* decode: after a ``--decode-input-len`` (128) token prompt, the ``--decode-output-len`` - 1 (255) steps from
  the first sampled token to the last, each feeding the token just chosen (sluice: the engine's steps,
  scheduler and sampler included, timed from the first token's arrival to the last's; llama.cpp: one
  ``llama_decode`` of one token and a numpy argmax over the vocabulary per step, through its Python binding).

Both pay their own per-step host overhead (sluice its scheduler and actors, llama.cpp the ctypes call); neither
samples beyond argmax. llama.cpp runs with ``n_threads`` = ``n_threads_batch`` = the thread count, sluice with
``--cpu-threads`` = the thread count. ``--load-cores N`` runs both beside the same competing load (`sluice bench
cpu-load`'s spinners), to compare how each degrades. llama.cpp comes from the package registry
(``llama-cpp-python``, which compiles it: the ``llamacpp`` extra); without it the sluice side runs alone and the
result says how to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

from sluice.app.bench.common import print_figures
from sluice.app.bench.results import command_line, machine_line, write_result
from sluice.core.models.default_model import DEFAULT_MODEL

INSTALL_HINT = (
    "llama.cpp peer skipped: the llama_cpp module is not installed. Install it with "
    "`pip install 'sluice[llamacpp]'` (or `CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python`; it compiles "
    "llama.cpp, minutes on a small machine), then run this command again."
)


def register(sub) -> None:
    p = sub.add_parser("cpu-peer", help="CPU decode and prefill beside llama.cpp: same GGUF, same threads")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file, or the default model's alias (%(default)s)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, each run on both sides")
    p.add_argument("--repeats", type=int, default=3, help="alternations of sluice and llama.cpp per thread count")
    p.add_argument("--prefill-len", type=int, default=512, help="prefill: prompt tokens (default 512)")
    p.add_argument("--decode-input-len", type=int, default=128, help="decode: prompt tokens (default 128)")
    p.add_argument("--decode-output-len", type=int, default=256, help="decode: tokens generated (default 256)")
    p.add_argument("--dtype", default="auto", help="sluice's model dtype (default: auto = float32 on the CPU)")
    p.add_argument("--quantization", default=None, help="sluice's --quantization (default: none)")
    p.add_argument("--engine-args", default="{}", help="other EngineArgs fields for sluice, as a JSON object")
    p.add_argument(
        "--load-cores", type=int, default=0, help="both sides beside a competing load of this many busy cores (0: none)"
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=main)


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp side cannot run (`INSTALL_HINT`), or None when it can."""
    return INSTALL_HINT if importlib.util.find_spec("llama_cpp") is None else None


def _rss_mib() -> dict[str, float]:
    """This process's peak RSS, and its RSS now (after the runs: what serving holds, the load's peak aside)."""
    import resource

    fig = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            fig["rss_after_mib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        pass
    return fig


# -- the sluice side (a child process) -------------------------------------------------------------------------
def run_sluice(cfg: dict) -> dict:
    import anyio
    from sluice.app.bench.common import drive_engine
    from sluice.app.bench.datasets import sample_random
    from sluice.core import AsyncEngine, EngineArgs
    from sluice.core.models.loader import resolve_model

    vocab = resolve_model(cfg["model"]).config.vocab_size
    longest = max(cfg["prefill_len"] + 1, cfg["decode_input_len"] + cfg["decode_output_len"])
    args = EngineArgs(
        model=cfg["model"],
        device="cpu",
        dtype=cfg["dtype"],
        quantization=cfg["quantization"],
        cpu_threads=cfg["threads"],
        max_model_len=longest + 1,
        num_kv_blocks=longest // 16 + 4,
        enable_prefix_caching=False,  # fresh prompts anyway; no hashing on the prefill's path
        **cfg["engine_args"],
    )

    async def go() -> dict:
        async with AsyncEngine(args) as engine:
            prefill = sample_random(2, cfg["prefill_len"], 1, vocab, seed=0)
            decode = sample_random(1, cfg["decode_input_len"], cfg["decode_output_len"], vocab, seed=1)
            await drive_engine(engine, prefill[:1], tag="wp")  # warm-up of each phase
            await drive_engine(engine, sample_random(1, cfg["decode_input_len"], 8, vocab, seed=2), tag="wd")
            first = (await drive_engine(engine, prefill[1:], tag="p")).first_token_s[0]
            run = await drive_engine(engine, decode, tag="d")
        steps = run.output_lens[0] - 1
        return {
            "prefill_tok_s": cfg["prefill_len"] / first,
            "decode_tok_s": steps / (run.finish_s[0] - run.first_token_s[0]),
            "decode_steps": steps,
        }

    return anyio.run(go) | _rss_mib()


# -- the llama.cpp side (a child process) ----------------------------------------------------------------------
def run_llama_cpp(cfg: dict) -> dict:
    import time

    import llama_cpp
    import numpy as np

    longest = max(cfg["prefill_len"] + 1, cfg["decode_input_len"] + cfg["decode_output_len"])
    llm = llama_cpp.Llama(
        model_path=cfg["gguf"],
        n_threads=cfg["threads"],
        n_threads_batch=cfg["threads"],
        n_batch=max(cfg["prefill_len"], cfg["decode_input_len"]),
        n_ctx=longest + 16,
        verbose=False,
    )
    ctx, n_vocab = llm.ctx, llm.n_vocab()
    rng = np.random.default_rng(0)

    def feed(tokens: list[int]) -> int:
        """Decode ``tokens`` after what the context holds; the argmax of the last one's logits."""
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    def clear() -> None:
        if hasattr(llama_cpp, "llama_memory_clear"):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        else:  # llama.cpp before its memory API
            llama_cpp.llama_kv_self_clear(ctx)

    def prompt(n: int) -> list[int]:
        return rng.integers(0, n_vocab, n).tolist()

    def timed_decode(n_prompt: int, n_out: int) -> tuple[float, int]:
        clear()
        tok = feed(prompt(n_prompt))
        t0 = time.perf_counter()
        for _ in range(n_out - 1):
            tok = feed([tok])
        return time.perf_counter() - t0, n_out - 1

    clear()
    feed(prompt(cfg["prefill_len"]))  # warm-up of each phase
    timed_decode(cfg["decode_input_len"], 8)
    clear()
    tokens = prompt(cfg["prefill_len"])
    t0 = time.perf_counter()
    feed(tokens)
    prefill_s = time.perf_counter() - t0
    decode_s, steps = timed_decode(cfg["decode_input_len"], cfg["decode_output_len"])
    return {
        "prefill_tok_s": cfg["prefill_len"] / prefill_s,
        "decode_tok_s": steps / decode_s,
        "decode_steps": steps,
        "version": llama_cpp.__version__,
    } | _rss_mib()


# -- the parent --------------------------------------------------------------------------------------------------
def _child_env(side: str) -> dict[str, str]:
    """Each side is told its threads (no ``OMP_NUM_THREADS``); llama.cpp (built with OpenMP) also runs without
    the wait policy sluice set for itself in this process (`envs.openmp_vars_set_here`): a caller's own stays."""
    from sluice.core import envs

    drop = {"OMP_NUM_THREADS", *(envs.openmp_vars_set_here() if side == "llama.cpp" else ())}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _child(side: str, cfg: dict, load_cores: int = 0) -> dict:
    from sluice.app.bench.cpu_load import run_beside_load

    argv = ["sluice.app.bench.cpu_peer", side, json.dumps(cfg)]
    return run_beside_load(argv, _child_env(side), load_cores, f"{side} run ({cfg['threads']} threads)")


def _gguf_of(model: str) -> str | None:
    from sluice.core.models.loader import resolve_model

    return resolve_model(model).gguf_file


def summarize(runs: dict[tuple[str, int], list[dict]]) -> dict:
    """Medians (with min and max) per side and thread count, and sluice / llama.cpp ratios."""
    fig: dict = {}
    for (side, threads), rs in runs.items():
        if "version" in rs[0]:
            fig[f"{side}_version"] = rs[0]["version"]
        for key in ("decode_tok_s", "prefill_tok_s", "peak_rss_mib", "rss_after_mib"):
            xs = [r[key] for r in rs if key in r]
            if not xs:
                continue
            fig[f"{side}_{threads}t_{key}"] = statistics.median(xs)
            if not key.endswith("rss_mib"):
                fig[f"{side}_{threads}t_{key}_range"] = [round(min(xs), 2), round(max(xs), 2)]
    for threads in sorted({t for _, t in runs}):
        for key in ("decode_tok_s", "prefill_tok_s"):
            if (f"sluice_{threads}t_{key}" in fig) and (f"llama.cpp_{threads}t_{key}" in fig):
                fig[f"{threads}t_{key}_sluice_over_llama.cpp"] = (
                    fig[f"sluice_{threads}t_{key}"] / fig[f"llama.cpp_{threads}t_{key}"]
                )
    return fig


def main(ns: argparse.Namespace) -> int:
    threads = [int(t) for t in ns.threads.split(",") if t.strip()]
    if not threads or min(threads) < 1 or min(ns.repeats, ns.prefill_len, ns.decode_input_len) < 1:
        raise ValueError("threads, repeats, prefill_len and decode_input_len must be >= 1")
    if ns.decode_output_len < 2:
        raise ValueError("decode_output_len must be >= 2 (the steps after the first token are timed)")
    cfg = {k: getattr(ns, k) for k in ("model", "prefill_len", "decode_input_len", "decode_output_len", "dtype")}
    cfg |= {"quantization": ns.quantization, "engine_args": json.loads(ns.engine_args)}
    skipped = llama_cpp_missing()
    if skipped is None:
        cfg["gguf"] = _gguf_of(ns.model)
        if cfg["gguf"] is None:
            raise ValueError(f"model: llama.cpp needs a GGUF file; {ns.model!r} is not one")
    print(
        f"cpu-peer: {ns.model}, threads {threads}, {ns.repeats} alternation(s); prefill {ns.prefill_len} tokens, "
        f"decode {ns.decode_output_len} after {ns.decode_input_len}; competing load {ns.load_cores} core(s); "
        f"os load average {os.getloadavg()[0]:.2f}"
    )
    if skipped:
        print(skipped)
    sides = ("sluice",) if skipped else ("sluice", "llama.cpp")
    runs: dict[tuple[str, int], list[dict]] = {}
    for i in range(ns.repeats):
        for t in threads:
            for side in sides:
                r = _child(side, cfg | {"threads": t}, ns.load_cores)
                runs.setdefault((side, t), []).append(r)
                print(
                    f"  [{i}] {side:9s} {t} thread(s)  decode {r['decode_tok_s']:7.2f} tok/s  prefill "
                    f"{r['prefill_tok_s']:8.1f} tok/s  RSS peak {r['peak_rss_mib']:7.1f} MiB, after "
                    f"{r.get('rss_after_mib', float('nan')):7.1f} MiB",
                    flush=True,
                )
    figures = summarize(runs)
    if skipped:
        figures["peer_skipped"] = skipped
    figures["load_average_after"] = os.getloadavg()[0]
    print_figures("cpu-peer (medians)", figures)
    print(machine_line())
    if ns.out:
        dataset = {"name": "random", "prefill_len": ns.prefill_len, "decode_input_len": ns.decode_input_len}
        dataset |= {"decode_output_len": ns.decode_output_len, "threads": threads, "repeats": ns.repeats}
        dataset |= {"load_cores": ns.load_cores}
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":  # one run: `python -m sluice.app.bench.cpu_peer sluice|llama.cpp CONFIG_JSON`
    side, config = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps((run_sluice if side == "sluice" else run_llama_cpp)(config)))
