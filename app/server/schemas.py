"""OpenAI-compatible request and response models (chat completions, completions, models, errors).

Requests are validated strictly (a string is not silently turned into a number) and unknown fields are
ignored, as OpenAI-compatible servers do. Optional fields accept an explicit ``null``, meaning the default,
since many clients send every field. Responses are built from these models and serialized with
``exclude_unset`` where the wire format omits a field rather than sending ``null`` (stream deltas).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError
from sluice.app.server.structured import StructuredOutputFields
from sluice.core.param_ranges import PARAM_RANGES
from sluice.core.sampling_params import SamplingParams

# A cap on n: each choice is a sequence in the engine, so an unbounded n is a denial of service.
MAX_N = 128
# OpenAI's own span for temperature, narrower than what the engine carries (`SamplingParams` takes up to 3.4e38).
MAX_TEMPERATURE = 2


def _in_range(param: str, hi: int | float | None = None) -> dict:
    """The bounds of a numeric field: its row of the one range table (`sluice.core.param_ranges`), so every value
    the schema lets through can be carried by every layer behind it; ``hi`` narrows it to this API's cap."""
    return PARAM_RANGES[param].bounds(hi)


# An item of a list of token ids (stop_token_ids, a prompt given as ids).
TokenId = Annotated[int, Field(**_in_range("token_id"))]


class _Request(BaseModel):
    # cache_strings="keys": the JSON parser's cache of short strings keeps the field names only; caching values
    # too (each prompt a new string) grows a long-running server by ~1 MiB before the cache fills
    # (docs/benchmarks.md, the reliability campaign's soak)
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- requests ----------------------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCallIn(BaseModel):
    """A call of an earlier assistant turn, sent back in ``messages``."""

    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="A tool result: the call it answers.")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    name: str = Field(description="Letters, digits, '_' and '-', at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = Field(None, description="Arguments always follow the schema here, strict or not.")


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    type: Literal["function"]
    function: FunctionName


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, cache_strings="keys")
    include_usage: bool | None = False


_UNSUPPORTED = "Not supported: a request that sets it is refused (400) rather than answered as if it were unset."

# Fields a client sets to change the answer (JSON output, a tool call, biased tokens, several candidates) that
# this server does not implement, with the values that ask for nothing (accepted as if unset). Any other value is
# refused naming the field, rather than silently ignored (a 200 with prose instead).
_HARMLESS: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


def _only_harmless(name: str) -> Any:
    """The field's type: any JSON value (so the refusal names the field as unsupported, not as mistyped), while
    the OpenAPI document lists exactly its harmless values, so the document and the behaviour agree."""
    values = [{"type": "null"} if v is None else {"const": v} for v in _HARMLESS[name]]
    return Annotated[Any, WithJsonSchema({"anyOf": values})]


def _is_harmless(value: Any, harmless: tuple) -> bool:
    # Equal and of the same JSON kind: true == 1 in Python, but a JSON true is not the number 1.
    return any(value == h and isinstance(value, bool) == isinstance(h, bool) for h in harmless)


def _refuse_unsupported(req: BaseModel, names: tuple[str, ...]) -> None:
    from sluice.core.errors import InvalidRequestError

    for name in names:
        if not _is_harmless(getattr(req, name), _HARMLESS[name]):
            raise InvalidRequestError(f"{name}: not supported by this server", param=name)


Functions = _only_harmless("functions")
FunctionCall = _only_harmless("function_call")
LogitBias = _only_harmless("logit_bias")
Suffix = _only_harmless("suffix")
BestOf = _only_harmless("best_of")


