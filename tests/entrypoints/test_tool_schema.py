"""tool_schema.schema_problem: JSON Schema's structure, checked for every tool's parameters."""
from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.tool_schema import schema_problem

SOUND = [
    {"type": "object", "properties": {"city": {"type": "string", "minLength": 1},
                                      "unit": {"enum": ["c", "f"]}},
     "required": ["city"], "additionalProperties": False},
    {"type": ["string", "null"]}, True, {},
    {"$defs": {"n": {"type": "integer", "minimum": 0}}, "properties": {"x": {"$ref": "#/$defs/n"}}},
    {"type": "array", "items": [{"type": "string"}, {"type": "number"}], "maxItems": 2},
    {"anyOf": [{"type": "string"}, {"type": "object", "additionalProperties": {"type": "number"}}]},
]
BROKEN = [
    ({"type": "objekt"}, "type 'objekt' is not a JSON Schema type"),
    ({"properties": {"a": {"items": {"type": "frob"}}}},
     "properties.a.items.type 'frob' is not a JSON Schema type"),
    ({"type": "object", "properties": []}, "properties must be an object of schemas, not an array"),
    ({"properties": {"a": 3}}, "properties.a must be an object or a boolean, not a number"),
    ({"required": "a"}, "required must be an array of property names"),
    ({"anyOf": []}, "anyOf must be a non-empty array of schemas"),
    ({"oneOf": [{"type": "string"}, {"type": "x"}]}, "oneOf.1.type 'x'"),
    ({"items": [{"maxLength": -1}]}, "items.0.maxLength must be an integer >= 0, got -1"),
    ({"minimum": "0"}, "minimum must be a number, got '0'"),
    ({"enum": "a"}, "enum must be an array, not a string"),
    ({"type": []}, "type must name at least one type"),
    ({"additionalProperties": {"type": 5}}, "additionalProperties.type 5"),
    ([], "the schema must be an object or a boolean, not an array"),
]


@pytest.mark.parametrize("schema", SOUND)
def test_sound_schemas_pass(schema: object) -> None:
    assert schema_problem(schema) is None


@pytest.mark.parametrize("schema, problem", BROKEN, ids=[p for _, p in BROKEN])
def test_broken_schemas_name_the_place(schema: object, problem: str) -> None:
    assert schema_problem(schema).startswith(problem)
