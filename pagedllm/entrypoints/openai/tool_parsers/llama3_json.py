"""Llama 3.x JSON format: the whole output is ``{"name": ..., "parameters": {...}}`` (several
joined by ``;``), optionally after ``<|python_tag|>``."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, ToolParser,
                                                           calls_from_objects)

PYTHON_TAG = "<|python_tag|>"


def _objects(text: str) -> list[object] | None:
    decoder = json.JSONDecoder()
    objects, pos = [], 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        objects.append(obj)
    return objects or None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(False, [], text)
        objects = _objects(body)
        calls = calls_from_objects(objects) if objects else None
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)

    def may_start_tool_call(self, text: str) -> bool:
        body = text.lstrip()
        return (not body or body.startswith("{") or body.startswith(PYTHON_TAG)
                or PYTHON_TAG.startswith(body))
