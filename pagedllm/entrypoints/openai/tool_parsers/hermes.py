"""Hermes / Qwen 2.5 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
after optional content."""
from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, MarkerToolParser,
                                                           calls_from_objects)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(MarkerToolParser):
    name = "hermes"
    marker = START

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
