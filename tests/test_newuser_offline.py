"""Small corners a new user meets (issue 42 item 10): logprobs in vLLM's shape, an LLM used after close, a truncated
GGUF, a client leaving the inspector's step stream early."""

from __future__ import annotations

import math

import pytest
from sluice.core import LLM, EngineStoppedError, SamplingParams
from sluice.core.outputs import Logprob


@pytest.fixture(scope="module")
def llm():
    with LLM(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


def test_logprobs_are_vllms_dict_of_logprob(llm):
    """Per position {token_id: Logprob(logprob, rank, decoded_token)}: the top 3 ranked 1..3 best first, the
    sampled token among them (greedy: rank 1), each with its text."""
    (out,) = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))
    (c,) = out.outputs
    assert len(c.logprobs) == len(c.token_ids) == 4
    for pos, token in zip(c.logprobs, c.token_ids):
        assert all(isinstance(k, int) and isinstance(v, Logprob) for k, v in pos.items())
        ranked = sorted(pos.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert [lp.logprob for lp in ranked] == sorted((lp.logprob for lp in ranked), reverse=True)
        assert pos[token].rank == 1  # greedy
        assert all(lp.decoded_token == llm.tokenizer.decode([tid]) for tid, lp in pos.items())
    assert c.cumulative_logprob == pytest.approx(sum(pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)))


def test_a_sampled_token_outside_the_top_has_no_rank(llm):
    """At a high temperature the sampled token is often not the most likely: with logprobs=1 it is then its own
    entry beside the top one, its rank unknown."""
    params = SamplingParams(max_tokens=24, temperature=5.0, seed=3, logprobs=1, ignore_eos=True)
    (c,) = llm.generate([5, 6, 7, 8], params)[0].outputs
    outside = [pos[t] for pos, t in zip(c.logprobs, c.token_ids) if len(pos) == 2]
    assert outside and all(lp.rank is None and math.isfinite(lp.logprob) for lp in outside)


def test_generate_after_close_says_the_llm_is_closed():
    llm = LLM(model="dummy:tiny", device="cpu", num_kv_blocks=16, max_model_len=64)
    llm.close()
    with pytest.raises(EngineStoppedError, match="LLM is closed"):
        llm.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(EngineStoppedError, match="LLM is closed"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_a_truncated_gguf_says_it_is_truncated(tmp_path):
    """A GGUF cut short (an interrupted download) names itself truncated, with both sizes, not a reshape error."""
    import numpy as np
    from gguf import GGUFWriter
    from sluice.core.errors import ModelLoadError
    from sluice.core.models.loader import resolve_model

    whole = tmp_path / "whole.gguf"
    writer = GGUFWriter(str(whole), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(cut), tmp_path / "cache")
    message = str(e.value)
    assert "is truncated" in message and f"{len(data) - 4096:,} bytes of the " in message, message
    expected = int(message.split("bytes of the ")[1].split()[0].replace(",", ""))
    assert len(data) - 4096 < expected <= len(data)


def test_a_client_leaving_the_step_stream_early_floods_no_log(tmp_path, caplog):
    """`sluice inspect --trace`'s /inspect/steps sends a trace's every step in one batch: a client that reads
    the first bytes and resets the connection must be noticed at once, not after thousands of sends into the
    dead socket, each logging asyncio's "socket.send() raised exception."."""
    import json
    import logging
    import socket
    import struct
    import time

    import httpx
    from sluice.app.inspector.web import build_trace_app

    from tests.server_helpers import ServerThread

    trace = tmp_path / "trace.jsonl"
    meta = {"type": "meta", "version": 1, "source": "test", "model": "m", "block_size": 16, "num_blocks": 8}
    lines = [json.dumps(meta)] + [json.dumps({"type": "step", "step_id": i, "pad": "x" * 1000}) for i in range(1, 5001)]
    trace.write_text("\n".join(lines) + "\n")
    srv = ServerThread(build_trace_app(str(trace))).start()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            client = socket.create_connection(("127.0.0.1", srv.port))
            client.sendall(b"GET /inspect/steps HTTP/1.1\r\nHost: test\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            client.close()
            time.sleep(1.5)
        flood = [r for r in caplog.records if "socket.send()" in r.getMessage()]
        assert not flood, f"{len(flood)} x {flood[0].getMessage()}"
        assert httpx.get(f"{srv.url}/inspect", timeout=10).status_code == 200  # still serving
    finally:
        srv.stop()
