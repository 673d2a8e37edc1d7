"""A chat request's tools, checked, and what they make of the turn: `ToolPlan`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sluice.app.server.tools.call_parser import ToolCallParser
from sluice.app.server.tools.grammar import arguments_json, auto_grammar, forced_grammar
from sluice.core.errors import InvalidRequestError

# OpenAI's rule for function names; it also keeps a name free of JSON escapes, so the call layout holds it as is.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function declared without parameters takes none: its arguments are always {}.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class ToolPlan:
    """How a turn with tools is generated and read: ``tools`` as the template shows them (OpenAI's objects),
    the grammar the turn must follow (llguidance Lark), and whether text may come before the calls (``auto``)."""

    tools: list[dict]
    grammar: str
    auto: bool

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.auto)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The plan of a request (its pydantic ``tools`` / ``tool_choice``), or None for a plain-text turn (no tools,
    or ``tool_choice: "none"``: the tools are not even shown to the model). Raises `InvalidRequestError` for a bad
    tool or a choice that names none of them."""
    named = getattr(getattr(tool_choice, "function", None), "name", None)
    if not tools:
        if named is not None or tool_choice == "required":
            raise InvalidRequestError("tool_choice: needs tools to choose from", param="tool_choice")
        return None
    if tool_choice == "none":
        return None
    schemas = _checked(tools)
    parallel = parallel_tool_calls is not False
    if named is not None:
        if named not in schemas:
            raise InvalidRequestError(f"tool_choice: no tool is named {named!r}", param="tool_choice")
        return ToolPlan(_shown(tools), forced_grammar({named: schemas[named]}, parallel), auto=False)
    if tool_choice == "required":
        return ToolPlan(_shown(tools), forced_grammar(schemas, parallel), auto=False)
    return ToolPlan(_shown(tools), auto_grammar(schemas, parallel), auto=True)


def _shown(tools: list[Any]) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools]


def _checked(tools: list[Any]) -> dict[str, dict]:
    """Each tool's name -> the JSON schema its arguments are held to (an object)."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn, where = tool.function, f"tools[{i}].function"
        if not _NAME.fullmatch(fn.name):
            raise InvalidRequestError(
                f"{where}.name: must be 1 to 64 letters, digits, '_' or '-', got {fn.name!r}", param=f"{where}.name"
            )
        if fn.name in schemas:
            raise InvalidRequestError(f"{where}.name: {fn.name!r} is named twice", param=f"{where}.name")
        schemas[fn.name] = _arguments_schema(fn.parameters, f"{where}.parameters")
    return schemas


def _arguments_schema(parameters: dict | None, where: str) -> dict:
    """The schema of a tool's arguments, checked by compiling it (llguidance, no tokenizer needed: ~ms)."""
    if parameters is None:
        return _NO_PARAMETERS
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(
            f"{where}: the arguments must be an object (type 'object'), got {kind!r}", param=where
        )
    schema = {**parameters, "type": "object"}
    import llguidance

    ok, errors = _validate(llguidance, f"start: %json {arguments_json(schema)}")
    if not ok:
        raise InvalidRequestError(f"{where}: not a usable JSON schema: {errors}", param=where)
    return schema


def _validate(llguidance: Any, lark: str) -> tuple[bool, str]:
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), None)
    except (ValueError, TypeError, RuntimeError) as e:  # a schema it cannot even read
        error = str(e) or type(e).__name__
    # The message points into the one-line grammar built here: its first line says what is wrong.
    return not error, error.strip().splitlines()[0] if error else ""


def constrain_to_tools(params: Any, plan: ToolPlan) -> None:
    """Hold the turn sampled with ``params`` to ``plan``'s grammar (the engine's structured outputs)."""
    from sluice.core.sampling_params import StructuredOutputsParams

    if params.structured_outputs is not None:
        raise InvalidRequestError(
            "tools: a turn that may call tools cannot also follow response_format or structured_outputs",
            param="tools",
        )
    params.structured_outputs = StructuredOutputsParams(grammar=plan.grammar)
