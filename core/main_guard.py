"""The main-guard check: an engine that spawns processes (tensor-parallel workers, the engine core) refuses to
start from a script's unguarded top level, and says what to do.

multiprocessing's spawn re-runs the main script's top level in every new process; an engine started there
would start processes of its own in each, and Python kills them with its bootstrapping error instead of a
message that names the fix."""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import sys
import threading

from sluice.core.errors import SluiceError


def main_guard_hint(what: str = "tensor_parallel_size > 1 starts its workers") -> str:
    return (
        f"{what} with multiprocessing's spawn, which re-runs the main script's top level in every new process: "
        'start the engine under `if __name__ == "__main__":`'
    )


MAIN_GUARD_HINT = main_guard_hint()


def check_main_guard(what: str | None = None) -> None:
    """Refuse to spawn workers from a script's unguarded top level, with what to do. A spawned worker re-runs
    the main script's top level; an engine started there would start workers of its own, and Python kills
    the worker with its bootstrapping error instead. Checked here, in the engine's process (the main thread
    runs the script's line outside any ``if __name__ == "__main__":``), and in a worker re-running it."""
    hint = MAIN_GUARD_HINT if what is None else main_guard_hint(what)
    if getattr(mp.current_process(), "_inheriting", False):  # a spawned worker, still importing the script
        raise SluiceError(hint)
    line = _unguarded_main_line()
    if line is not None:
        raise SluiceError(f"{hint} (line {line} of {sys.modules['__main__'].__file__} is not)")


def _unguarded_main_line() -> int | None:
    """The line of the main script's top level that the main thread runs now, if spawn would run it again;
    None where it would not (guarded, or no script: ``python -c``, a REPL, a notebook)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    # CPython's one way to read another thread's frame (noqa: the name is private, the function is documented)
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or not path or not os.path.isfile(path):
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
                return None
    return line


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}
