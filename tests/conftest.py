from __future__ import annotations

import os
import shutil

# Triton's interpreter must be chosen before triton is first imported: on a machine without an NVIDIA
# GPU (CI), the kernel tests run through it.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def default_source():
    from sluice.core.models.loader import resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_tokenizer(default_source):
    from sluice.core.tokenizer import load_tokenizer

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
