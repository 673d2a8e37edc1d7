"""The package's structure: one import namespace (`sluice.*`), the declared package list, and the floor plan
of `../shared/docs/architecture.md` (app above the engine, above the draft head and the models, above kv)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("app", "core", "kv", "spec")
SOURCE_DIRS = (*PARTS, "tests", "scripts")

# The floors, lowest first: a module may import its own floor and the floors below it, never one above.
# `vocab` is the root of core/ (args, sampling params, errors, outputs, the step contract, the inbox messages);
# the other core floors are its sub-packages. The process bridge (`ipc`) sits just above the vocabulary it
# carries; the grammar engine (`structured`: backends, matchers, the bitmask kernel) above it, for the model
# runner and the front end; the policy (`sched`) and the model runner (`worker`) know nothing of the actors that
# drive them.
FLOORS = (
    "kv",
    "models",
    "spec",
    "core.vocab",
    "core.ipc",
    "core.structured",
    "core.sched",
    "core.worker",
    "core.engine_core",
    "core.frontend",
    "core.disagg",
    "core",  # core/__init__.py: the library's public names, from every floor below
    "app",
)
ALLOWED = {f: set(FLOORS[:i]) for i, f in enumerate(FLOORS)}
CORE_FLOORS = {f.split(".")[1] for f in FLOORS if f.startswith("core.") and f != "core.vocab"}


def python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module name `path` imports (at any depth, lazy imports too), relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = ["sluice", *rel.parts[:-1]] if rel.parts[0] in PARTS else list(rel.parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from sluice.core import models` imports the submodule (its package is being imported anyway)
            subs = [f"{name}.{a.name}" for a in node.names if module_path(f"{name}.{a.name}") is not None]
            out += [(node.lineno, n) for n in subs] if len(subs) == len(node.names) else [(node.lineno, name)]
    return out


def module_path(name: str) -> Path | None:
    """The file of module ``sluice.X...`` in this tree (a package's ``__init__.py``), or None."""
    parts = name.split(".")
    if parts[0] != "sluice" or len(parts) < 2:
        return None
    base = ROOT.joinpath(*parts[1:])
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "sluice" or len(parts) < 2 or parts[1] not in PARTS:
        return None
    return floor_of(parts[1:])


def floor_of(parts: list[str] | tuple[str, ...]) -> str:
    """The floor of a module given its path parts under the namespace (``["core", "sched", "scheduler"]``)."""
    if parts[0] != "core":
        return parts[0]
    if len(parts) == 1 or tuple(parts) == ("core", "__init__"):
        return "core"
    if len(parts) > 2 and parts[1] == "models":
        return "models"
    if len(parts) > 2 and parts[1] in CORE_FLOORS:
        return f"core.{parts[1]}"
    return "core.vocab"


def layer_of_file(path: Path) -> str:
    return floor_of(path.relative_to(ROOT).with_suffix("").parts)


def test_no_bare_imports_of_the_parts():
    """`import core` beside `import sluice.core` would load every module twice (and split its exception
    classes): every import names the namespace."""
    bare = re.compile(r"^(app|core|kv|spec)(\.|$)")
    found = [
        f"{p.relative_to(ROOT)}:{line}: {name}"
        for p in python_files(*SOURCE_DIRS)
        for line, name in imported_modules(p)
        if bare.match(name)
    ]
    assert not found, "bare imports (use sluice.*):\n" + "\n".join(found)


def test_declared_packages_are_the_folders_that_hold_an_init():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    assert tool["package-dir"] == {f"sluice.{p}": p for p in PARTS}
    on_disk = sorted(
        "sluice." + ".".join(init.parent.relative_to(ROOT).parts)
        for p in PARTS
        for init in (ROOT / p).rglob("__init__.py")
    )
    assert sorted(tool["packages"]) == on_disk
    assert project["project"]["name"] == "sluice-llm"
    assert project["project"]["scripts"]["sluice"] == "sluice.app.commands.cli:main"


def test_imports_follow_the_floor_plan():
    wrong = []
    for p in python_files(*PARTS):
        here = layer_of_file(p)
        for line, name in imported_modules(p):
            there = layer_of_module(name)
            if there is not None and there != here and there not in ALLOWED[here]:
                wrong.append(f"{p.relative_to(ROOT)}:{line}: {here} -> {there} ({name})")
    assert not wrong, "imports against the floor plan:\n" + "\n".join(wrong)


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of this tree it imports (lazy imports too)."""
    mods = {}
    for p in python_files(*PARTS):
        rel = p.relative_to(ROOT).with_suffix("").parts
        mods[".".join(("sluice", *(rel[:-1] if rel[-1] == "__init__" else rel)))] = p
    return {m: {n for _, n in imported_modules(p) if n in mods and n != m} for m, p in mods.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def test_no_import_cycles():
    """Modules that import each other (even lazily) are one concept split in two, or a type in the wrong place."""
    assert import_cycles(module_graph()) == []


def test_the_step_contract_is_not_the_schedulers():
    """The executor side (runner, TP workers, speculative steps) reads the step contract from its own module:
    only the engine core's wiring, its scheduler actor, the step recorder (it snapshots the queues and the KV
    pool), the cache simulator and the prefill/decode role schedulers (subclasses of the policy) know it."""
    users = {m for m, deps in module_graph().items() if "sluice.core.sched.scheduler" in deps}
    assert users <= {
        "sluice.core.engine_core.core",
        "sluice.core.engine_core.scheduler_actor",
        "sluice.core.engine_core.inspector",
        "sluice.app.commands.cache_replay",  # the cache simulator's replay
        "sluice.core.sched.disagg",
    }


def test_the_floor_plan_check_sees_a_forbidden_arrow():
    """The checkers themselves: a kv module importing the engine is caught, relative imports resolved, and a
    cycle is found."""
    probe = ROOT / "kv" / "_floor_plan_probe.py"
    probe.write_text("from ..core.sched import scheduler\nfrom .block_pool import BlockPool\nfrom .. import core\n")
    try:
        names = [n for _, n in imported_modules(probe)]
    finally:
        probe.unlink()
    assert names == ["sluice.core.sched.scheduler", "sluice.kv.block_pool", "sluice.core"]
    assert [layer_of_module(n) for n in names] == ["core.sched", "kv", "core"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_wire_codec_loads_no_torch():
    """The process bridge's codec sits on the engine's bottom floors: importing it (a front end's first import
    when the core runs elsewhere) loads neither torch nor the model runner."""
    import subprocess
    import sys

    code = (
        "import sys, sluice.core.ipc.wire\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('sluice.core.worker'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the wire codec loaded: {out}"


def test_sluice_variables_are_read_in_envs_only():
    """Every ``SLUICE_*`` environment variable is declared, typed and documented in `core/envs.py`, and read
    there only: elsewhere a variable's name as a string (``os.environ.get("SLUICE_X")``, ``os.getenv``, a
    mapping's ``get``) is a read that bypasses the registry. Names inside docs and longer strings are fine."""
    name = re.compile(r"^SLUICE_[A-Z0-9_]+$")
    envs_file = ROOT / "core" / "envs.py"
    outside = [
        f"{p.relative_to(ROOT)}:{node.lineno}: {node.value}"
        for p in python_files(*PARTS)
        if p != envs_file
        for node in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.match(node.value)
    ]
    assert not outside, "SLUICE_ variables read outside core/envs.py:\n" + "\n".join(outside)

    from sluice.core import envs

    tree = ast.parse(envs_file.read_text())
    read = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    read = {v for v in read if name.match(v)}
    typed = {
        n.target.id
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and name.match(n.target.id)
    }
    assert read == set(envs.environment_variables) == typed
    assert all(len(v.doc) > 20 for v in envs.environment_variables.values())


MAX_FUNCTION_LINES = 100


def test_no_function_over_a_hundred_lines():
    """A function fits a screen or two: longer ones are split along their steps. Triton kernels (``@triton.jit``)
    are exempt: a kernel's body is one program, and calls inside it are inlined anyway."""

    def is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)

    long = {
        f"{p.relative_to(ROOT)}: {fn.name}": fn.end_lineno - fn.lineno + 1
        for p in python_files(*PARTS)
        for fn in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
        and not is_kernel(fn)
    }
    over = [f"{where} ({n} lines)" for where, n in long.items()]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)
