"""Mistral format: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, ToolParser,
                                                           calls_from_objects)

BOT = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if BOT not in text:
            return ExtractedToolCalls(False, [], text)
        head, _, body = text.partition(BOT)
        try:
            value, _ = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return ExtractedToolCalls(False, [], text)
        calls = calls_from_objects(value if isinstance(value, list) else [value])
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, head.strip() or None)

    def may_start_tool_call(self, text: str) -> bool:
        if BOT in text:
            return True
        return any(BOT.startswith(text[i:]) for i in range(max(0, len(text) - len(BOT)), len(text)))

    def content_before_calls(self, text: str) -> str:
        if BOT in text:
            return text[:text.index(BOT)]
        for i in range(max(0, len(text) - len(BOT)), len(text)):
            if BOT.startswith(text[i:]):
                return text[:i]
        return text
