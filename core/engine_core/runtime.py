"""Process-wide settings an engine holds while it runs: the frozen heap and the GIL's switch interval."""

from __future__ import annotations

import gc
import sys


def freeze_heap() -> None:
    """Collect, then move every object alive to the garbage collector's permanent generation (`gc.freeze`).

    A started engine holds hundreds of thousands of long-lived objects (the model's modules and parameters, the
    tokenizer, compiled kernels and their caches, the block pool). The cyclic collector's full collections
    traverse them all, and the allocation of a burst of requests triggers such collections: pauses of tens to
    hundreds of milliseconds with the device idle. Frozen objects are skipped (reference counting still frees
    them). `unfreeze_heap` when the engine stops makes a stopped engine's cycles collectable again."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    gc.unfreeze()


_switch = {"holders": 0, "saved": 0.005}  # engines running with a shortened interval; the interval before them


def shorten_switch_interval(ms: float) -> bool:
    """Shorten the interpreter's GIL switch interval to ``ms`` while the engine runs (0: leave it); True if
    shortened, to be undone by `restore_switch_interval` when it stops (engines running at once share it: the
    first sets it, the last restores it).

    The executor launches each step from a worker thread, beside the event loop's thread. Every torch op and
    kernel launch lets go of the GIL for a moment; when the loop's thread is busy (admitting a burst of
    requests, streaming outputs), it takes the GIL then, and the launching thread waits for the switch interval
    (5 ms by default) to get it back: a step of a few hundred ops is launched at a few ops per interval, the
    device idle. A short interval bounds each of those waits."""
    if ms <= 0:
        return False
    if _switch["holders"] == 0:
        _switch["saved"] = sys.getswitchinterval()
        sys.setswitchinterval(ms / 1000)
    _switch["holders"] += 1
    return True


def restore_switch_interval() -> None:
    _switch["holders"] -= 1
    if _switch["holders"] == 0:
        sys.setswitchinterval(_switch["saved"])
