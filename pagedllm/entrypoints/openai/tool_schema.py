"""Checks of a tool's ``parameters`` JSON schema, made for every request with tools whatever its
tool_choice (an invalid schema is the client's error even when no call is forced), so the 400
names ``tools[i].function.parameters`` and says what is wrong in one line.

``schema_problem`` reads the structure JSON Schema gives its keywords (the types a ``type`` may
name, which keywords hold a schema, a list of schemas, a map of schemas, a list of strings, a
number); a schema that is sound by it may still use a feature the guided-decoding backend does
not support, which ``tool_choice`` required or named finds when it compiles the schema.
"""
from __future__ import annotations

from typing import Any

TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_ONE_SCHEMA = ("not", "if", "then", "else", "contains", "propertyNames", "additionalItems",
               "additionalProperties", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def schema_problem(schema: Any, at: str = "") -> str | None:
    """What makes ``schema`` an invalid JSON schema (the first thing found, with where it is,
    e.g. ``properties.a.type``), or None."""
    where = at.rstrip(".") or "the schema"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be an object or a boolean, not {_kind(schema)}"
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not names:
            return f"{at}type must name at least one type"
        bad = next((n for n in names if n not in TYPES), None)
        if bad is not None:
            return (f"{at}type {bad!r} is not a JSON Schema type (allowed: "
                    f"{', '.join(TYPES)}, or a non-empty list of them)")
    if "required" in schema and not (isinstance(schema["required"], list) and all(
            isinstance(r, str) for r in schema["required"])):
        return f"{at}required must be an array of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{at}enum must be an array, not {_kind(schema['enum'])}"
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"{at}{key} must be an integer >= 0, got {value!r}"
    for key in _NUMBERS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{at}{key} must be a number, got {value!r}"
    for key in _ONE_SCHEMA:
        if key in schema and (problem := schema_problem(schema[key], f"{at}{key}.")):
            return problem
    items = schema.get("items")
    for i, sub in enumerate(items if isinstance(items, list) else [items] if "items" in schema
                            else []):
        if problem := schema_problem(sub, f"{at}items.{i}." if isinstance(items, list)
                                     else f"{at}items."):
            return problem
    for key in _SCHEMA_LISTS:
        if key not in schema:
            continue
        if not isinstance(schema[key], list) or not schema[key]:
            return f"{at}{key} must be a non-empty array of schemas"
        for i, sub in enumerate(schema[key]):
            if problem := schema_problem(sub, f"{at}{key}.{i}."):
                return problem
    for key in _SCHEMA_MAPS:
        if key not in schema:
            continue
        if not isinstance(schema[key], dict):
            return f"{at}{key} must be an object of schemas, not {_kind(schema[key])}"
        for name, sub in schema[key].items():
            if problem := schema_problem(sub, f"{at}{key}.{name}."):
                return problem
    return None
