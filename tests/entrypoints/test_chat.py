"""/v1/chat/completions through the real openai client against a real server process."""
from __future__ import annotations

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_chat_shape_and_usage(client, http) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                         extra_body={"ignore_eos": True})
    assert out.id.startswith("chatcmpl-")
    assert out.object == "chat.completion"
    assert out.model == MODEL
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert out.usage.prompt_tokens == tokens["count"]
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == tokens["count"] + 6


def test_chat_template_is_applied(http) -> None:
    tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<|system|>be brief\n<|user|>hello\n<|assistant|>"


def test_chat_streaming_matches_and_reports_usage(client) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n_and_logprobs(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2,
                                         logprobs=True, top_logprobs=2, seed=1,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 3
        for item in content:
            assert item.logprob <= 0.0 and isinstance(item.bytes, list)
            assert len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1, stream=True,
        extra_body={"ignore_eos": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 3


def test_chat_stop(client) -> None:
    base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    text = base.choices[0].message.content
    stop = text[2:4] if len(text) >= 4 else text[-1:]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                         temperature=0.0, stop=stop,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]
