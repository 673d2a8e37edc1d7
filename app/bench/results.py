"""Result recording for `sluice bench ...`: machine and version facts, JSON result files, aligned console
tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sluice.core import __version__


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, memory (GiB) and GPUs (names via torch.cuda, empty without CUDA)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    mem = _memory_bytes()
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install should not stop a result from being written
        gpus = []
    return {
        "cpu": _cpu_model(),
        "cores": cores,
        "memory_gib": round(mem / 1024**3, 1) if mem else None,
        "gpu": gpus[0] if gpus else None,
        "gpu_count": len(gpus),
        "platform": platform.platform(),
    }


def machine_line() -> str:
    """The one-line machine and versions footer the benchmark commands print."""
    m, v = machine_info(), versions()
    where = f"{m['gpu_count']} x {m['gpu']}" if m["gpu"] else m["cpu"]
    return (
        f"machine: {where} ({m['cores']} cores); torch {v['torch']}, triton {v['triton']}, "
        f"transformers {v['transformers']}"
    )


def versions() -> dict[str, str | None]:
    """Versions of python, torch, transformers, triton (None when not importable) and sluice."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    out["sluice"] = __version__
    return out


def utc_now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_result(path: str | Path, command: str, model: str, dataset: Any, figures: Mapping[str, Any]) -> dict:
    """Write one benchmark result as JSON to `path` (parent directories created) and return it. Keys:
    `command`, `machine`, `versions`, `date` (ISO 8601, UTC), `model`, `dataset`, then the figures (which may
    not reuse those keys)."""
    record: dict[str, Any] = {
        "command": command,
        "machine": machine_info(),
        "versions": versions(),
        "date": utc_now_iso(),
        "model": model,
        "dataset": dataset,
    }
    clash = sorted(set(figures) & set(record))
    if clash:
        raise ValueError(f"figures may not use the reserved keys {clash}")
    record.update(figures)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return record


def command_line() -> str:
    """The current process's command line, for `write_result(command=...)` (`python -m pkg.mod ...` when run
    as a module)."""
    if not sys.argv:
        return ""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None and spec.name else Path(sys.argv[0]).name
    return " ".join([prog, *sys.argv[1:]])


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "" if v is None else str(v)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows (dicts) as an aligned text table: text left-aligned, numbers right-aligned; columns default to the
    union of the rows' keys in first-seen order."""
    if not rows:
        return ""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    numeric = [
        all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows if r.get(c) is not None)
        for c in columns
    ]
    widths = [max(len(c), *(len(row[j]) for row in cells)) for j, c in enumerate(columns)]

    def fmt(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    lines = [fmt(list(columns)), fmt(["-" * w for w in widths])]
    lines += [fmt(row) for row in cells]
    return "\n".join(lines)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, file=None) -> None:
    """Print `format_table(rows, columns)`."""
    text = format_table(rows, columns)
    if text:
        print(text, file=file if file is not None else sys.stdout)
