"""The inspector page in a real browser: the real default model served with the inspector on, concurrent
chat requests with a shared system prompt sent by the official openai client, and /inspect opened in
headless Chromium (Debian's ``chromium`` and ``chromium-driver``, installed by ``make install``) driven by
selenium. The page must show the steps the engine recorded, the system prompt's blocks shared by every
running request, and the engine's own prefix-cache hit rate. A screenshot is kept (and copied to
``$SLUICE_INSPECTOR_SCREENSHOT`` when set: that is how docs/inspector.png is made)."""

from __future__ import annotations

import os
import shutil
import threading

import openai
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs

from tests.server_helpers import ServerThread

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY = "inspector-e2e-key"
SYSTEM = (
    "You are the help desk of a river authority. Answer in one or two plain sentences, name the river you "
    "talk about, avoid jargon, and when you do not know something say so instead of guessing. Water levels "
    "are measured in metres above the gauge zero, flows in cubic metres per second, and every answer that "
    "gives a number gives its unit too. Be friendly, but keep to the point. " * 2
)
QUESTIONS = ["Why do rivers meander?", "What is a flood plain?", "How is river flow measured?", "What is a delta?"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def inspected():
    args = EngineArgs(model=MODEL, device="cpu", num_kv_blocks=256, max_model_len=1024, enable_inspector=True)
    engine = AsyncEngine(args)
    srv = ServerThread(build_app(engine, api_key=KEY)).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    driver_path = shutil.which("chromedriver")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if driver_path is None or binary is None:
        why = "needs Debian's chromium and chromium-driver (`make test` installs them as root)"
        if os.environ.get("CI"):  # CI runs `make test` as root: a missing browser there is a broken set-up
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(flag)
    opts.add_argument("--window-size=1400,980")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield driver
    driver.quit()


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


ROWS_JS = """return [...document.querySelectorAll('#steps .step')].map(r => [
    Number(r.dataset.step), r.querySelector('.sid').textContent,
    [...r.querySelectorAll('.seg')].map(s => [s.dataset.rid, s.dataset.kind, Number(s.dataset.tokens)])])"""
SHARED_JS = """return [...document.querySelectorAll('#kv-grid .blk.shared')].map(c => [
    Number(c.dataset.block), Number(c.dataset.ref), c.textContent, c.dataset.owners.split(' ')])"""


def test_the_page_shows_the_engines_steps_shared_blocks_and_hit_rate(inspected, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    engine = inspected.engine
    d = browser
    d.get(f"{inspected.url}/inspect#key={KEY}")
    WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "status").text == "connected")
    assert d.find_element(By.ID, "mode").text == "live engine"

    client = openai.OpenAI(base_url=inspected.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    replies: list = [None] * len(QUESTIONS)

    def ask(i: int) -> None:
        replies[i] = client.chat.completions.create(
            model=MODEL,
            messages=messages(QUESTIONS[i]),
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    try:
        # -- while they run: the system prompt's full blocks are shared by every running request
        prompts = [engine.tokenize_prompt(messages(q)) for q in QUESTIONS]
        common = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
        num_shared = common // 16
        assert num_shared >= 8
        # (a few dozen steps in, so that the screenshot has some history)
        WebDriverWait(d, 120, poll_frequency=0.1).until(
            lambda d: d.execute_script(SHARED_JS) and len(d.find_elements(By.CSS_SELECTOR, ".step")) >= 24
        )
        d.find_element(By.ID, "pause").click()  # freeze the view (the engine goes on)
        shared = d.execute_script(SHARED_JS)
        assert len(shared) == num_shared
        for _block, ref, text, owners in shared:
            assert ref > 1 and text == str(ref) and len(owners) == ref
        holders = set(shared[0][3])
        # hovering a running request highlights its block table: logical i -> physical block
        item = d.find_element(By.CSS_SELECTOR, f'.kvreq[data-rid="{shared[0][3][0]}"]')
        ActionChains(d).move_to_element(item).perform()
        mapping = [
            (int(m.get_attribute("data-logical")), int(m.get_attribute("data-physical")))
            for m in d.find_elements(By.CSS_SELECTOR, "#kv-table .map")
        ]
        assert [lo for lo, _ in mapping] == list(range(len(mapping))) and len(mapping) > num_shared
        highlighted = {int(c.get_attribute("data-block")) for c in d.find_elements(By.CSS_SELECTOR, ".blk.hl")}
        assert highlighted == {p for _, p in mapping}
        assert [p for _, p in mapping[:num_shared]] == [b for b, *_ in shared]  # the prefix comes first
        shot = tmp_path / "inspector.png"
        assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("SLUICE_INSPECTOR_SCREENSHOT"):
            shutil.copy(shot, os.environ["SLUICE_INSPECTOR_SCREENSHOT"])
    finally:
        for t in threads:
            t.join()
    ids = {r.id for r in replies}
    assert holders <= ids and all(r.usage.completion_tokens == MAX_TOKENS for r in replies)

    # -- afterwards: every step the engine recorded is on the page, with its requests and token counts
    d.find_element(By.ID, "latest").click()
    records = list(engine.inspector.steps)
    stats = engine.stats()
    assert records[-1].step_id == stats.num_steps and records[0].step_id == 1
    WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "cursor").text == f"step {stats.num_steps}")
    rows = {step: (sid, segs) for step, sid, segs in d.execute_script(ROWS_JS)}
    assert sorted(rows) == [r.step_id for r in records]
    seen: set[str] = set()
    for rec in records:
        sid, segs = rows[rec.step_id]
        want = []
        for r in rec.requests:
            want.append([r.request_id, r.kind, r.num_tokens])
            if r.num_draft_tokens:
                want.append([r.request_id, "draft", r.num_draft_tokens])
        assert sid == str(rec.step_id) and segs == want
        seen.update(s[0] for s in segs)
    assert ids <= seen
    decodes = sum(s[2] for _, segs in rows.values() for s in segs if s[1] == "decode")
    assert decodes == len(QUESTIONS) * (MAX_TOKENS - 1)

    # -- the counters: the engine's own prefix-cache hit rate
    hit = d.find_element(By.ID, "c-hit")
    assert stats.prefix_cache_hits > 0
    assert hit.text == f"{100 * stats.prefix_cache_hit_rate:.2f}%"
    assert int(hit.get_attribute("data-hits")) == stats.prefix_cache_hits
    assert int(hit.get_attribute("data-queries")) == stats.prefix_cache_queries
    assert d.find_element(By.ID, "c-queue").text == "0 / 0"
    assert d.find_element(By.ID, "c-ttft").text.endswith(" ms")
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "favicon" not in e["message"]]
    assert errors == []
