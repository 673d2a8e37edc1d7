"""The grammar of a tool-calling turn, in llguidance's Lark syntax (its ``docs/syntax.md``).

Each tool is a rule: the call's fixed head with the tool's name, then its arguments as ``%json`` of the tool's
``parameters`` (so they validate), then the fixed tail. Whitespace inside the arguments is that of `json.dumps`
and nothing more (``whitespace_flexible`` off), so a random-weight model cannot pad a call forever, and the parser
can rely on the exact layout.

- forced (``required`` or a named function): the turn is one call, or calls one a line when parallel calls are on.
- ``auto``: free text that never contains the call's opening tag, or text up to that tag (a lazy lexeme: it ends
  at the first tag) followed by the calls. So once the model writes ``<tool_call>`` the call is enforced.
"""

from __future__ import annotations

import json

from sluice.core.frontend.hermes_tools import ARGS_HEAD, CALL_CLOSE, CALL_OPEN, CALL_SEP, NAME_HEAD

# llguidance's JSON options for the arguments: json.dumps' separators, no other whitespace.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escaping is a subset Lark reads)."""
    return json.dumps(text)


def arguments_json(parameters: dict) -> str:
    """The ``%json`` body of a tool's arguments."""
    return json.dumps({**parameters, "x-guidance": _JSON_LAYOUT}, ensure_ascii=False)


def tool_rules(tools: dict[str, dict]) -> list[str]:
    """``call`` (one call of any of ``tools``: name -> parameters) and a rule per tool."""
    names = [f"tool_{i}" for i in range(len(tools))]
    rules = [f"call: {_lit(CALL_OPEN)} ({' | '.join(names)}) {_lit(CALL_CLOSE)}"]
    for rule, (name, params) in zip(names, tools.items()):
        rules.append(f"{rule}: {_lit(NAME_HEAD + name + ARGS_HEAD)} %json {arguments_json(params)}")
    return rules


def forced_grammar(tools: dict[str, dict], parallel: bool) -> str:
    """A turn that is calls only: one, or (``parallel``) one or more, one a line."""
    start = f"start: call ({_lit(CALL_SEP)} call)*" if parallel else "start: call"
    return "\n".join([start, *tool_rules(tools)])


def auto_grammar(tools: dict[str, dict], parallel: bool) -> str:
    """A turn of free text, or of text then calls (the first call opened by the lazy ``lead``)."""
    more = f" ({_lit(CALL_SEP)} call)*" if parallel else ""
    open_tag = json.dumps(CALL_OPEN)[1:-1]
    return "\n".join(
        [
            f"start: TEXT | lead call_body {_lit(CALL_CLOSE)}{more}",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){open_tag}(?s:.*)/",
            f"lead[lazy]: /(?s:.*){open_tag}/",
            f"call_body: {' | '.join(f'tool_{i}' for i in range(len(tools)))}",
            *tool_rules(tools),
        ]
    )
