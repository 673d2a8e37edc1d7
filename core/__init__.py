"""sluice's engine: the public names of the library."""

from __future__ import annotations

import importlib.metadata

from sluice.core.args import EngineArgs
from sluice.core.engine import LLM, AsyncEngine
from sluice.core.errors import (
    EngineDeadError,
    EngineOverloaded,
    EngineStoppedError,
    InvalidRequestError,
    ModelLoadError,
    RequestFailedError,
    SluiceError,
)
from sluice.core.outputs import RequestOutput, Usage
from sluice.core.sampling_params import SamplingParams
from sluice.core.scheduler_actor import EngineStats

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
    "ModelLoadError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "SluiceError",
    "Usage",
    "__version__",
]
