"""Tool-call parsers for ``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM's names)."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, ToolCall,
                                                           ToolParser)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is unknown; available: "
                         f"{', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["ExtractedToolCalls", "TOOL_PARSERS", "ToolCall", "ToolParser", "get_tool_parser"]
