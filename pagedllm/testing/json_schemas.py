"""Deterministic random JSON schemas for structured-output tests: nested objects, arrays, enums,
bounded integers and numbers, required and optional properties, anyOf. Every string, array and
integer is bounded, so a conforming value is short whatever model writes it."""
from __future__ import annotations

import random
from typing import Any


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "null", "const"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "y z", "ok"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", "v1"])}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth >= 2 or roll < 0.5:
        return _leaf(rng)
    if roll < 0.65:
        return {"type": "array", "items": _node(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 2)}
    if roll < 0.8:
        return {"anyOf": [_node(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "tags", "size", "kind", "meta", "value", "items", "ok"],
                       rng.randint(1, 3))
    props = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def random_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` object schemas, the same for the same seed."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]
