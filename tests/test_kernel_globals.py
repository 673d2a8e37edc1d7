"""Every Triton kernel reads only globals a GPU compile accepts: other jitted functions, modules, and values wrapped
in ``tl.constexpr``. A plain ``int`` global works under the CPU interpreter but is refused when Triton compiles the
kernel for a GPU, which CI never does, so it is checked here from the source."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

PACKAGES = ("sluice.core", "sluice.kv", "sluice.spec")


def _kernels():
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional dependency this machine lacks: no kernel of ours lives there
                continue
            for name, obj in vars(module).items():
                if isinstance(obj, triton.runtime.jit.KernelInterface) and getattr(obj, "fn", None) is not None:
                    if obj.fn.__module__ == module.__name__:
                        yield f"{module.__name__}.{name}", obj.fn


def _global_reads(fn) -> set[str]:
    """Names ``fn`` loads that are neither its parameters nor assigned in it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    local = {a.arg for a in func.args.args + func.args.kwonlyargs}
    loads = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else local).add(node.id)
    return loads - local


def _allowed(value) -> bool:
    return isinstance(value, (types.ModuleType, tl.constexpr, triton.runtime.jit.KernelInterface))


def test_kernels_are_found():
    names = [n for n, _ in _kernels()]
    assert any(n.endswith("moe_decode._down_sum_kernel") for n in names)
    assert any(n.endswith("gemv._gemv_kernel") for n in names)


def test_every_kernel_reads_only_constexpr_globals():
    bad = []
    for name, fn in _kernels():
        for g in sorted(_global_reads(fn)):
            if g in fn.__globals__ and not _allowed(fn.__globals__[g]):
                bad.append(f"{name}: {g} = {fn.__globals__[g]!r}")
    assert not bad, "globals a GPU compile refuses (wrap them in tl.constexpr): " + "; ".join(bad)


def test_the_check_sees_a_plain_global(monkeypatch):
    """The check itself: a kernel reading a plain ``int`` global is named."""
    from sluice.core.models import moe_decode

    monkeypatch.setattr(moe_decode, "_BLOCK_M", 16)
    fn = moe_decode._gate_up_kernel.fn  # noqa: SLF001 (the kernel under test)
    assert "_BLOCK_M" in _global_reads(fn) and not _allowed(fn.__globals__["_BLOCK_M"])
