"""Tool calling and reasoning output through a real server and the openai client's typed objects.

The model has random weights, so calls come from guided decoding: tool_choice required / named
is enforced by the server; for auto, a guided_regex makes the model write a Hermes call that the
--tool-call-parser must find.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 8},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLE = {"temperature": 1.0, "seed": 5, "max_tokens": 200}
HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def tool_server(start_server):
    return start_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "deepseek_r1")


@pytest.fixture
def tclient(tool_server):
    import openai

    with openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0) as c:
        yield c


def _stream_calls(stream) -> tuple[dict[int, dict], str, str | None, str]:
    """The tool calls rebuilt from typed deltas as a client does: by index, id and name from the
    first delta, argument pieces appended."""
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                if tc.function is not None:
                    entry["name"] = tc.function.name or entry["name"]
                    entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, content, finish, reasoning


def test_named_tool_choice(tclient) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = tclient.chat.completions.create(model=tclient.models.list().data[0].id,
                                           messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           n=2, **SAMPLE)
    for c in resp.choices:
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = tclient.chat.completions.create(model=resp.model, messages=MESSAGES, tools=TOOLS,
                                             tool_choice=choice, stream=True, **SAMPLE)
    calls, content, _, _ = _stream_calls(stream)
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_required_tool_choice(tclient) -> None:
    model = tclient.models.list().data[0].id
    resp = tclient.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", **SAMPLE)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream = tclient.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                             tool_choice="required", stream=True, **SAMPLE)
    calls, _, finish, _ = _stream_calls(stream)
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def _first_item_tokens(tokens: list[str]) -> int | None:
    """How many of a required-mode output's tokens end its first list item, when the output
    holds two items or more (None otherwise)."""
    text = "".join(tokens)
    decoder = json.JSONDecoder()
    start = text.index("{")
    _, end = decoder.raw_decode(text, start)
    items, _ = decoder.raw_decode(text)  # the EOS token's text may follow
    if len(items) < 2:
        return None
    count, written = 0, 0
    while written < end:
        written += len(tokens[count])
        count += 1
    return count


def test_required_tool_choice_cut_by_max_tokens_returns_the_complete_calls(tclient) -> None:
    """With max_tokens ending inside the second call, the first call comes back (whole and
    streamed) with finish_reason "length" (tool_calls used to be empty)."""
    model = tclient.models.list().data[0].id
    # get_time only: its calls are ASCII, one token a character (the tokenizer is byte-level)
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS[1:], tool_choice="required",
              temperature=1.0)
    for seed in range(20):  # a seed whose whole output holds two calls or more
        full = tclient.chat.completions.create(seed=seed, max_tokens=400, logprobs=True, **kw)
        first = _first_item_tokens([t.token for t in full.choices[0].logprobs.content])
        if first is not None:
            break
    assert first is not None, "no seed gave two calls"
    expected = full.choices[0].message.tool_calls[0]
    cut = dict(kw, seed=seed, max_tokens=first + 4)
    c = tclient.chat.completions.create(**cut).choices[0]
    assert c.finish_reason == "length" and not c.message.content
    (call,) = c.message.tool_calls
    assert (call.function.name, call.function.arguments) == (expected.function.name,
                                                             expected.function.arguments)
    calls, content, finish, _ = _stream_calls(tclient.chat.completions.create(stream=True, **cut))
    assert finish == "length" and content == ""
    assert [(e["name"], e["arguments"]) for e in calls.values()] == [
        (expected.function.name, expected.function.arguments)]


def test_auto_tool_choice_parses_hermes_calls(tclient) -> None:
    model = tclient.models.list().data[0].id
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, extra_body={"guided_regex": HERMES_CALL},
              **SAMPLE)
    c = tclient.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK)
    calls, content, finish, _ = _stream_calls(tclient.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == "" and calls[0]["name"] == "get_time"


def test_tool_messages_reach_the_template(tool_server, http) -> None:
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                "{% if m.tool_call_id %}(id={{ m.tool_call_id }}){% endif %}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
                "{{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}"
                "{% if tools %}tools:{% for t in tools %}{{ t.function.name }},{% endfor %}"
                "{% endif %}")
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    import httpx

    with httpx.Client(base_url=tool_server.base_url, timeout=60) as h:
        resp = h.post("/v1/chat/completions", json={
            "messages": messages, "tools": TOOLS, "chat_template": template, "max_tokens": 3,
            "prompt_logprobs": 0})
        assert resp.status_code == 200, resp.text
        prompt = "".join(next(iter(p.values()))["decoded_token"]
                         for p in resp.json()["prompt_logprobs"][1:])
    assert '<get_time {"tz": "UTC"}>' in prompt
    assert "[tool]12:00(id=call_1)" in prompt
    assert "tools:get_weather,get_time," in prompt


def test_reasoning_content(tclient) -> None:
    model = tclient.models.list().data[0].id
    kw = dict(model=model, messages=MESSAGES, **SAMPLE,
              extra_body={"guided_regex": "<think>[a-z]{3,6}</think>[a-z]{2,4}"})
    msg = tclient.chat.completions.create(**kw).choices[0].message
    assert 3 <= len(msg.reasoning_content) <= 6 and msg.reasoning_content.isalpha()
    assert 2 <= len(msg.content) <= 4 and "<" not in msg.content
    _, content, _, reasoning = _stream_calls(tclient.chat.completions.create(stream=True, **kw))
    assert 3 <= len(reasoning) <= 6 and 2 <= len(content) <= 4 and "<" not in content + reasoning


BAD = [
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frob"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[str(c)[:50] for c, _ in BAD])
def test_bad_tools_are_400(tool_server, change: dict, param: str) -> None:
    import httpx

    resp = httpx.post(f"{tool_server.base_url}/v1/chat/completions", timeout=30,
                      json={"messages": MESSAGES, "max_tokens": 3, **change})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_auto_needs_the_flags(http) -> None:
    """The shared server runs without --enable-auto-tool-choice: tools default to 'none' there,
    and an explicit 'auto' is refused."""
    ok = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                 "max_tokens": 3})
    assert ok.status_code == 200 and "tool_calls" not in ok.json()["choices"][0]["message"]
    bad = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                  "tool_choice": "auto", "max_tokens": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "objekt"}}}
CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "bad"}}]


@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "none", "required", "named"])
def test_invalid_parameters_schema_is_400_naming_the_tool_whatever_the_choice(
        tool_server, choice) -> None:
    """The schema is checked up front in every mode (auto and none used to accept it), and the
    400 names tools[i].function.parameters in one line (no internal schema dumped)."""
    import httpx

    tools = [TOOLS[0], {"type": "function", "function": {"name": "bad",
                                                         "parameters": BAD_SCHEMA}}]
    resp = httpx.post(f"{tool_server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 3, "tools": tools, "tool_choice": choice})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "tools[1].function.parameters", error
    assert error["message"] == (
        "tools[1].function.parameters: invalid JSON schema for function 'bad': "
        "properties.city.type 'objekt' is not a JSON Schema type (allowed: array, boolean, "
        "integer, null, number, object, string, or a non-empty list of them)"), error


def test_schema_the_backend_refuses_is_400_naming_the_tool(tool_server) -> None:
    """Sound JSON Schema that xgrammar cannot compile (a bad regex), under tool_choice required:
    the backend's one-line reason, not the guided-decoding schema built from the tools."""
    import httpx

    tools = [TOOLS[1], {"type": "function", "function": {"name": "re", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(ab"}}}}}]
    resp = httpx.post(f"{tool_server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 3, "tools": tools, "tool_choice": "required"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "tools[1].function.parameters", error
    assert error["message"].startswith("tools[1].function.parameters: invalid JSON schema for "
                                       "function 're': Regex parsing error"), error
    assert "anyOf" not in error["message"] and len(error["message"]) < 200, error
