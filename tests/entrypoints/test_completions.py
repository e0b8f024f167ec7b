"""/v1/completions through the real openai client against a real server process."""
from __future__ import annotations

import json

import pytest

MODEL = "tiny"


def test_completion_shape_and_usage(client, http) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                    extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-")
    assert out.object == "text_completion"
    assert out.model == MODEL
    assert isinstance(out.created, int)
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    prompt_ids = http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == len(prompt_ids) + 5


def test_greedy_is_deterministic_and_streaming_matches(client) -> None:
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == a.choices[0].text
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == a.usage.prompt_tokens
    assert sum(1 for c in chunks if c.choices) == 12  # one chunk per token


def test_stream_ends_with_done(http) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        assert json.loads(line[len("data: "):])["object"] == "text_completion"


def test_n_and_seed(client) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon", max_tokens=8, n=3, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts = {i: "" for i in range(3)}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices]


def test_batch_prompts_strings_and_token_ids(client) -> None:
    out = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, n=2,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    ids = client.completions.create(model=MODEL, prompt=[[100, 101], [102]], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3
    flat = client.completions.create(model=MODEL, prompt=[100, 101, 102], max_tokens=2,
                                     extra_body={"ignore_eos": True})
    assert flat.usage.prompt_tokens == 3
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, n=2,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [c.text for c in out.choices]


def test_logprobs(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=3,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text or len(out.choices[0].text) > 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 3 <= len(top) <= 4
        assert top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_logprobs(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Hey", max_tokens=2, echo=True,
                                    logprobs=1, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith("Hey")
    assert len(choice.logprobs.tokens) == out.usage.prompt_tokens + 2
    assert choice.logprobs.token_logprobs[0] is None


def test_stop_string(client) -> None:
    base = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5] if len(base) >= 5 else base[-1]
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0.0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == base[: base.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, temperature=0.0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == choice.text


def test_stop_token_ids_and_min_tokens(client) -> None:
    every_token = list(range(259))  # every id of the byte tokenizer stops the sequence
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=10,
                                    extra_body={"stop_token_ids": every_token})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=10,
                                    extra_body={"stop_token_ids": every_token, "min_tokens": 3})
    assert out.choices[0].finish_reason == "stop" and 3 <= out.usage.completion_tokens <= 4


def test_model_defaults_and_alias(client) -> None:
    out = client.completions.create(model="tiny-alias", prompt="a", max_tokens=1)
    assert out.model == MODEL
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].object == "model"