class _SamplingFields(_Request, StructuredOutputFields):
    """Fields shared by chat and text completions; ``None`` means the default. Structured outputs
    (``response_format``, ``structured_outputs``, ``guided_*``): `app/server/structured.py`."""

    model: str | None = Field(None, description="The served model name; omitted means the served model.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, **_in_range("n", MAX_N))
    max_tokens: int | None = Field(None, **_in_range("max_tokens"))
    min_tokens: int | None = Field(None, **_in_range("min_tokens"))
    temperature: float | None = Field(None, **_in_range("temperature", MAX_TEMPERATURE))
    top_p: float | None = Field(None, **_in_range("top_p"))
    top_k: int | None = Field(None, **_in_range("top_k"), description="-1 disables top-k")
    min_p: float | None = Field(None, **_in_range("min_p"))
    seed: int | None = Field(None, **_in_range("seed"), description="A 64-bit seed.")
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = Field(None, **_in_range("presence_penalty"))
    frequency_penalty: float | None = Field(None, **_in_range("frequency_penalty"))
    repetition_penalty: float | None = Field(None, **_in_range("repetition_penalty"))
    cache_salt: str | None = Field(None, min_length=1, description="Prefix-cache isolation key (per tenant).")
    user: str | None = None
    logit_bias: LogitBias = Field(None, description=_UNSUPPORTED)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises `InvalidRequestError` naming the field for what the schema cannot check alone."""
        from sluice.core.errors import InvalidRequestError

        if self.stream_options is not None and not self.stream:
            # As OpenAI and vLLM answer: silently ignoring it would hide a client's mistake (no usage chunk).
            raise InvalidRequestError("stream_options: only allowed when stream is true", param="stream_options")
        given = {
            name: getattr(self, name)
            for name in (
                "n",
                "min_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "cache_salt",
            )
        }
        # Unset fields keep SamplingParams' own defaults, so there is one place that defines them.
        kwargs = {k: v for k, v in given.items() if v is not None}
        structured = self.structured_outputs_params()
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured, **kwargs)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None, **_in_range("max_tokens"), description="Takes precedence over max_tokens."
    )
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, **_in_range("logprobs"))
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" when there are tools, else "none"; "required" or a named function forces a call.'
    )
    parallel_tool_calls: bool | None = Field(None, description="Several calls in one turn (default true).")
    functions: Functions = Field(None, description=_UNSUPPORTED)
    function_call: FunctionCall = Field(None, description='Only "none" (or unset): functions are not supported.')

    def sampling_params(self) -> SamplingParams:
        from sluice.core.errors import InvalidRequestError

        _refuse_unsupported(self, ("functions", "function_call", "logit_bias"))
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # None: up to the end of the context window, as OpenAI does for chat.
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def prompt(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] = Field(description="A string or a list of token ids.")
    max_tokens: int | None = Field(None, **_in_range("max_tokens"), description="Defaults to 16, as OpenAI does.")
    logprobs: int | None = Field(None, **_in_range("logprobs"), description="Top logprobs per token.")
    echo: bool | None = Field(False, description="Not supported; true is rejected.")
    suffix: Suffix = Field(None, description=_UNSUPPORTED)
    best_of: BestOf = Field(None, description="Only 1 (or unset): one candidate per choice.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """A list of prompts (strings or token-id lists), which OpenAI batches, is refused in words rather than
        with the type errors of each member."""
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise PydanticCustomError(
                "prompt_list", "a list of prompts is not supported: send one prompt (a string or token ids) per request"
            )
        return prompt

    def sampling_params(self) -> SamplingParams:
        from sluice.core.errors import InvalidRequestError

        _refuse_unsupported(self, ("suffix", "best_of", "logit_bias"))
        if self.echo:
            raise InvalidRequestError("echo: not supported", param="echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        return self._sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


# -- responses ---------------------------------------------------------------------------------------------


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorDetail


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprobInfo] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A message without calls is sent as before tools were (no "tool_calls": null).
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A fragment of a streamed call: the first carries ``id``, ``type`` and the name, the next ones pieces of
    the arguments; ``index`` tells the calls of one turn apart."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Response):
    """Also the stream chunk of /v1/completions (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
