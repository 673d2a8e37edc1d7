"""Where each engine step's host time goes, accumulated by phase: on the scheduler's side ``schedule``,
``update`` (appending the step's tokens) and ``deliver`` (routing events to requests); on the executor's
``prepare`` (applying the step's changes and building its inputs), ``launch`` (enqueueing the device work),
``wait`` (blocked on the device for a step's tokens) and ``collect`` (turning them into the step's
output). With a GPU, ``gpu`` is the device's time per step (CUDA events around each step's work), and
``gpu_idle`` the device's time between one step's end and the next one's start (its input copy, and any time the
host had not yet enqueued the step: what the run loses to the host), ``gpu_idle_eager`` the part of it before
steps run op by op (no CUDA graph). `AsyncEngine.host_profile` returns a snapshot."""

from __future__ import annotations

from dataclasses import dataclass, fields

PHASES = ("schedule", "prepare", "launch", "wait", "collect", "update", "deliver")


@dataclass(slots=True)
class HostProfile:
    steps: int = 0
    schedule: float = 0.0  # seconds
    prepare: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    collect: float = 0.0
    update: float = 0.0
    deliver: float = 0.0
    gpu: float = 0.0
    gpu_steps: int = 0
    gpu_idle: float = 0.0
    gpu_idle_eager: float = 0.0

    def copy(self) -> HostProfile:
        return HostProfile(*(getattr(self, f.name) for f in fields(self)))

    def merged(self, other: HostProfile) -> HostProfile:
        """This profile's scheduler-side phases with ``other``'s executor-side ones."""
        out = self.copy()
        for name in ("prepare", "launch", "wait", "collect", "gpu", "gpu_steps", "gpu_idle", "gpu_idle_eager"):
            setattr(out, name, getattr(other, name))
        return out

    def plus(self, other: HostProfile) -> HostProfile:
        return HostProfile(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def since(self, earlier: HostProfile) -> HostProfile:
        return HostProfile(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    @property
    def host(self) -> float:
        """Seconds of host work: every phase but the wait."""
        return self.schedule + self.prepare + self.launch + self.collect + self.update + self.deliver

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {name: 1e3 * getattr(self, name) / n for name in PHASES}
        out["host"] = 1e3 * self.host / n
        if self.gpu_steps:
            out["gpu"] = 1e3 * self.gpu / self.gpu_steps
            out["host_over_gpu"] = out["host"] / out["gpu"] if out["gpu"] else float("inf")
            out["gpu_idle"] = 1e3 * self.gpu_idle / self.gpu_steps
            out["gpu_idle_eager"] = 1e3 * self.gpu_idle_eager / self.gpu_steps
        return out
