"""/v1/models, /health, /version, /metrics, /tokenize, /detokenize; API-key auth on every route."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

import pagedllm

KEY = "sk-test-key"

ROUTES = [  # (method, path, json body)
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [72, 73]}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]


def test_health_version_models(http) -> None:
    health = http.get("/health")
    assert health.status_code == 200
    assert http.get("/version").json() == {"version": pagedllm.__version__}
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512


def test_tokenize_detokenize_round_trip(http) -> None:
    out = http.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    assert http.post("/detokenize", json={"model": "tiny", "tokens": out["tokens"]}).json() == {
        "prompt": "héllo"}


def test_metrics_count_tokens(server, client) -> None:
    before = server.metrics()
    client.completions.create(model="tiny", prompt=[10, 11, 12], max_tokens=5,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == 3
    assert (after["pagedllm:generation_tokens_total"]
            - before["pagedllm:generation_tokens_total"]) == 5
    assert (after["pagedllm:e2e_request_latency_seconds_count"]
            - before["pagedllm:e2e_request_latency_seconds_count"]) == 1
    assert (after["pagedllm:time_to_first_token_seconds_count"]
            - before["pagedllm:time_to_first_token_seconds_count"]) == 1
    assert after["pagedllm:time_per_output_token_seconds_count"] >= 1
    # streamed: the server's outputs are deltas; every token is counted once
    list(client.completions.create(model="tiny", prompt=[10, 11, 12], max_tokens=5, stream=True,
                                   extra_body={"ignore_eos": True}))
    streamed = server.metrics()
    assert streamed["pagedllm:prompt_tokens_total"] - after["pagedllm:prompt_tokens_total"] == 3
    assert (streamed["pagedllm:generation_tokens_total"]
            - after["pagedllm:generation_tokens_total"]) == 5
    assert (streamed["pagedllm:time_per_output_token_seconds_count"]
            - after["pagedllm:time_per_output_token_seconds_count"]) == 1
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "gpu_cache_usage_perc", "num_preemptions_total", "num_free_blocks",
                 "num_gpu_blocks"):
        assert f"pagedllm:{name}" in after
    assert after["pagedllm:num_free_blocks"] == after["pagedllm:num_gpu_blocks"] == 512
    assert after["pagedllm:gpu_cache_usage_perc"] == 0.0


@pytest.fixture(scope="module")
def auth_server(start_server):
    # the engine in the server's own process here (the shared server runs it in a child process)
    return start_server("--api-key", KEY, "--disable-frontend-multiprocessing")


@pytest.fixture
def auth_http(auth_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=auth_server.base_url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_needs_the_key(auth_http, method: str, path: str, body: dict | None) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}):
        r = auth_http.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    ok = auth_http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text


def test_health_is_open_and_path_decides(auth_http) -> None:
    assert auth_http.get("/health").status_code == 200
    # neither the Host header nor the query string can make a route look like /health
    assert auth_http.get("/v1/models", headers={"Host": "health"}).status_code == 401
    assert auth_http.get("/v1/models?/health").status_code == 401
    assert auth_http.get("/metrics", params={"path": "/health"}).status_code == 401
    assert auth_http.get("/v1/nothing").status_code == 401


def test_openai_client_with_key(auth_server) -> None:
    with openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=KEY, max_retries=0) as c:
        assert c.completions.create(model=auth_server_model(c), prompt="a", max_tokens=1).choices
    with openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key="nope",
                       max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


def auth_server_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
