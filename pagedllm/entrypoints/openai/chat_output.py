"""The assistant message of a chat choice, whole or as streamed deltas: reasoning_content (with
--reasoning-parser), content and tool_calls (named or required tool_choice: the guided output
is the call; auto: the --tool-call-parser finds calls in the text), as OpenAI and vLLM send them.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.reasoning import split_reasoning
from pagedllm.entrypoints.openai.tool_parsers import ToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.base import arguments_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolMode:
    """kind: none (plain text), auto (parser finds calls), named (the output is the named
    function's arguments), required (the output is a JSON list of {name, parameters})."""

    kind: str = "none"
    parser: ToolParser | None = None
    name: str | None = None


def parse_required(text: str) -> list[ToolCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCall(item["name"], arguments_text(item.get("parameters", {}))))
    return calls


def complete_calls(text: str) -> list[ToolCall]:
    """The calls of a ``required`` output, ``[{"name": ..., "parameters": ...}, ...]``, that are
    written in full: the whole list, or its items before one cut short (max_tokens) -- what
    vLLM's parsers return for a truncated output. Stops at the first item not of that shape."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        return []
    pos += 1
    calls: list[ToolCall] = []
    while True:
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:  # cut short (or the list's end)
            return calls
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return calls
        calls.append(ToolCall(item["name"], arguments_text(item.get("parameters", {}))))
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        if not text.startswith(",", pos):
            return calls
        pos += 1


def _split(text: str, reasoning: bool, finished: bool) -> tuple[str | None, str, bool]:
    return split_reasoning(text, finished) if reasoning else (None, text, True)


def final_message(text: str, mode: ToolMode, reasoning: bool, finish_reason: str | None
                  ) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of a finished choice."""
    reasoning_text, content, _ = _split(text, reasoning, True)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning_text
    calls: list[ToolCall] | None = None
    if mode.kind == "named":
        calls = [ToolCall(mode.name or "", content)]
        message["content"] = ""
    elif mode.kind == "required":
        calls = parse_required(content)
        if calls is None and finish_reason == "length":  # the calls written before the cut
            calls = complete_calls(content) or None
        if calls is not None:
            message["content"] = ""
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    elif mode.kind == "auto" and mode.parser is not None:
        extracted = mode.parser.extract_tool_calls(content)
        if extracted.tools_called:
            calls = extracted.tool_calls
            message["content"] = extracted.content
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, finish_reason


@dataclass
class ChoiceStream:
    """One choice's streamed deltas: ``delta(text so far, finished)`` returns what is new."""

    mode: ToolMode
    reasoning: bool
    sent_reasoning: int = 0
    sent_content: int = 0
    call: ToolCall | None = None  # named: the call whose arguments stream as content
    calls_sent: int = 0  # required: the calls sent so far (each once it is written in full)
    extra: dict[str, Any] = field(default_factory=dict)

    def delta(self, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """(delta, tools_called): the delta may be empty when everything new is held back."""
        delta: dict[str, Any] = {}
        reasoning_text, content, decided = _split(text, self.reasoning, finished)
        if not decided:
            return delta, False
        if reasoning_text is not None and len(reasoning_text) > self.sent_reasoning:
            delta["reasoning_content"] = reasoning_text[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning_text)
        kind = self.mode.kind
        if kind == "named":
            if self.call is None:
                self.call = ToolCall(self.mode.name or "", "")
                delta["tool_calls"] = [{"index": 0, **self.call.to_openai()}]
            if len(content) > self.sent_content:
                piece = content[self.sent_content:]
                self.sent_content = len(content)
                delta.setdefault("tool_calls", [{"index": 0, "function": {}}])
                delta["tool_calls"][0]["function"]["arguments"] = piece
            return delta, False
        if kind == "required":
            return self._required(delta, content, finished)
        if kind == "auto" and self.mode.parser is not None:
            if not finished:
                self._content(delta, self.mode.parser.content_before_calls(content))
                return delta, False
            calls, rest = self._final_calls(content)
            if calls:
                if rest:
                    self._content(delta, rest)
                delta["tool_calls"] = [{"index": k, **c.to_openai()} for k, c in enumerate(calls)]
                return delta, True
        self._content(delta, content)
        return delta, False

    def _required(self, delta: dict[str, Any], content: str, finished: bool
                  ) -> tuple[dict[str, Any], bool]:
        """Each call goes out once its JSON is complete; a finished output in which no call was
        complete is sent as content (as the whole response has it)."""
        calls = complete_calls(content)
        if len(calls) > self.calls_sent:
            delta["tool_calls"] = [{"index": self.calls_sent + k, **c.to_openai()}
                                   for k, c in enumerate(calls[self.calls_sent:])]
            self.calls_sent = len(calls)
        if finished and not self.calls_sent:
            self._content(delta, content)
        return delta, self.calls_sent > 0

    def _final_calls(self, content: str) -> tuple[list[ToolCall] | None, str]:
        assert self.mode.parser is not None
        extracted = self.mode.parser.extract_tool_calls(content)
        if not extracted.tools_called:
            return None, ""
        return extracted.tool_calls, extracted.content or ""

    def _content(self, delta: dict[str, Any], content: str) -> None:
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
