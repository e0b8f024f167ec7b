"""Mistral format: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, MarkerToolParser,
                                                           calls_from_objects)

BOT = "[TOOL_CALLS]"


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    marker = BOT

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
