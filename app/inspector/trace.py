"""Traces: JSON lines, each an object with a ``type``: a ``meta`` line, one ``step`` line per step record
(`core.inspector.StepRecord` as a dict), one ``request`` line per request that ended (`core.inspector.RequestRecord`:
``arrival_time``, ``prompt_token_ids``, ``output_len``, ``cache_salt``, ``reply_token_ids``), and a final ``kv``
line (`StepRecorder.kv_snapshot`). Written by ``sluice serve --record-trace`` (following a live engine's recorder)
and by ``sluice cache-sim --record-trace``. ``sluice inspect --trace`` reads the steps; ``sluice cache-sim --trace``
replays the requests (`sluice.app.bench.workloads.load_trace`, which also reads request lines written by hand)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, fields
from typing import Any

import anyio
from sluice.core.engine_core.inspector import RequestRecord, StepRecord, StepRequest

TRACE_VERSION = 1


_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))
_REQUEST_FIELDS = tuple(f.name for f in fields(StepRequest))


def step_dict(rec: StepRecord) -> dict:
    """``asdict(rec)``, several times faster (a page following the steps encodes every record)."""
    out = {name: getattr(rec, name) for name in _STEP_FIELDS}
    out["requests"] = [{name: getattr(r, name) for name in _REQUEST_FIELDS} for r in rec.requests]
    return out


class TraceWriter:
    def __init__(self, path: str, source: str, model: str, block_size: int, num_blocks: int) -> None:
        self.fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        meta = {"version": TRACE_VERSION, "source": source, "model": model, "block_size": block_size}
        self.write([self.line("meta", {**meta, "num_blocks": num_blocks, "created": time.time()})])

    @staticmethod
    def line(kind: str, body: dict) -> str:
        return json.dumps({"type": kind, **body}, separators=(",", ":")) + "\n"

    def step_lines(self, records: Iterable[StepRecord]) -> list[str]:
        return [self.line("step", step_dict(r)) for r in records]

    def request_lines(self, records: Iterable[RequestRecord]) -> list[str]:
        lines = []
        for r in records:
            body = {"arrival_time": round(r.arrival_time, 6), "prompt_token_ids": r.prompt_token_ids}
            body["output_len"] = r.output_len
            if r.cache_salt is not None:
                body["cache_salt"] = r.cache_salt
            body["reply_token_ids"] = r.reply_token_ids
            lines.append(self.line("request", body))
        return lines

    def write(self, lines: list[str]) -> None:
        self.fh.writelines(lines)

    def close(self, kv_snapshot: dict | None) -> None:
        if kv_snapshot is not None:
            self.write([self.line("kv", kv_snapshot)])
        self.fh.close()


@dataclass(slots=True)
class Trace:
    meta: dict[str, Any]
    steps: list[dict]
    kv: dict | None


def load_trace(path: str) -> Trace:
    """Read a trace; a bad line raises ValueError naming it."""
    meta, steps, kv = None, [], None
    with open(path, encoding="utf-8") as fh:
        for n, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
                kind = obj.pop("type")
            except (ValueError, KeyError, AttributeError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace line ({e})") from None
            if kind == "meta":
                meta = obj
            elif kind == "step":
                steps.append(obj)
            elif kind == "kv":
                kv = obj
    if meta is None:
        raise ValueError(f"{path}: no meta line: not an inspector trace")
    return Trace(meta, steps, kv)


@contextlib.asynccontextmanager
async def recording(engine: Any, path: str) -> AsyncIterator[None]:
    """While inside, append every step record of the running ``engine`` (inspector on) to a trace at
    ``path``; on exit, the records left and the final KV snapshot. File writes run in a worker thread, so
    the event loop (and the scheduler on it) never waits for the disk. A writer that falls more than
    `core.inspector.MAX_STEPS` steps behind loses the oldest (their step ids are missing)."""
    rec = engine.inspector
    rec.keep_requests()
    kv = rec.kv_snapshot()
    writer = TraceWriter(path, "serve", engine.model_name, kv["block_size"], kv["num_blocks"])
    last = 0

    async def follow() -> None:
        nonlocal last
        while True:
            await rec.wait(last)
            batch = rec.since(last)
            last = batch[-1].step_id
            lines = writer.step_lines(batch) + writer.request_lines(rec.take_ended_requests())
            await anyio.to_thread.run_sync(writer.write, lines)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
    finally:
        writer.write(writer.step_lines(rec.since(last)) + writer.request_lines(rec.take_ended_requests()))
        writer.close(rec.kv_snapshot())
