"""A GGUF file of a transformers model, written with the ``gguf`` package as llama.cpp's converter lays it out
(tensor names from gguf's own name map, Gemma norms stored as ``1 + w``, fused Phi-3 projections kept fused),
with a byte-level BPE tokenizer of `VOCAB_SIZE` tokens (a real vocabulary's tens of thousands of strings take
transformers' GGUF reader most of a minute per file): what a user's GGUF of that family holds, in float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB_SIZE = 259


def write_gguf(model, arch: str, path: Path) -> Path:
    """``model`` (a transformers causal LM) as the GGUF architecture ``arch`` (``gemma2``, ``phi3``, ...)."""
    import gguf

    cfg = model.config
    layers = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    _byte_tokenizer(w)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        base, suffix = name.rsplit(".", 1)
        data = t.detach().float().numpy()
        if arch.startswith("gemma") and base.endswith("norm"):
            data = data + 1.0  # llama.cpp multiplies by the stored weight; transformers subtracts 1 on reading
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_tokenizer(w) -> None:
    """GPT-2's 256 byte symbols, two merges and an end-of-text token (`VOCAB_SIZE` in all)."""
    symbols = _byte_symbols()
    merges = ["\u0120 t", "h e"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    assert len(tokens) == VOCAB_SIZE
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(merges)
    w.add_bos_token_id(VOCAB_SIZE - 1)
    w.add_eos_token_id(VOCAB_SIZE - 1)
    w.add_pad_token_id(VOCAB_SIZE - 1)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (``bytes_to_unicode``), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    keep += list(range(ord("\xae"), ord("\xff") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]
