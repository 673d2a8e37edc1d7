"""Held-out JSON-schema families for the structured-output tests (bounded, so that random weights finish)."""

from __future__ import annotations

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"const": "L"}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "any_of_one_of": {
        "type": "object",
        "properties": {
            "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}]},
            "w": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
        },
        "required": ["v", "w"],
        "additionalProperties": False,
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "pattern_nullable_ranges": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "note": {"type": ["string", "null"], "maxLength": 4},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
        },
        "required": ["code", "note", "score", "count"],
        "additionalProperties": False,
    },
}
