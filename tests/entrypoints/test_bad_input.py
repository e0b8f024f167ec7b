"""Bad requests get a 4xx in the OpenAI error shape with ``param`` naming the field; never a 500."""
from __future__ import annotations

import openai
import pytest

MAX_MODEL_LEN = 512  # the shared server (conftest.py)

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def check_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    return error


BAD_COMPLETIONS = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"best_of": 17, "n": 1}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "n": 2, "stream": True}, "best_of"),  # as OpenAI: best_of is not streamed
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [259]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[5], [100000]]}, "prompt"),
    ({"prompt": list(range(3, 258)) * 3}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"timeout_seconds": 0}, "timeout_seconds"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "tail"}, "suffix"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    # wrong types
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": True}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
    ({"seed": "x"}, "seed"),
]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS, ids=[str(c) for c, _ in BAD_COMPLETIONS])
def test_bad_completion(http, change: dict, param: str) -> None:
    check_error(http.post("/v1/completions", json={**COMPLETION, **change}), 400, param)


def test_missing_prompt(http) -> None:
    check_error(http.post("/v1/completions", json={"model": "tiny"}), 400, "prompt")


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"n": 100}, "n"),
    ({"stop": [""]}, "stop"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"logprobs": "yes"}, "logprobs"),
]


@pytest.mark.parametrize("change,param", BAD_CHATS, ids=[str(c) for c, _ in BAD_CHATS])
def test_bad_chat(http, change: dict, param: str) -> None:
    import json

    body = json.dumps({**CHAT, **change})  # json.dumps writes NaN as the literal NaN
    check_error(http.post("/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}), 400, param)


def test_nan_literal_in_completion(http) -> None:
    body = '{"model": "tiny", "prompt": "a", "temperature": NaN}'
    check_error(http.post("/v1/completions", content=body,
                          headers={"content-type": "application/json"}), 400, "temperature")


@pytest.mark.parametrize("route,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                        ("/tokenize", {"model": "nope", "prompt": "x"})])
def test_unknown_model_is_404(http, route: str, body: dict) -> None:
    error = check_error(http.post(route, json={**body, "model": "nope"}), 404, "model")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"', b'{"prompt": "a",}'])
def test_malformed_json_is_400(http, body: bytes) -> None:
    response = http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
    check_error(response, 400, response.json()["error"]["param"])
    assert response.json()["error"]["param"] in (None, "prompt")


def test_body_too_large_is_413(http) -> None:
    big = {"model": "tiny", "prompt": "a" * (5 << 20)}
    check_error(http.post("/v1/completions", json=big), 413, None)

    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(5):
            yield b"a" * (1 << 20)
        yield b'"}'

    check_error(http.post("/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}), 413, None)


def test_small_chunked_body_is_accepted(http) -> None:
    def chunks():
        yield b'{"model": "tiny", "prompt": "ab", '
        yield b'"max_tokens": 2}'

    response = http.post("/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 2


def test_unknown_route_and_method(http) -> None:
    check_error(http.get("/v1/nothing"), 404, None)
    check_error(http.get("/v1/completions"), 405, None)


def test_tokenize_bad_input(http) -> None:
    check_error(http.post("/tokenize", json={}), 400, "prompt")
    check_error(http.post("/tokenize", json={"prompt": "a", "messages": []}), 400, "prompt")
    check_error(http.post("/detokenize", json={"tokens": [100000]}), 400, "tokens")
    check_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_openai_client_raises_typed_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", temperature=5)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_text_longer_than_the_context_is_400_and_no_tokenizer_warning(http, server) -> None:
    """transformers logged "Token indices sequence length is longer than the specified maximum
    ..." into the server log for such a text (the tokenizer's model_max_length is the context
    here, conftest.py); the 400 (or /tokenize's count) is the whole answer."""
    text = "x" * (MAX_MODEL_LEN + 10)  # one token a byte
    error = check_error(http.post("/v1/completions", json={**COMPLETION, "prompt": text}), 400,
                        "prompt")
    assert error["code"] == "context_length_exceeded" and f"{MAX_MODEL_LEN + 10}" in error["message"]
    chat = {**CHAT, "messages": [{"role": "user", "content": text}]}
    assert check_error(http.post("/v1/chat/completions", json=chat), 400,
                       "messages")["code"] == "context_length_exceeded"
    counted = http.post("/tokenize", json={"model": "tiny", "prompt": text})
    assert counted.status_code == 200 and counted.json()["count"] > MAX_MODEL_LEN, counted.text
    log = server.log_path.read_text(errors="replace")
    assert "Token indices sequence length" not in log, log[-3000:]


def test_server_still_healthy(http) -> None:
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
