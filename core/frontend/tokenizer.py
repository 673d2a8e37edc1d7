"""Tokenizer loading, chat templates, and incremental detokenization."""

from __future__ import annotations

import uuid

from sluice.core.errors import InvalidRequestError, ModelLoadError


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # transformers raises several types for missing or broken tokenizer files
        raise ModelLoadError(f"cannot load the tokenizer in {tokenizer_dir}: {e}") from e


def apply_chat_template(
    tokenizer, messages: list[dict], split_special_tokens: bool = False, tools: list[dict] | None = None
) -> list[int]:
    """The prompt's token ids. With ``split_special_tokens`` the template's own special tokens stay special but
    each message's content is tokenized as plain text: "<|im_end|>" written by a user cannot end its turn and
    open a forged system turn.

    ``tools`` (OpenAI's ``{"type": "function", "function": ...}`` objects), assistant messages with ``tool_calls``
    and ``tool`` results go through the model's template when it renders tools (transformers' ``tools=``), else
    through the Hermes format (`hermes_tools`) inside the model's own turns."""
    norm = _normalized(messages)
    kwargs: dict = {}
    if tools or any(m["role"] == "tool" or "tool_calls" in m for m in norm):
        if _template_renders_tools(tokenizer):
            kwargs["tools"] = tools or None
        else:
            from sluice.core.frontend.hermes_tools import to_hermes_messages

            norm = to_hermes_messages(norm, tools)
    if split_special_tokens and _holds_special_text(tokenizer, norm):
        return _with_literal_content(tokenizer, norm, kwargs)
    ids = tokenizer.apply_chat_template(norm, tokenize=True, add_generation_prompt=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


_ROLES = ("system", "user", "assistant", "developer", "tool")


def _normalized(messages: list[dict]) -> list[dict]:
    """Each message as a template takes it: a string content (text parts joined), "developer" as "system", an
    assistant's ``tool_calls`` with their arguments as objects, a tool result's ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages: must be a non-empty list", param="messages")
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}]: needs a role of system, user, assistant or tool", param=f"messages[{i}].role"
            )
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"), i)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        norm.append(msg)
    return norm


def _text(content, i: int) -> str:
    if isinstance(content, list):  # OpenAI text parts
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InvalidRequestError(
            f"messages[{i}].content: must be a string or a list of text parts", param=f"messages[{i}].content"
        )
    return content


def _template_call(call: dict) -> dict:
    """An OpenAI tool call with its arguments (a JSON string on the wire) as an object, as templates expect
    (transformers' chat-template docs); arguments that are not JSON stay the string they were."""
    import json

    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {"type": "function", "id": call.get("id"), "function": fn}


def _template_renders_tools(tokenizer) -> bool:
    """Whether the model's chat template renders a ``tools`` list (templates that do name the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def _holds_special_text(tokenizer, messages: list[dict]) -> bool:
    """Whether some content holds the text of a token the tokenizer matches whole (special or added): only then
    is it tokenized apart from the template (content without such text tokenizes as it always did, also at its
    edges, where the template's text and the content's may merge)."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values()]
    return any(sp in m["content"] for m in messages for sp in specials)


def _with_literal_content(tokenizer, messages: list[dict], kwargs: dict | None = None) -> list[int]:
    """Render the template around placeholders, then tokenize the template's text with its special tokens and
    each content with none (`split_special_tokens`). A template that drops a message renders no placeholder
    for it, and its content is left out as it would be."""
    tag = uuid.uuid4().hex
    marks = [f"\ue000{tag}{i}\ue001" for i in range(len(messages))]  # private-use characters: in no real text
    text = tokenizer.apply_chat_template(
        [{**m, "content": mark} for m, mark in zip(messages, marks)],
        tokenize=False,
        add_generation_prompt=True,
        **(kwargs or {}),
    )
    ids: list[int] = []
    pos = 0
    for m, mark in zip(messages, marks):
        at = text.find(mark, pos)
        if at < 0:
            continue
        ids += tokenizer.encode(text[pos:at], add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
        pos = at + len(mark)
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)


# More new tokens than this in one `IncrementalDetokenizer.add` are decoded together (`_add_bulk`).
BULK_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is the final text.

    Decoding tokens one at a time breaks words (SentencePiece spaces) and multi-byte characters split
    across tokens. So it decodes a short window ``tokens[prefix_offset:]`` and emits what extends the
    already-emitted text of ``tokens[prefix_offset:read_offset]``; a window ending in U+FFFD (an
    incomplete UTF-8 sequence) emits nothing until the next token completes it.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.vocab_size = len(tokenizer)
        # transformers' decode wraps the Rust tokenizer's with per-id Python conversions that cost more than
        # the decoding; without its clean-up step the Rust tokenizer gives the same text directly.
        backend = getattr(tokenizer, "_tokenizer", None)
        clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend_decode = backend.decode if backend is not None and not clean_up else None
        # Skipped special tokens add no text: kept out of the window, which otherwise grows without end (and
        # each token decodes all of it) while a sequence emits nothing but them.
        self._skipped = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        # Start the window a few prompt tokens back so the first output token decodes in context.
        self.context = [t for t in prompt_token_ids[-5:] if t < self.vocab_size]
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        if len(new_token_ids) > BULK_TOKENS:
            delta = self._add_bulk(new_token_ids)
            if delta is not None:
                return delta
        delta = ""
        for t in new_token_ids:
            self.token_ids.append(t)
            if t >= self.vocab_size or t in self._skipped:
                continue  # ids past the tokenizer (random-weight models) and skipped special tokens carry no text
            self.context.append(t)
            prefix = self._decode(self.context[self.prefix_offset : self.read_offset])
            full = self._decode(self.context[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                piece = full[len(prefix) :]
                delta += piece
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.context)
        self.text += delta
        return delta

    def _add_bulk(self, new_token_ids: list[int]) -> str | None:
        """Many tokens at once (a final-only sequence's whole output): the window and the new tokens decoded
        once, not once per token. Leaves the state the per-token loop would (the window starts where the new
        text does); None, changing nothing, when the text ends in an incomplete character."""
        kept = [t for t in new_token_ids if t < self.vocab_size and t not in self._skipped]
        ctx = self.context
        prefix = self._decode(ctx[self.prefix_offset : self.read_offset])
        full = self._decode(ctx[self.prefix_offset :] + kept)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        self.token_ids += new_token_ids
        ctx += kept
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ctx)
        self.text += delta
        return delta
