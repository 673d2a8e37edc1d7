"""Host time of the grammar mask's launches on the GPU: the mask's two host-to-device copies and the bitmask
kernel, with the GPU idle and with work queued ahead (as in an engine step, behind its forward).

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/grammar_launch_cost.py
"""

import time

import torch
from sluice.core.structured.bitmask import apply_token_bitmask_

dev = torch.device("cuda")
V, R = 128256, 256
words = -(-V // 32)
logits = torch.randn(R, V, device=dev, dtype=torch.bfloat16)
host = torch.full((R, words), -1, dtype=torch.int32, pin_memory=True)
mask = torch.empty((R, words), dtype=torch.int32, device=dev)
rows_h = torch.arange(R, dtype=torch.int64, pin_memory=True)
rows = torch.empty(R, dtype=torch.int64, device=dev)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def one(busy: bool, c: int):
    if busy:
        for _ in range(20):
            torch.mm(a, a)  # ~ tens of ms of queued work, many launches
    t0 = time.perf_counter()
    m = mask[:c].copy_(host[:c], non_blocking=True)
    r = rows[:c].copy_(rows_h[:c], non_blocking=True)
    t1 = time.perf_counter()
    apply_token_bitmask_(logits, m, r)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    return t1 - t0, t2 - t1


for busy in (False, True):
    for c in (1, 32, 256):
        for _ in range(3):
            one(busy, c)
        res = [one(busy, c) for _ in range(20)]
        cp = sorted(x[0] for x in res)[10] * 1e6
        ap = sorted(x[1] for x in res)[10] * 1e6
        print(f"busy={busy} rows={c}: copies {cp:.0f} us, apply launch {ap:.0f} us (host, median)")
