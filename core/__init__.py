"""sluice's engine: the public names of the library.

They are resolved on first use (PEP 562), so that importing a lower floor of the engine, e.g. the wire codec
`sluice.core.ipc.wire`, loads neither torch nor the model runner; ``from sluice.core import AsyncEngine`` works
as usual.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING

from sluice.core import cpu_threads

# Before anything here loads torch (and with it OpenMP, which reads its wait policy once): idle OpenMP workers
# sleep instead of spinning against the engine's own threads (`core/cpu_threads.py`).
cpu_threads.prefer_passive_waits()

if TYPE_CHECKING:
    from sluice.core.args import EngineArgs
    from sluice.core.errors import (
        EngineDeadError,
        EngineOverloaded,
        EngineStoppedError,
        InvalidRequestError,
        InvalidStructuredOutput,
        ModelLoadError,
        RequestFailedError,
        SluiceError,
    )
    from sluice.core.frontend.engine import AsyncEngine
    from sluice.core.frontend.llm import LLM
    from sluice.core.outputs import RequestOutput, Usage
    from sluice.core.sampling_params import SamplingParams, StructuredOutputsParams
    from sluice.core.stats import EngineStats

_PUBLIC = {
    "LLM": "sluice.core.frontend.llm",
    "AsyncEngine": "sluice.core.frontend.engine",
    "EngineArgs": "sluice.core.args",
    "EngineDeadError": "sluice.core.errors",
    "EngineOverloaded": "sluice.core.errors",
    "EngineStoppedError": "sluice.core.errors",
    "EngineStats": "sluice.core.stats",
    "InvalidRequestError": "sluice.core.errors",
    "InvalidStructuredOutput": "sluice.core.errors",
    "ModelLoadError": "sluice.core.errors",
    "RequestFailedError": "sluice.core.errors",
    "RequestOutput": "sluice.core.outputs",
    "SamplingParams": "sluice.core.sampling_params",
    "SluiceError": "sluice.core.errors",
    "StructuredOutputsParams": "sluice.core.sampling_params",
    "Usage": "sluice.core.outputs",
}

try:  # the one source of the version: the installed distribution's metadata
    __version__ = importlib.metadata.version("sluice-llm")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineArgs",
    "EngineDeadError",
    "EngineOverloaded",
    "EngineStoppedError",
    "EngineStats",
    "InvalidRequestError",
    "InvalidStructuredOutput",
    "ModelLoadError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "SluiceError",
    "StructuredOutputsParams",
    "Usage",
    "__version__",
]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'sluice.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once resolved, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
