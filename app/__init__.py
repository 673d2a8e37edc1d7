"""The outside world: HTTP server, CLI, metrics, benchmarks. ``app.build_app(engine)`` is the embeddable
API; it is exported lazily so the CLI starts without importing the server stack."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "build_app":
        from sluice.app.server.app import build_app

        return build_app
    raise AttributeError(f"module 'sluice.app' has no attribute {name!r}")
