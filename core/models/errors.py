"""Errors of the model layer. `SluiceError`, the base of every error sluice raises on purpose, lives here,
on the lowest floor that raises one, so that the models and the draft head never import the engine;
`sluice.core.errors` re-exports both."""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""


class ModelLoadError(SluiceError, ValueError):
    """The model cannot be loaded: unknown alias or path, unsupported architecture, bad weights."""
