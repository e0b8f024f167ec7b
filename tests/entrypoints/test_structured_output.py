"""Structured output through the real server and the real openai client: response_format
(json_object, json_schema strict), vLLM's guided_* extras, logit_bias, streaming; bad
constraints are 400s naming the field. The model has random weights: only the constraint makes
its output valid."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from pagedllm.testing.json_schemas import random_schemas

MESSAGES = [{"role": "user", "content": "Describe a person."}]
SAMPLE = {"temperature": 1.0, "seed": 11}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    pets: list[Pet] = Field(max_length=2)
    nickname: str | None = Field(max_length=4)


def check_error(resp, param: str) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    return error


def test_parse_returns_a_valid_pydantic_object(client) -> None:
    completion = client.beta.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Person, max_tokens=300, **SAMPLE)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content) == message.parsed


def test_200_generated_schemas_validate(server) -> None:
    """Half through response_format json_schema (chat), half through guided_json (completions),
    sent at once so the engine batches them."""
    import httpx

    schemas = random_schemas(200, seed=3)

    def run(i: int) -> tuple[dict, str, str]:
        schema = schemas[i]
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            if i % 2:
                resp = http.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": MESSAGES, "max_tokens": 400, "seed": i,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": f"s{i}", "schema": schema, "strict": True}}})
                choice = resp.json()["choices"][0]
                return schema, choice["message"]["content"], choice["finish_reason"]
            resp = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "data:", "max_tokens": 400, "seed": i,
                "temperature": 1.0, "guided_json": schema})
            choice = resp.json()["choices"][0]
            return schema, choice["text"], choice["finish_reason"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(len(schemas))))
    for schema, text, finish in results:
        assert finish == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_json_object(client) -> None:
    extras = [({"guided_regex": r"\d{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
              ({"guided_choice": ["alpha", "beta", "gamma delta"]},
               lambda t: t in ("alpha", "beta", "gamma delta")),
              ({"guided_grammar": 'root ::= "[" [0-9] ("," [0-9])* "]"'},
               lambda t: re.fullmatch(r"\[[0-9](,[0-9])*\]", t))]
    for extra, ok in extras:
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                              n=2, extra_body=extra, **SAMPLE)
        for choice in resp.choices:
            assert ok(choice.message.content), (extra, choice.message.content)
    resp = client.completions.create(model="tiny", prompt="x", max_tokens=300, n=3,
                                     extra_body={"response_format": {"type": "json_object"}},
                                     **SAMPLE)
    for choice in resp.choices:
        assert choice.text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)


def test_streaming_json_schema(client) -> None:
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        **SAMPLE)
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    Person.model_validate_json(text)


def test_logit_bias_and_allowed_token_ids(client, http) -> None:
    def token(char: str) -> int:
        ids = http.post("/tokenize", json={"model": "tiny", "prompt": char,
                                           "add_special_tokens": False}).json()["tokens"]
        assert len(ids) == 1
        return ids[0]

    resp = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0,
                                     logit_bias={str(token("a")): 100})
    assert resp.choices[0].text == "a" * 8
    resp = client.completions.create(model="tiny", prompt="x", max_tokens=8, **SAMPLE,
                                     extra_body={"allowed_token_ids": [token("x"), token("y")]})
    assert set(resp.choices[0].text) <= {"x", "y"}


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
    ({"bad_words": "abc"}, "bad_words"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[str(c)[:60] for c, _ in BAD])
def test_bad_constraints_are_400(http, change: dict, param: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **change}
    check_error(http.post("/v1/chat/completions", json=body), param)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5, **change}
    check_error(http.post("/v1/completions", json=body), param)


def test_prompt_logprobs_are_returned(http) -> None:
    """vLLM's shape: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the actual next prompt token and the top k."""
    prompt = [40, 41, 42, 43, 44]
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                               "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for target, entry in zip(prompt[1:], entries[1:]):
        assert str(target) in entry and 2 <= len(entry) <= 3
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == list(range(1, len(entry) + 1))
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in ranked)
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_grammar_compile_timeout_is_an_error(start_server, monkeypatch) -> None:
    """PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT bounds the wait for a grammar: a schema slower to
    compile fails with a 400 saying so, and the server keeps serving."""
    import httpx

    monkeypatch.setenv("PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT", "0.000001")
    server = start_server()
    slow = {"type": "object", "properties": {
        f"p{i}": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{3}[0-9]{2}"}}
        for i in range(300)}}
    with httpx.Client(base_url=server.base_url, timeout=120) as h:
        resp = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                               "guided_json": slow})
        assert resp.status_code == 400, resp.text
        assert "grammar compilation took longer than" in resp.json()["error"]["message"]
        ok = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert ok.status_code == 200
