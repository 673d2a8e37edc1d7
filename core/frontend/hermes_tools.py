"""The Hermes tool-call format: how tools, calls and tool results are written into a chat, for a model whose own
chat template knows no tools (the default SmolLM2).

The tools are listed, one JSON object a line, inside ``<tools></tools>`` in the system prompt; a call is
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (several calls one a line); a tool's result goes back
in a user turn inside ``<tool_response></tool_response>``. This is NousResearch's Hermes 2 Pro format (Qwen2.5 uses
it too). Rather than a template of its own, the conversation is rewritten into plain system / user / assistant
messages and rendered by the model's own template, so the model's turn markers stay its own.

The server's tool-call grammar enforces the same call layout (`CALL_OPEN` ... `CALL_CLOSE`), and its parser reads
calls back by it, so what the model is shown, what it is made to write, and what is read back agree.
"""

from __future__ import annotations

import json
from typing import Any

# The layout of one generated call: CALL_OPEN + NAME_HEAD + name + ARGS_HEAD + arguments + CALL_CLOSE, and
# CALL_SEP between parallel calls. The separators are those of `json.dumps`, as a template's `tojson` writes them.
CALL_OPEN = "<tool_call>"
NAME_HEAD = '{"name": "'
ARGS_HEAD = '", "arguments": '
CALL_CLOSE = "}</tool_call>"
CALL_SEP = "\n"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>'
)


def tools_prompt(tools: list[dict]) -> str:
    """The system prompt's tool section: each tool as OpenAI gives it (``{"type": "function", "function": ...}``)."""
    return _INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it; ``arguments`` a JSON string (OpenAI's wire form) or an object."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_OPEN}{NAME_HEAD}{name}{ARGS_HEAD}{args}{CALL_CLOSE}"


def _assistant(m: dict) -> dict:
    calls = [call_text(c["function"]["name"], c["function"].get("arguments", "{}")) for c in m.get("tool_calls") or []]
    content = m.get("content") or ""
    return {"role": "assistant", "content": content + CALL_SEP.join(calls)}


def to_hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` (normalized: string contents; assistant ``tool_calls``; ``tool`` results) as plain system /
    user / assistant messages in the Hermes format. Consecutive tool results share one user turn, as templates
    that insist on alternating turns need."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append(_assistant(m))
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_turn"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_turn": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_turn", None)
    if tools:
        section = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {
                "role": "system",
                "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section,
            }
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
