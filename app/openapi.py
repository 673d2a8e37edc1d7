"""The OpenAPI 3.1 document of the HTTP API, with request and response schemas generated from `app/schemas.py`."""

from __future__ import annotations

from pydantic import BaseModel
from sluice.app import schemas as S
from sluice.core import __version__


def openapi_schema(with_auth: bool = False) -> dict:
    """OpenAPI 3.1 for the routes, with request and response schemas generated from `app.schemas`."""
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
            str(c): {"description": "error", "content": {"application/json": {"schema": ref(S.ErrorResponse)}}}
            for c in codes
        }

    def post(summary: str, req: type[BaseModel], resp: type[BaseModel], chunk: type[BaseModel]) -> dict:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req)}}},
                "responses": {
                    "200": {
                        "description": "the completion, or with stream=true server-sent events of chunks then [DONE]",
                        "content": {
                            "application/json": {"schema": ref(resp)},
                            "text/event-stream": {"schema": ref(chunk)},
                        },
                    },
                    **errors(400, 401, 404, 413, 500, 503),
                },
                **({"security": [{"bearer": []}]} if with_auth else {}),
            }
        }

    def get(summary: str, content: dict | None = None) -> dict:
        return {
            "get": {
                "summary": summary,
                "responses": {"200": {"description": "ok", **({"content": content} if content else {})}},
            }
        }

    spec = {
        "openapi": "3.1.0",
        "info": {"title": "sluice OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/chat/completions": post(
                "Chat completion", S.ChatCompletionRequest, S.ChatCompletionResponse, S.ChatCompletionChunk
            ),
            "/v1/completions": post("Text completion", S.CompletionRequest, S.CompletionResponse, S.CompletionResponse),
            "/v1/models": get("The served model", {"application/json": {"schema": ref(S.ModelList)}}),
            "/health": get("200 while the engine serves requests, else 503"),
            "/version": get("The sluice version"),
            "/metrics": get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
            "/openapi.json": get("This document"),
        },
        "components": {"schemas": defs.get("$defs", {})},
    }
    if with_auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return spec
