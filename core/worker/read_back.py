"""`ReadBackRings`: what a launched step's sampled tokens and timing come back to the host through, reused step
after step: pinned host buffers, two in turn (two steps may be in flight), and a ring of timing events."""

from __future__ import annotations

import torch


class ReadBackRings:
    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.on_device = device.type == "cuda"  # the CPU reads its tokens in place
        # pinned room for two steps' sampled tokens, whole from the start: allocating pinned memory while a step
        # runs may wait for the device (page-locking is a driver call), and the rows grow step by step as a burst
        # of prompts is admitted
        rows = max_rows if self.on_device else 0
        self._host_bufs = [torch.empty(rows, dtype=torch.long, pin_memory=self.on_device) for _ in range(2)]
        self._host_turn = 0
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(8)] if self.on_device else []
        self._event_turn = 0

    def event(self) -> torch.cuda.Event | None:
        """A timing event recorded now, from a ring (creating one per step costs host time): a step's two are
        read within the next two launches, each of which takes two more."""
        if not self.on_device:
            return None
        self._event_turn = (self._event_turn + 1) % len(self._events)
        event = self._events[self._event_turn]
        event.record()
        return event

    def host_tokens(self, n: int) -> torch.Tensor:
        """Pinned room for a step's sampled tokens; two in turn, as two steps may be in flight."""
        self._host_turn ^= 1
        buf = self._host_bufs[self._host_turn]
        if buf.numel() < n:
            buf = self._host_bufs[self._host_turn] = torch.empty(n, dtype=torch.long, pin_memory=True)
        return buf[:n]
