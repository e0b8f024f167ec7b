"""Hermes / Qwen 2.5 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
after optional content."""
from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, ToolParser,
                                                           calls_from_objects)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(False, [], text)
        try:
            objects = [json.loads(body) for body in _BLOCK.findall(text)]
        except ValueError:
            return ExtractedToolCalls(False, [], text)
        calls = calls_from_objects(objects)
        if not calls:
            return ExtractedToolCalls(False, [], text)
        content = text[:text.index(START)].rstrip()
        return ExtractedToolCalls(True, calls, content or None)

    def may_start_tool_call(self, text: str) -> bool:
        if START in text:
            return True
        tail = text[-len(START):]
        return any(START.startswith(tail[i:]) for i in range(len(tail)) if tail[i:])

    def content_before_calls(self, text: str) -> str:
        if START in text:
            return text[:text.index(START)]
        for i in range(max(0, len(text) - len(START)), len(text)):
            if START.startswith(text[i:]):
                return text[:i]
        return text
