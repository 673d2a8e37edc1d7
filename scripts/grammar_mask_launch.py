"""The grammar mask's launches on the GPU, as the host pays them (issue 37), in two tables:

1. host time of the mask's two host-to-device copies and of the bitmask kernel's launch, with the GPU idle and with
   work queued ahead (as in an engine step, behind its forward);
2. the kernel reading the mask from pinned host memory (mapped, no copy: the engine's way since f5b02f1) against
   copying it to the device first, behind queued work: host and device time per step at 32 and 256 rows, and
   whether the results are equal.

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/grammar_mask_launch.py
"""

import time

import torch
from sluice.core.structured.bitmask import apply_token_bitmask_

dev = torch.device("cuda")
V, R = 128256, 256
words = -(-V // 32)
logits = torch.randn(R, V, device=dev, dtype=torch.bfloat16)
host = torch.randint(-(2**31), 2**31 - 1, (R, words), dtype=torch.int32).pin_memory()
mask = torch.empty((R, words), dtype=torch.int32, device=dev)
rows_h = torch.arange(R, dtype=torch.int64).pin_memory()
rows = torch.empty(R, dtype=torch.int64, device=dev)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
scratch = logits.clone()  # table 1 masks these, leaving `logits` as they are for table 2


def queue_work(n: int) -> None:
    for _ in range(n):
        torch.mm(a, a)  # milliseconds of queued work each


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def launches(busy: bool, c: int) -> tuple[float, float]:
    """Host seconds of the two copies, then of the kernel's launch."""
    if busy:
        queue_work(20)
    t0 = time.perf_counter()
    m = mask[:c].copy_(host[:c], non_blocking=True)
    r = rows[:c].copy_(rows_h[:c], non_blocking=True)
    t1 = time.perf_counter()
    apply_token_bitmask_(scratch, m, r)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    return t1 - t0, t2 - t1


def mapped_or_copied(mode: str, c: int) -> tuple[float, float, torch.Tensor]:
    """Host seconds and device milliseconds of one step's mask, and the masked logits."""
    queue_work(10)
    x = logits.clone()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    if mode == "copy":
        apply_token_bitmask_(
            x, mask[:c].copy_(host[:c], non_blocking=True), rows[:c].copy_(rows_h[:c], non_blocking=True)
        )
    else:
        apply_token_bitmask_(x, host[:c], rows_h[:c])
    e1.record()
    h = time.perf_counter() - t0
    torch.cuda.synchronize()
    return h, e0.elapsed_time(e1), x


for busy in (False, True):
    for c in (1, 32, 256):
        for _ in range(3):
            launches(busy, c)
        res = [launches(busy, c) for _ in range(20)]
        cp, ap = (median([x[i] for x in res]) * 1e6 for i in (0, 1))
        print(f"busy={busy} rows={c}: copies {cp:.0f} us, apply launch {ap:.0f} us (host, median)")

ref = logits.clone()
apply_token_bitmask_(ref, mask.copy_(host), rows.copy_(rows_h))
for c in (32, 256):
    for mode in ("copy", "uva"):
        runs = [mapped_or_copied(mode, c) for _ in range(25)][5:]
        out = runs[0][2]
        ok = torch.equal(out[:c], ref[:c]) and torch.equal(out[c:], logits[c:])
        h, d = median([r[0] for r in runs]) * 1e6, median([r[1] for r in runs]) * 1e3
        print(f"rows={c} {mode}: host {h:.0f} us, device {d:.0f} us, equal to the copy's result: {ok}")
