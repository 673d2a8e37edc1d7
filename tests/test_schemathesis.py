"""Property-based API testing with schemathesis (its own command line, as a user runs it) against the server's
/openapi.json: a few thousand generated requests, valid and invalid, to every route. None may get a 5xx, a
status or content type the document does not list, or a body that breaks the documented schema; invalid
input must be refused (4xx)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sluice.app.server import schemas as S
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs

from tests.server_helpers import ServerThread, assert_openai_error

KEY = "fuzz-key"
# Fuzzing examples per operation (the coverage phase adds its own ~650 cases): ~650-700 requests in all, most
# to the two POST routes (~25 s in a full suite since the test server's connections send without delay; it was
# 77 s when each kept-alive request waited ~40 ms). SLUICE_FUZZ_EXAMPLES=1500 makes a run of a few thousand.
MAX_EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "40"))
TIMEOUT_S = 900
MIN_CASES = 2 * MAX_EXAMPLES
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
CHECKS += "negative_data_rejection"


@pytest.fixture(scope="module")
def server():
    # A short context and a small response budget keep each generated request to a few steps of the fast
    # random-weight model (the chat template alone takes 30 of the 40 tokens); a larger n x max_tokens is
    # refused (400), which the document lists.
    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=40, max_num_seqs=128)
    app = build_app(AsyncEngine(args), api_key=KEY, metrics_require_key=True, max_response_bytes=16_000)
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_no_server_error_and_every_response_as_documented(server, tmp_path: Path):
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    report = tmp_path / "report"
    cmd = [
        st, "run", server.url + "/openapi.json",
        "--checks", CHECKS,
        "--max-examples", str(MAX_EXAMPLES),
        "--phases", "examples,coverage,fuzzing",
        "--workers", "1",
        "--seed", "1",
        "--header", f"Authorization: Bearer {KEY}",
        "--request-timeout", "60",
        "--report", "ndjson", "--report-dir", str(report),
        "--suppress-health-check", "all",
        "--warnings", "off",
        "--no-color",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-20000:]
    done = re.search(r"(\d+) generated, (\d+) passed", out)
    assert done and done.group(1) == done.group(2), out[-3000:]
    assert int(done.group(1)) >= MIN_CASES, out[-3000:]
    print(out[-1500:])


# Values of the unsupported fields that the document must not list, as the server refuses them.
UNDOCUMENTED = [True, False, 2, 0, "auto", "", {"name": "f"}, {}, [{"name": "f"}], []]


def test_unsupported_fields_document_exactly_the_values_they_accept(server):
    """The two mismatches schemathesis found (`function_call`, `best_of`) and their kind: a field the server
    does not implement was documented as taking any value, and `best_of: true` was taken as 1. Now the document
    lists each one's harmless values, every one of them is answered 200, and every other value 400 naming it."""
    auth = {"Authorization": f"Bearer {KEY}"}
    doc = httpx.get(server.url + "/openapi.json", headers=auth).json()["components"]["schemas"]
    routes = {
        "/v1/chat/completions": ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "Hi"}]}),
        "/v1/completions": ("CompletionRequest", {"prompt": "Hi"}),
    }
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as c:
        for path, (model, base) in routes.items():
            props = doc[model]["properties"]
            for name in (n for n in S._HARMLESS if n in props):
                documented = [s["const"] if "const" in s else None for s in props[name]["anyOf"]]
                assert None in documented and len(documented) >= 2, (name, props[name])
                for value in documented:
                    resp = c.post(path, json={**base, "max_tokens": 1, name: value})
                    assert resp.status_code == 200, (name, value, resp.text)
                for value in UNDOCUMENTED:
                    if any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in documented):
                        continue
                    resp = c.post(path, json={**base, "max_tokens": 1, name: value})
                    assert_openai_error(resp, 400, name)
