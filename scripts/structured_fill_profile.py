"""`sluice bench ...` with the host's grammar-mask work split by part, summed per mask fill and printed at exit
(PROFILE): waiting for matchers (`_made`), llguidance's fill, the whole `GrammarRows.fill`, the bitmask's apply, the
matchers' advance (`accept_each`). The engine must run in this process (the CPU, or a GPU engine in-process).

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/structured_fill_profile.py structured --model ...
"""

import atexit
import sys
import time

from sluice.core.structured import llguidance_backend as lb
from sluice.core.structured import matchers

T = {"made": 0.0, "llg_fill": 0.0, "fill": 0.0, "apply": 0.0, "accept": 0.0, "n_fill": 0, "rows": 0}


def wrap(obj, name, key, count=False):
    f = getattr(obj, name)

    def w(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        T[key] += time.perf_counter() - t0
        if count:
            T["n_fill"] += 1
            T["rows"] += len(a[2])
        return r

    setattr(obj, name, w)


wrap(matchers.GrammarRows, "_made", "made")
wrap(lb.LLGuidanceBackend, "fill_bitmasks", "llg_fill")
wrap(matchers.GrammarRows, "fill", "fill", count=True)
wrap(matchers, "apply_token_bitmask_", "apply")
wrap(lb.LLGuidanceBackend, "accept_each", "accept")
atexit.register(
    lambda: print(
        "PROFILE",
        {k: (round(v * 1e3 / max(T["n_fill"], 1), 3) if isinstance(v, float) else v) for k, v in T.items()},
        "(ms per fill)",
        file=sys.stderr,
    )
)
from sluice.app.commands.cli import main  # noqa: E402 (after the patches, as the bench runs)

sys.argv = ["sluice", "bench"] + sys.argv[1:]
main()
