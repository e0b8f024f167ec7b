"""``pagedllm serve BASE --enable-lora --lora-modules name=path ...`` in a subprocess on 127.0.0.1,
driven by the real ``openai`` client: the model field selects an adapter (greedy text equal to
transformers + PEFT's, streamed or not), /v1/models lists adapters with their base as parent,
adapters load and unload at run time behind the API key (refused without the flag), a bad one is
a 400 naming the problem while the server keeps serving, and /metrics has lora_requests_info."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from lora_helpers import hf_lora_greedy, make_adapter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "entrypoints"))
from cli_server import CliProcess  # noqa: E402

KEY = "sk-lora-test"
TOKENS = 8
PROMPT = [1, 40, 73, 101, 7, 88]


def start_server(argv: list[str], log: Path) -> CliProcess:
    """``pagedllm serve ARGV...`` on the cpu, ready; runtime adapter updates only where a test
    sets the flag itself."""
    return CliProcess(["serve", *argv, "--device", "cpu", "--dtype", "float32",
                       "--disable-uvicorn-access-log"], log,
                      drop_env=("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING",)).wait_ready()


@pytest.fixture(scope="module")
def setup(checkpoint_factory, tmp_path_factory):
    base = checkpoint_factory("llama")
    root = tmp_path_factory.mktemp("served-adapters")
    paths = {name: make_adapter(base, str(root / name), r=r, seed=seed)
             for name, r, seed in (("a1", 8, 21), ("a2", 16, 22), ("a3", 4, 23), ("big", 32, 24))}
    want = {name: hf_lora_greedy(base, paths[name], [PROMPT], TOKENS)[0]
            for name in ("a1", "a2", "a3")}
    want[None] = hf_lora_greedy(base, None, [PROMPT], TOKENS)[0]
    server = start_server([base, "--served-model-name", "tiny", "--enable-lora", "--max-loras",
                           "2", "--max-lora-rank", "16", "--lora-modules", f"a1={paths['a1']}",
                           '{"name": "a2", "path": "%s"}' % paths["a2"], "--api-key", KEY,
                           "--allow-runtime-lora-updating", "--max-model-len", "128",
                           "--max-num-batched-tokens", "128", "--max-num-seqs", "16"],
                          root / "server.log")
    yield server, paths, want
    server.stop()


@pytest.fixture
def client(setup):
    import openai

    server = setup[0]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _completion(client, model: str, stream: bool = False) -> str:
    """The greedy completion text of PROMPT (token ids in, EOS ignored)."""
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0,
                  extra_body={"ignore_eos": True, "skip_special_tokens": False})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    return text.rstrip("\ufffd")


def _decode(base: str, tokens: list[int]) -> str:
    """The text of ``tokens`` as the server sends it: the byte tokenizer's last bytes may be an
    unfinished UTF-8 character, which the server's detokenizer holds back."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base).decode(tokens, skip_special_tokens=False
                                                      ).rstrip("\ufffd")


def test_model_field_selects_the_adapter(setup, client, checkpoint_factory) -> None:
    _, _, want = setup
    base = checkpoint_factory("llama")
    for model, key in (("a1", "a1"), ("a2", "a2"), ("tiny", None)):
        assert _completion(client, model) == _decode(base, want[key]), model
    assert _completion(client, "a2", stream=True) == _decode(base, want["a2"])
    chat = client.chat.completions.create(model="a1", max_tokens=2, temperature=0.0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "a1"
    import openai

    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)


def test_models_lists_adapters_with_parent(setup, client) -> None:
    server, paths, _ = setup
    cards = {m.id: m for m in client.models.list().data}
    assert {"tiny", "a1", "a2"} <= set(cards)
    assert cards["a1"].parent == "tiny" and cards["a1"].root == paths["a1"]
    assert cards["tiny"].parent is None


def test_load_and_unload_at_run_time(setup, client, checkpoint_factory) -> None:
    server, paths, want = setup
    base = checkpoint_factory("llama")
    http = httpx.Client(base_url=server.base_url, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})
    assert httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=30,
                      json={"lora_name": "a3", "lora_path": paths["a3"]}).status_code == 401
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert r.status_code == 200 and "a3" in r.text, r.text
    assert _completion(client, "a3") == _decode(base, want["a3"])
    assert "a3" in {m.id for m in client.models.list().data}
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert again.status_code == 400 and "already been loaded" in again.text
    big = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": paths["big"]})
    assert big.status_code == 400 and "max_lora_rank=16" in big.text, big.text
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert missing.status_code == 400 and "is not a folder" in missing.text
    assert http.get("/health").status_code == 200  # still serving
    assert _completion(client, "a1") == _decode(base, want["a1"])
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 200, r.text
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt=PROMPT, max_tokens=1)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 404


def test_metrics_lora_requests_info(setup, client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    server = setup[0]
    _completion(client, "a1")
    text = httpx.get(f"{server.base_url}/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pagedllm:lora_requests_info"]
    assert len(samples) == 1 and samples[0].labels["max_lora"] == "2"
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(samples[0].labels)
    assert samples[0].value > 1e9  # the time of the last update


def test_runtime_updating_is_refused_without_the_flag() -> None:
    import asyncio

    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.serving_lora import (LoadLoRAAdapterRequest,
                                                          OpenAIServingLoRA,
                                                          UnloadLoRAAdapterRequest)

    lora = OpenAIServingLoRA(engine=None, base_model_name="tiny", enabled=True,
                             allow_runtime_updating=False)
    for call in (lora.load(LoadLoRAAdapterRequest(lora_name="a", lora_path="/x")),
                 lora.unload(UnloadLoRAAdapterRequest(lora_name="a"))):
        with pytest.raises(OpenAIError, match="PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING") as info:
            asyncio.run(call)
        assert info.value.status == 404
