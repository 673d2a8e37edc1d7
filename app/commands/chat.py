"""`sluice chat`: an interactive chat in the terminal over the engine.

Replies stream as they are generated. The conversation is kept: each turn sends the whole history through the
model's chat template (the prefix cache serves what earlier turns already computed). ``/reset`` starts over,
``/exit`` or Ctrl-D leaves, Ctrl-C stops a reply (and at the prompt, leaves). In a terminal, lines are edited
as in a shell (readline: arrows, Ctrl-R) and earlier sessions' lines are kept in
``$SLUICE_CACHE_DIR/chat_history``. The KV pool holds one conversation (max_model_len tokens), not a server's
load, and the engine's log lines stay hidden unless ``--verbose``.

The engine runs on its own event loop in a background thread (an anyio blocking portal, as `LLM` does), so the
terminal's ``input()`` and Ctrl-C stay in the main thread, where Python delivers them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import queue
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from sluice.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sluice.core.frontend.engine import AsyncEngine

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"


class ChatSession:
    """A conversation with an engine running behind ``portal``; `send` streams the reply to one user turn."""

    def __init__(self, portal, engine: AsyncEngine, params: SamplingParams, system: str | None = None) -> None:
        self.portal, self.engine, self.params, self.system = portal, engine, params, system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str) -> Iterator[str]:
        """Yield the reply's text as it is generated; the turn and the reply (as far as it got, if stopped) join
        the history. A request the engine refuses (too long, say) leaves the history as it was."""
        self.messages.append({"role": "user", "content": text})
        deltas: queue.Queue[str | None] = queue.Queue()

        async def run() -> None:
            async for out in self.engine.generate(list(self.messages), self.params):
                deltas.put(out.delta_text)

        future = self.portal.start_task_soon(run)
        future.add_done_callback(lambda _: deltas.put(None))
        reply: list[str] = []
        try:
            while (delta := deltas.get()) is not None:
                reply.append(delta)
                yield delta
            future.result()  # the engine's error, if it failed
        except BaseException:
            future.cancel()  # cancelling the task aborts the request and frees its KV blocks
            if not reply:
                self.messages.pop()
                raise
            self.messages.append({"role": "assistant", "content": "".join(reply)})
            raise
        self.messages.append({"role": "assistant", "content": "".join(reply)})


def chat_loop(session: ChatSession, stdin: TextIO, stdout: TextIO) -> None:
    """Read turns until ``/exit`` or end of input; print each reply as it streams."""
    interactive = stdin.isatty()
    print(f"sluice chat with {session.engine.model_name}: {HELP}", file=stdout)
    while True:
        try:
            if interactive:
                line = input(">>> ")
            else:
                stdout.write(">>> ")
                line = stdin.readline()
                if not line:
                    raise EOFError
                stdout.write(line if line.endswith("\n") else line + "\n")
        except (EOFError, KeyboardInterrupt):
            print(file=stdout)
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            print("(new conversation)", file=stdout)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}: {HELP}", file=stdout)
            continue
        try:
            for delta in session.send(text):
                stdout.write(delta)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        except ValueError as e:  # the request is invalid: the conversation outgrew max_model_len, say
            stdout.write(f"error: {e} (/reset starts over)")
        stdout.write("\n")


HISTORY_LINES = 1000


@contextlib.contextmanager
def line_editing(history: Path) -> Iterator[bool]:
    """readline's line editing for ``input()`` where Python has it (not on Windows), with ``history`` read at
    the start and written back at the end (at most `HISTORY_LINES`). Yields whether it is on."""
    try:
        import readline
    except ImportError:
        yield False
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(history)
    readline.set_history_length(HISTORY_LINES)
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)


def chat_engine_args(ns: argparse.Namespace):
    """The engine for one conversation: the flags, with a KV pool of one sequence unless --num-kv-blocks."""
    import dataclasses

    from sluice.app.commands.cli import engine_args_from, one_sequence_kv_blocks

    return dataclasses.replace(engine_args_from(ns), num_kv_blocks=one_sequence_kv_blocks(ns))


def cmd_chat(ns: argparse.Namespace) -> int:
    from anyio.from_thread import start_blocking_portal
    from sluice.core import envs
    from sluice.core.frontend.engine import AsyncEngine  # the engine (torch) loads here, not for `sluice --help`

    if not ns.verbose:  # the conversation, not the engine's start-up lines (warnings and errors still show)
        logging.getLogger().setLevel(logging.WARNING)
    args = chat_engine_args(ns)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.sampling_seed)
    with contextlib.ExitStack() as stack:
        if sys.stdin.isatty():
            stack.enter_context(line_editing(envs.SLUICE_CACHE_DIR / "chat_history"))
        portal = stack.enter_context(start_blocking_portal())
        engine = stack.enter_context(portal.wrap_async_context_manager(AsyncEngine(args)))
        chat_loop(ChatSession(portal, engine, params, ns.system), sys.stdin, sys.stdout)
    return 0


def register(subparsers) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = subparsers.add_parser(
        "chat", help="chat with the model in the terminal (streaming, with history)", description=__doc__
    )
    p.add_argument("--system", default=None, help="a system prompt for the conversation (default: none)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default: %(default)s)")
    p.add_argument("--sampling-seed", type=int, default=None, help="seed for reproducible replies (default: none)")
    p.add_argument("--verbose", action="store_true", help="show the engine's log lines (INFO) too")
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)
