"""The OpenAI request fields that ask for structured output, and the one `StructuredOutputsParams` they become.

- OpenAI's ``response_format``: ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's ``structured_outputs`` object (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``,
  ``whitespace_flexible``), and its legacy names ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``.

At most one of them may ask for a constraint (two would have to agree; refused instead). Whatever cannot be
enforced is a 400 naming the field (fail closed): a missing schema here, an invalid or unsupported one when the
engine checks it against the tokenizer (`AsyncEngine.compile_structured_outputs`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sluice.core.errors import InvalidStructuredOutput
from sluice.core.sampling_params import StructuredOutputsParams

_CONFIG = ConfigDict(extra="ignore", strict=True, cache_strings="keys")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request object."""

    model_config = _CONFIG
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool | None = False


class StructuredOutputFields(BaseModel):
    """The fields, shared by chat and text completions (a mixin of their request models)."""

    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}'
    )
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="vLLM's: exactly one of json, json_object, regex, choice, grammar (llguidance Lark)."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Legacy: structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Legacy: structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="Legacy: structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Legacy: structured_outputs.grammar.")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint (None: free text); `InvalidStructuredOutput` naming the field otherwise."""
        asked = [(name, spec) for name, spec in self._asked() if spec is not None]
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise InvalidStructuredOutput(
                f"{asked[1][0]}: give one structured output, not several ({names})", asked[1][0]
            )
        return asked[0][1] if asked else None

    def _asked(self) -> list[tuple[str, StructuredOutputsParams | None]]:
        legacy = {
            "guided_json": ("json", self.guided_json),
            "guided_regex": ("regex", self.guided_regex),
            "guided_choice": ("choice", self.guided_choice),
            "guided_grammar": ("grammar", self.guided_grammar),
        }
        out = [("response_format", _from_response_format(self.response_format))]
        out.append(("structured_outputs", _from_field(self.structured_outputs)))
        out += [(name, _params(name, **{kind: v})) for name, (kind, v) in legacy.items() if v is not None]
        return out


def _from_response_format(rf: ResponseFormat | None) -> StructuredOutputsParams | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidStructuredOutput(
            'response_format: json_schema needs a schema ({"name": ..., "schema": {...}})', "response_format"
        )
    return _params("response_format", json=rf.json_schema.schema_)


def _from_field(so: StructuredOutputsField | None) -> StructuredOutputsParams | None:
    if so is None:
        return None
    return _params(
        "structured_outputs",
        json=so.json_,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        whitespace_flexible=bool(so.whitespace_flexible),
    )


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    """`StructuredOutputsParams`, its errors naming the request's own field."""
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidStructuredOutput as e:
        message = str(e).removeprefix("structured_outputs")
        raise InvalidStructuredOutput(field + message, field) from None
