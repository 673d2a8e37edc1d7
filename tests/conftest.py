from __future__ import annotations

import os
import shutil

# Triton's interpreter must be chosen before triton is first imported: on a machine without an NVIDIA
# GPU (CI), the kernel tests run through it.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from sluice.core import cpu_threads  # noqa: E402  (before torch loads: OpenMP's wait policy, core/cpu_threads.py)

DEFAULT_MODEL = "smollm2-135m-instruct"

# `make test` runs the suite in pytest-xdist workers (`-n 2`, whole modules each). Each worker's torch takes its
# share of the cores, not all of them: two workers of two threads each on CI's two cores only contend. The share
# is the engine's own rule (`cpu_threads.decide` with the workers as ranks), handed on as OMP_NUM_THREADS, so that
# an engine a test builds in this process, and the processes a test starts (an engine core, tensor-parallel ranks,
# a served CLI), keep to it rather than take the whole machine.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    share = cpu_threads.decide(ranks=WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(share.count)
    cpu_threads.apply(share)

# Under xdist, the longest modules (measured on a 2-core machine like CI's) are handed out first, so that the two
# workers finish together rather than one starting a minute-long module while the other has nothing left.
# Only the order changes; a module missing from the list keeps its place after these.
LONGEST_FIRST = (  # by their time in a full run (2026-12-07, `--durations`)
    "test_spec_decode.py",
    "test_ray.py",
    "test_hf_parity.py",
    "test_tensor_parallel.py",
    "test_readme.py",
    "test_schemathesis.py",
    "test_engine.py",
    "test_quant_e2e.py",
    "test_core_process.py",
    "test_model_runner.py",
    "test_server_cli.py",
    "test_api_servers.py",
    "test_disagg.py",
    "test_spec_default_head.py",
    "test_inspector_e2e.py",
    "test_qwen3.py",
    "test_dead_core_exit.py",
    "test_fp8_checkpoint.py",
    "test_sm90_compile.py",
    "test_prefix_cache.py",
    "test_bench_commands.py",
)


def pytest_collection_modifyitems(config, items):
    if WORKERS <= 1:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept


@pytest.fixture(scope="session")
def default_source():
    from sluice.core.models.loader import resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_tokenizer(default_source):
    from sluice.core.frontend.tokenizer import load_tokenizer

    return load_tokenizer(default_source.tokenizer_dir)


@pytest.fixture(scope="session")
def default_llm():
    from sluice.core import LLM

    llm = LLM(model=DEFAULT_MODEL, device="cpu", num_kv_blocks=1024, max_model_len=2048)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def hf_default_model(default_source):
    """The Hugging Face transformers implementation of the default model: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_source.weights_dir, dtype=torch.float32)
    return model.eval()
