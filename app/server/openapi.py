"""The OpenAPI 3.1 document of the HTTP API, its request and response schemas generated from `schemas.py`."""

from __future__ import annotations

from pydantic import BaseModel
from sluice.app.server import schemas as S
from sluice.core import __version__


def openapi_schema(with_auth: bool = False, metrics_auth: bool = False) -> dict:
    """OpenAPI 3.2 for the routes, with request and response schemas generated from `app.schemas`: every status
    a route answers, and (3.2's ``itemSchema``) each server-sent event of a stream: a chunk or an error as JSON,
    then ``[DONE]``."""
    spec = {
        "openapi": "3.2.0",
        "info": {"title": "sluice OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion", S.ChatCompletionRequest, S.ChatCompletionResponse, S.ChatCompletionChunk, with_auth
            ),
            "/v1/completions": _post(
                "Text completion", S.CompletionRequest, S.CompletionResponse, S.CompletionResponse, with_auth
            ),
            "/v1/models": _get(
                "The served model", {"application/json": {"schema": _ref(S.ModelList)}}, 503, secured=with_auth
            ),
            "/v1/models/{model}": _with_path_param(
                _get(
                    "A served model", {"application/json": {"schema": _ref(S.ModelCard)}}, 404, 503, secured=with_auth
                ),
                "model",
                "The model's id (404 unless it is the served one)",
            ),
            "/health": _health(),
            "/version": _get("The sluice version", _json_object(version={"type": "string"})),
            "/metrics": _get(
                "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, secured=with_auth and metrics_auth
            ),
            "/openapi.json": _get("This document", {"application/json": {"schema": {"type": "object"}}}),
        },
        "components": {"schemas": _component_schemas()},
    }
    if with_auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return spec


def _component_schemas() -> dict:
    """The request and response models' JSON schemas (requests as validated, responses as serialized)."""
    from pydantic.json_schema import models_json_schema

    models = [
        (S.ChatCompletionRequest, "validation"),
        (S.CompletionRequest, "validation"),
        (S.ChatCompletionResponse, "serialization"),
        (S.ChatCompletionChunk, "serialization"),
        (S.CompletionResponse, "serialization"),
        (S.ModelList, "serialization"),
        (S.ErrorResponse, "serialization"),
    ]
    _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    return defs.get("$defs", {})


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _errors(*codes: int) -> dict:
    return {
        str(c): {
            "description": ERROR_STATUSES[c],
            "content": {"application/json": {"schema": _ref(S.ErrorResponse)}},
        }
        for c in codes
    }


def _event_stream(chunk: type[BaseModel]) -> dict:
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [_ref(chunk), _ref(S.ErrorResponse)]},
            },
        ]
    }
    return {"itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}


def _security(secured: bool) -> dict:
    return {"security": [{"bearer": []}]} if secured else {}


def _post(summary: str, req: type[BaseModel], resp: type[BaseModel], chunk: type[BaseModel], with_auth: bool) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(req)}}},
            "responses": {
                "200": {
                    "description": "the completion, or with stream=true server-sent events: chunks (an error "
                    "object if the request fails mid-stream), then [DONE]",
                    "content": {
                        "application/json": {"schema": _ref(resp)},
                        "text/event-stream": _event_stream(chunk),
                    },
                },
                **_errors(400, *((401,) if with_auth else ()), 404, 408, 413, 500, 503),
            },
            **_security(with_auth),
        }
    }


def _get(summary: str, content: dict | None = None, *codes: int, secured: bool = False) -> dict:
    ok = {"description": "ok", **({"content": content} if content else {})}
    return {
        "get": {
            "summary": summary,
            "responses": {"200": ok, **_errors(*codes, *((401,) if secured else ()))},
            **_security(secured),
        }
    }


def _with_path_param(path_item: dict, name: str, description: str) -> dict:
    param = {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}
    return {"parameters": [param], **path_item}


def _json_object(**props: dict) -> dict:
    return {"application/json": {"schema": {"type": "object", "required": list(props), "properties": props}}}


def _health() -> dict:
    return {
        "get": {
            "summary": "200 while the engine serves requests, else 503",
            "responses": {
                str(code): {"description": what, "content": _json_object(status={"const": status})}
                for code, what, status in ((200, "serving", "ok"), (503, "not serving", "unhealthy"))
            },
        }
    }


ERROR_STATUSES = {
    400: "an invalid field (param names it), or a response over the size budget",
    401: "a missing or wrong API key",
    404: "an unknown model",
    408: "the request body did not arrive in time",
    413: "the request body is over the limit",
    500: "the request failed inside the engine",
    503: "overloaded (with Retry-After), shutting down, or the engine is not serving",
}
