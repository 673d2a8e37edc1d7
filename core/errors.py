"""Typed errors. Bad input raises a ``ValueError`` subclass whose message names the field or file."""

from __future__ import annotations

from sluice.core.models.errors import ModelLoadError, SluiceError

__all__ = [
    "EngineDeadError",
    "EngineOverloaded",
    "EngineStoppedError",
    "InvalidRequestError",
    "InvalidStructuredOutput",
    "ModelLoadError",
    "RequestFailedError",
    "SluiceError",
    "WorkerDiedError",
]


class InvalidRequestError(SluiceError, ValueError):
    """A request or sampling parameter is invalid; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidStructuredOutput(InvalidRequestError):
    """A request's structured output (JSON schema, regex, choice, grammar) is invalid or uses what the grammar
    engine does not support (HTTP 400): refused, never ignored."""

    def __init__(self, message: str, param: str | None = "structured_outputs") -> None:
        super().__init__(message, param)


class EngineOverloaded(SluiceError):
    """The waiting queue is full; try again later (HTTP 503)."""


class EngineDeadError(SluiceError):
    """The engine failed in a way that leaves the model unusable; every request fails."""


class EngineStoppedError(EngineDeadError):
    """The engine stopped (its ``async with`` ended, or the server shut down) before the request finished."""


class RequestFailedError(SluiceError):
    """A step that held this request failed; the engine keeps serving others."""


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker process exited: the model is incomplete, every request fails."""
