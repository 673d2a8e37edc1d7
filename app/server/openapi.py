"""The OpenAPI 3.1 document of the HTTP API, its request and response schemas generated from `schemas.py`."""

from __future__ import annotations

from pydantic import BaseModel
from sluice.app.server import schemas as S
from sluice.core import __version__


def openapi_schema(with_auth: bool = False, metrics_auth: bool = False) -> dict:
    """OpenAPI 3.2 for the routes, with request and response schemas generated from `app.schemas`: every status
    a route answers, and (3.2's ``itemSchema``) each server-sent event of a stream: a chunk or an error as JSON,
    then ``[DONE]``."""
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

    def ref(model: type[BaseModel]) -> dict:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def errors(*codes: int) -> dict:
        return {
            str(c): {
                "description": ERROR_STATUSES[c],
                "content": {"application/json": {"schema": ref(S.ErrorResponse)}},
            }
            for c in codes
        }

    def event_stream(chunk: type[BaseModel]) -> dict:
        data = {
            "anyOf": [
                {"const": "[DONE]"},
                {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [ref(chunk), ref(S.ErrorResponse)]},
                },
            ]
        }
        return {"itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}

    security = {"security": [{"bearer": []}]} if with_auth else {}

    def post(summary: str, req: type[BaseModel], resp: type[BaseModel], chunk: type[BaseModel]) -> dict:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req)}}},
                "responses": {
                    "200": {
                        "description": "the completion, or with stream=true server-sent events: chunks (an error "
                        "object if the request fails mid-stream), then [DONE]",
                        "content": {
                            "application/json": {"schema": ref(resp)},
                            "text/event-stream": event_stream(chunk),
                        },
                    },
                    **errors(400, *((401,) if with_auth else ()), 404, 408, 413, 500, 503),
                },
                **security,
            }
        }

    def get(summary: str, content: dict | None = None, *codes: int, secured: bool = False) -> dict:
        ok = {"description": "ok", **({"content": content} if content else {})}
        return {
            "get": {
                "summary": summary,
                "responses": {"200": ok, **errors(*codes, *((401,) if secured else ()))},
                **(security if secured else {}),
            }
        }

    def json_object(**props: dict) -> dict:
        return {"application/json": {"schema": {"type": "object", "required": list(props), "properties": props}}}

    health = {
        "get": {
            "summary": "200 while the engine serves requests, else 503",
            "responses": {
                str(code): {"description": what, "content": json_object(status={"const": status})}
                for code, what, status in ((200, "serving", "ok"), (503, "not serving", "unhealthy"))
            },
        }
    }
    spec = {
        "openapi": "3.2.0",
        "info": {"title": "sluice OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/chat/completions": post(
                "Chat completion", S.ChatCompletionRequest, S.ChatCompletionResponse, S.ChatCompletionChunk
            ),
            "/v1/completions": post("Text completion", S.CompletionRequest, S.CompletionResponse, S.CompletionResponse),
            "/v1/models": get(
                "The served model", {"application/json": {"schema": ref(S.ModelList)}}, 503, secured=with_auth
            ),
            "/health": health,
            "/version": get("The sluice version", json_object(version={"type": "string"})),
            "/metrics": get(
                "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, secured=with_auth and metrics_auth
            ),
            "/openapi.json": get("This document", {"application/json": {"schema": {"type": "object"}}}),
        },
        "components": {"schemas": defs.get("$defs", {})},
    }
    if with_auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return spec


ERROR_STATUSES = {
    400: "an invalid field (param names it), or a response over the size budget",
    401: "a missing or wrong API key",
    404: "an unknown model",
    408: "the request body did not arrive in time",
    413: "the request body is over the limit",
    500: "the request failed inside the engine",
    503: "overloaded (with Retry-After), shutting down, or the engine is not serving",
}
