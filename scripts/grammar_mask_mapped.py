"""The bitmask kernel reading the mask from pinned host memory (mapped: no copy) against copying it to the device
first: host and device time per step at 32 and 256 rows, behind queued work, and equal results.

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/grammar_mask_mapped.py
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
ref = logits.clone()
apply_token_bitmask_(ref, mask.copy_(host), rows.copy_(rows_h))
torch.cuda.synchronize()
for c in (32, 256):
    for mode in ("copy", "uva"):
        hs, ds = [], []
        for i in range(25):
            for _ in range(10):
                torch.mm(a, a)
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
            if i >= 5:
                hs.append(h)
                ds.append(e0.elapsed_time(e1))
            if i == 0:
                ok = torch.equal(x[:c], ref[:c]) and torch.equal(x[c:], logits[c:])
        hs.sort()
        ds.sort()
        print(f"rows={c} {mode}: host {hs[10] * 1e6:.0f} us, device {ds[10] * 1e3:.0f} us, equal to the copy's: {ok}")
