"""OpenAI-compatible request and response models (chat completions, completions, models, errors).

Requests are validated strictly (a string is not silently turned into a number) and unknown fields are
ignored, as OpenAI-compatible servers do. Optional fields accept an explicit ``null``, meaning the default,
since many clients send every field. Responses are built from these models and serialized with
``exclude_unset`` where the wire format omits a field rather than sending ``null`` (stream deltas).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sluice.core.sampling_params import FLOAT32_MAX, MAX_LOGPROBS, SEED_MAX, SEED_MIN, TOP_K_MAX, SamplingParams

# A cap on n: each choice is a sequence in the engine, so an unbounded n is a denial of service.
MAX_N = 128


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- requests ----------------------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False


_UNSUPPORTED = "Not supported: a request that sets it is refused (400) rather than answered as if it were unset."


def _refuse_unsupported(req: BaseModel, allowed: dict[str, tuple]) -> None:
    """Fields a client sets to change the answer (JSON output, a tool call, biased tokens) that this server does
    not implement: refused, naming the field, rather than silently ignored (a 200 with prose instead)."""
    from sluice.core.errors import InvalidRequestError

    for name, harmless in allowed.items():
        value = getattr(req, name)
        if value not in harmless:
            raise InvalidRequestError(f"{name}: not supported by this server", param=name)


class _SamplingFields(_Request):
    """Fields shared by chat and text completions; ``None`` means the default."""

    model: str | None = Field(None, description="The served model name; omitted means the served model.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX, description="-1 disables top-k")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="A 64-bit seed.")
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=FLOAT32_MAX)
    cache_salt: str | None = Field(None, min_length=1, description="Prefix-cache isolation key (per tenant).")
    user: str | None = None
    logit_bias: Any = Field(None, description=_UNSUPPORTED)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises `InvalidRequestError` naming the field for what the schema cannot check alone."""
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
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Takes precedence over max_tokens.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Any = Field(None, description=_UNSUPPORTED)
    tool_choice: Any = Field(None, description='Only "none" (or unset): tools are not supported.')
    response_format: Any = Field(None, description='Only {"type": "text"} (or unset): no JSON mode or schema.')
    functions: Any = Field(None, description=_UNSUPPORTED)
    function_call: Any = Field(None, description=_UNSUPPORTED)

    def sampling_params(self) -> SamplingParams:
        from sluice.core.errors import InvalidRequestError

        _refuse_unsupported(
            self,
            {
                "tools": (None, []),
                "tool_choice": (None, "none"),
                "response_format": (None, {"type": "text"}),
                "functions": (None, []),
                "function_call": (None, "none"),
                "logit_bias": (None, {}),
            },
        )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # None: up to the end of the context window, as OpenAI does for chat.
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def prompt(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: str | list[Annotated[int, Field(ge=0)]] = Field(description="A string or a list of token ids.")
    max_tokens: int | None = Field(None, ge=1, description="Defaults to 16, as OpenAI does.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top logprobs per token.")
    echo: bool | None = Field(False, description="Not supported; true is rejected.")
    suffix: Any = Field(None, description=_UNSUPPORTED)
    best_of: Any = Field(None, description="Only 1 (or unset).")

    def sampling_params(self) -> SamplingParams:
        from sluice.core.errors import InvalidRequestError

        _refuse_unsupported(self, {"suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {})})
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


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


FinishReason = Literal["stop", "length", "abort"]


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


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
