"""Errors over HTTP, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: the error type,
and the mapping from the engine's typed errors and from request validation onto it."""

from __future__ import annotations

import logging

from pydantic import ValidationError
from sluice.app.server import schemas as S
from sluice.core.errors import (
    EngineDeadError,
    EngineOverloaded,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
    SluiceError,
)
from starlette.responses import JSONResponse

logger = logging.getLogger("sluice.server")


class APIError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        detail = S.ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return S.ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error() -> APIError:
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def engine_error(e: SluiceError, prompt_param: str = "prompt", retry_after_seconds: int = 1) -> APIError:
    """The HTTP answer to an engine error: 400 for bad input (``param`` named as the client sent it: for chat
    the prompt is the messages), 503 while the engine cannot serve, 500 for a request that failed inside the
    engine. The code says what happened, for a client's retry logic: ``engine_overloaded`` (with
    ``Retry-After``: retry here), ``server_shutting_down`` (a deliberate stop, `EngineStoppedError`: retry
    elsewhere), ``engine_dead`` (the engine failed: retry elsewhere, this server needs a restart),
    ``request_failed`` (this request only)."""
    if isinstance(e, InvalidRequestError):
        param = e.param
        if param == "prompt":
            param = prompt_param
        message = str(e)
        if param != e.param and e.param and message.startswith(e.param + ":"):
            message = param + message[len(e.param) :]
        return APIError(400, message, param=param)
    if isinstance(e, EngineOverloaded):
        return APIError(
            503,
            str(e),
            type="server_error",
            code="engine_overloaded",
            headers={"Retry-After": str(retry_after_seconds)},
        )
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), type="server_error", code="server_shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine has failed and cannot serve requests", type="server_error", code="engine_dead")
    if isinstance(e, RequestFailedError):
        logger.error("request failed: %s", e)
        return APIError(500, "the request failed inside the engine", type="server_error", code="request_failed")
    logger.error("engine error: %s", e)
    return APIError(503, "the engine is not serving requests", type="server_error", code="engine_unavailable")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param_of(loc: tuple) -> str | None:
    """``("messages", 0, "content", "list[TextPart]", 0, "text")`` -> ``"messages[0].content[0].text"``:
    pydantic puts the names of union members (type tags) into the path; they are not fields."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if not part.isidentifier() or part != part.lower() or part in _TYPE_TAGS:
            continue
        out += ("." if out else "") + part
    return out or None


def validation_error(e: ValidationError) -> APIError:
    """A request body that does not validate: 400 naming the first offending field."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        return APIError(400, "request body must be a JSON object")
    messages: list[str] = []
    for err in errors[:4]:
        p = _param_of(err["loc"])
        text = f"{p}: {err['msg']}" if p else err["msg"]
        if text not in messages:
            messages.append(text)
    return APIError(400, "; ".join(messages), param=_param_of(first["loc"]))
