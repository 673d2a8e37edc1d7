"""`sluice generate`: a prompt or a messages file in, the generated text out (what `LLM` gives)."""

from __future__ import annotations

import json

import pytest
from sluice.app.cli import main
from sluice.core import LLM, SamplingParams

ENGINE = ["--model", "dummy:tiny", "--device", "cpu", "--num-kv-blocks", "32", "--max-model-len", "256"]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primes."}]


@pytest.fixture(scope="module")
def expected():
    """The same model (dummy weights are seeded) through the Python API, greedy as the CLI's default."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(model="dummy:tiny", device="cpu", num_kv_blocks=32, max_model_len=256) as llm:
        return {
            "prompt": llm.generate([PROMPT], params, use_tqdm=False)[0].text,
            "messages": llm.chat([MESSAGES], params, use_tqdm=False)[0].text,
        }


def test_generate_prompt(capsys, expected):
    assert main(["generate", "--prompt", PROMPT, *ENGINE, "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert expected["prompt"].strip()  # random tokens still make visible text
    assert out == expected["prompt"] + "\n"


def test_generate_messages_file(tmp_path, capsys, expected):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(MESSAGES))
    assert main(["generate", "--messages-file", str(path), *ENGINE, "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out == expected["messages"] + "\n"
    assert expected["messages"] != expected["prompt"]  # the conversation, not some default prompt, went in


def test_generate_sizes_its_pool_for_one_sequence(capsys, caplog):
    """Without --num-kv-blocks the pool holds one sequence of max_model_len (256 / 16 + 1 blocks), not the
    server-sized default (2 GiB on the CPU)."""
    engine = [a for a in ENGINE if a not in ("--num-kv-blocks", "32")]
    with caplog.at_level("INFO", logger="sluice"):
        assert main(["generate", "--prompt", PROMPT, *engine, "--max-tokens", "4"]) == 0
    assert "KV pool: 17 blocks x 16 tokens" in caplog.text
    assert capsys.readouterr().out.strip()


def test_prompt_and_messages_file_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--messages-file", str(tmp_path / "m.json"), *ENGINE])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
