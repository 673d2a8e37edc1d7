"""Typed errors. Bad input raises a ``ValueError`` subclass whose message names the field or file."""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""


class InvalidRequestError(SluiceError, ValueError):
    """A request or sampling parameter is invalid; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(SluiceError, ValueError):
    """The model cannot be loaded: unknown alias or path, unsupported architecture, bad weights."""


class EngineOverloaded(SluiceError):
    """The waiting queue is full; try again later (HTTP 503)."""


class EngineDeadError(SluiceError):
    """The engine failed in a way that leaves the model unusable; every request fails."""


class RequestFailedError(SluiceError):
    """A step that held this request failed; the engine keeps serving others."""


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker process exited: the model is incomplete, every request fails."""
