"""What a tool-call parser does: split a model's output into content and tool calls, whole or
while it streams."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def arguments_text(value: Any) -> str:
    """Arguments as OpenAI's JSON string (a model may write an object or a string)."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def calls_from_objects(objects: list[Any], args_keys: tuple[str, ...] = ("arguments", "parameters")
                       ) -> list[ToolCall] | None:
    """ToolCalls from decoded ``{"name": ..., "arguments"|"parameters": ...}`` objects; None when
    any object is not of that shape."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        calls.append(ToolCall(obj["name"], arguments_text(args)))
    return calls


class ToolParser:
    """Subclasses implement ``extract_tool_calls``; ``may_start_tool_call`` tells the streaming
    path when to hold text back (it could be the start of a call)."""

    name = ""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def may_start_tool_call(self, text: str) -> bool:
        """Whether ``text`` (all output so far) is, or could grow into, a tool call."""
        raise NotImplementedError

    def content_before_calls(self, text: str) -> str:
        """The part of ``text`` that is surely content whatever follows."""
        return "" if self.may_start_tool_call(text) else text


class MarkerToolParser(ToolParser):
    """A format whose calls start at a marker string: the text before it is content, and a
    tail that could be the marker's beginning is held back while streaming."""

    marker = ""

    def content_before_calls(self, text: str) -> str:
        if self.marker in text:
            return text[:text.index(self.marker)]
        for i in range(max(0, len(text) - len(self.marker) + 1), len(text)):
            if self.marker.startswith(text[i:]):
                return text[:i]
        return text

    def may_start_tool_call(self, text: str) -> bool:
        return self.content_before_calls(text) != text
