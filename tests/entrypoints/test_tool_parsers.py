"""The tool-call parsers (hermes, llama3_json, mistral) and the streamed deltas built on them."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.chat_output import ChoiceStream, ToolMode, final_message
from pagedllm.entrypoints.openai.reasoning import split_reasoning
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

ARGS = {"city": "Paris", "days": 2}
OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": %s}\n</tool_call>\n'
               '<tool_call>{"name": "time", "arguments": {}}</tool_call>' % json.dumps(ARGS),
               "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "weather", "parameters": %s}; '
                    '{"name": "time", "parameters": {}}' % json.dumps(ARGS), None),
    "mistral": ('[TOOL_CALLS] [{"name": "weather", "arguments": %s}, '
                '{"name": "time", "arguments": {}}]' % json.dumps(ARGS), None),
}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_extract_two_calls(name: str) -> None:
    text, content = OUTPUTS[name]
    got = get_tool_parser(name).extract_tool_calls(text)
    assert got.tools_called
    assert [c.name for c in got.tool_calls] == ["weather", "time"]
    assert json.loads(got.tool_calls[0].arguments) == ARGS
    assert json.loads(got.tool_calls[1].arguments) == {}
    assert got.content == content
    assert len({c.id for c in got.tool_calls}) == 2


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("text", ["plain words", '{"name": 5}', "<tool_call>{bad json</tool_call>",
                                  "[TOOL_CALLS] nope"])
def test_text_without_a_valid_call_is_content(name: str, text: str) -> None:
    got = get_tool_parser(name).extract_tool_calls(text)
    assert not got.tools_called and got.content == text


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_streaming_holds_back_calls_and_sends_them_at_the_end(name: str) -> None:
    """Fed one character at a time: content deltas never contain any of the call's text; the
    final delta carries both calls as OpenAI's indexed tool_call deltas."""
    text, content = OUTPUTS[name]
    stream = ChoiceStream(ToolMode("auto", parser=get_tool_parser(name)), reasoning=False)
    sent, calls = "", None
    for end in range(1, len(text) + 1):
        delta, called = stream.delta(text[:end], finished=end == len(text))
        sent += delta.get("content", "")
        if called:
            calls = delta["tool_calls"]
    assert sent.strip() == (content or "")
    assert calls is not None and [c["index"] for c in calls] == [0, 1]
    assert calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS


def test_streaming_plain_text_is_all_sent() -> None:
    text = "a <tool_ is not a call"
    stream = ChoiceStream(ToolMode("auto", parser=get_tool_parser("hermes")), reasoning=False)
    sent = "".join(stream.delta(text[:e], e == len(text))[0].get("content", "")
                   for e in range(1, len(text) + 1))
    assert sent == text


def test_named_and_required_messages() -> None:
    msg, finish = final_message('{"city": "x"}', ToolMode("named", name="weather"), False, "stop")
    assert msg["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "x"}'}
    assert finish == "stop" and msg["content"] == ""
    msg, finish = final_message('[{"name": "time", "parameters": {"tz": "UTC"}}]',
                                ToolMode("required"), False, "stop")
    assert finish == "tool_calls"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"tz": "UTC"}


def test_reasoning_split() -> None:
    assert split_reasoning("<think>hmm</think>\nyes") == ("hmm", "yes", True)
    assert split_reasoning("plan</think>answer") == ("plan", "answer", True)
    assert split_reasoning("<think>still thinking") == ("still thinking", "", True)
    assert split_reasoning("no thinking") == (None, "no thinking", True)
    assert split_reasoning("<th", finished=False) == (None, "", False)
    stream = ChoiceStream(ToolMode(), reasoning=True)
    text = "<think>abc</think>xyz"
    deltas = [stream.delta(text[:e], e == len(text))[0] for e in range(1, len(text) + 1)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "abc"
    assert "".join(d.get("content", "") for d in deltas) == "xyz"
