"""Let a trained draft head propose from the target's whole vocabulary (drop its reduced draft vocabulary).

    python scripts/spec_widen_draft_vocab.py HEAD_DIR [OUT_DIR]     # in place without OUT_DIR

The head's weights do not depend on the draft vocabulary: the head outputs a hidden state, the target's LM head
scores it, and the draft vocabulary only chooses which rows are scored. Training's regression loss pulls that
hidden state toward the target's own next feature, so the rows outside the old set score sensibly too; the
classification loss never saw them. Measured, not assumed: `sluice eval-draft` before and after
(`spec/heads/smollm2-135m-instruct/README.md`, run 8). The change is recorded in the config's ``training``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sluice.spec.eagle import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402


def widen(src: Path, dst: Path) -> int:
    cfg = json.loads((src / CONFIG_FILE).read_text())
    tensors = load_file(str(src / WEIGHTS_FILE))
    old = cfg.get("draft_vocab_size", 0)
    if not old:
        raise SystemExit(f"{src}: the head already drafts from the whole vocabulary")
    tensors.pop("draft_vocab")
    cfg["draft_vocab_size"] = 0
    cfg.setdefault("training", {})["draft_vocab_widened_from"] = old
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / WEIGHTS_FILE))
    (dst / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    return old


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    src = Path(args[0])
    dst = Path(args[1]) if len(args) > 1 else src
    old = widen(src, dst)
    print(f"{dst}: draft vocabulary {old} -> the target's whole vocabulary")


if __name__ == "__main__":
    main()
