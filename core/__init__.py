"""sluice's engine. Public names are exported lazily, so `spec` can import `core.models` without
pulling in the engine (which imports `spec`)."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AsyncEngine": "core.engine",
    "LLM": "core.engine",
    "EngineArgs": "core.args",
    "SamplingParams": "core.sampling_params",
    "RequestOutput": "core.outputs",
    "Usage": "core.outputs",
    "EngineStats": "core.scheduler_actor",
    "SluiceError": "core.errors",
    "InvalidRequestError": "core.errors",
    "ModelLoadError": "core.errors",
    "EngineOverloaded": "core.errors",
    "EngineDeadError": "core.errors",
    "RequestFailedError": "core.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'core' has no attribute {name!r}")
