"""Adapters the engine refuses, each with an error naming the field, file or module, checked
before any worker sees them; the engine keeps serving after a refusal. Also LoRARequest and
LoRAConfig validation, and the capability check."""
from __future__ import annotations

import json
import os
import shutil
import types

import pytest

from lora_helpers import GREEDY_TOKENS, make_adapter
from pagedllm.contract.capabilities import Capabilities
from pagedllm.engine.config_validation import check_lora
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft import LoRAAdapterError
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest


@pytest.fixture(scope="module")
def base(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory) -> str:
    return make_adapter(base, str(tmp_path_factory.mktemp("good") / "a"), r=8)


def _registry(base: str, max_lora_rank: int = 16) -> LoRARegistry:
    from transformers import AutoConfig

    config = types.SimpleNamespace(
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=max_lora_rank),
        model=types.SimpleNamespace(hf_config=AutoConfig.from_pretrained(base),
                                    max_model_len=128))
    return LoRARegistry(config)


def _copy(src: str, dst: str, config_changes: dict | None = None,
          drop: str | None = None) -> str:
    shutil.copytree(src, dst)
    if config_changes:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(config_changes)
        with open(path, "w") as f:
            json.dump(config, f)
    if drop:
        os.remove(os.path.join(dst, drop))
    return dst


def test_good_adapter_passes(base, good) -> None:
    assert _registry(base).check(LoRARequest("good", 1, good)).lora_path == good


@pytest.mark.parametrize("case, words", [
    ("no folder", ["lora_path=", "is not a folder"]),
    ("no config", ["has no adapter_config.json"]),
    ("no weights", ["has no adapter_model.safetensors"]),
    ("dora", ["use_dora=True", "not supported"]),
    ("bias", ["bias='all'", "not supported"]),
    ("modules_to_save", ["modules_to_save=['lm_head']"]),
    ("not lora", ["peft_type='IA3'"]),
    ("bad alpha", ["lora_alpha=0", "must be a number > 0"]),
])
def test_bad_folders_name_the_problem(base, good, tmp_path, case: str, words: list[str]) -> None:
    path = {
        "no folder": lambda: str(tmp_path / "missing"),
        "no config": lambda: _copy(good, str(tmp_path / "c"), drop="adapter_config.json"),
        "no weights": lambda: _copy(good, str(tmp_path / "w"),
                                    drop="adapter_model.safetensors"),
        "dora": lambda: _copy(good, str(tmp_path / "d"), {"use_dora": True}),
        "bias": lambda: _copy(good, str(tmp_path / "b"), {"bias": "all"}),
        "modules_to_save": lambda: _copy(good, str(tmp_path / "m"),
                                         {"modules_to_save": ["lm_head"]}),
        "not lora": lambda: _copy(good, str(tmp_path / "i"), {"peft_type": "IA3"}),
        "bad alpha": lambda: _copy(good, str(tmp_path / "a"), {"lora_alpha": 0}),
    }[case]()
    with pytest.raises(LoRAAdapterError) as info:
        _registry(base).check(LoRARequest("bad", 1, path))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_rank_above_max_lora_rank(base, tmp_path) -> None:
    path = make_adapter(base, str(tmp_path / "r32"), r=32)
    with pytest.raises(LoRAAdapterError, match=r"r=32 .* exceeds max_lora_rank=16; raise "
                                                r"max_lora_rank to at least 32"):
        _registry(base, max_lora_rank=16).check(LoRARequest("r32", 1, path))
    _registry(base, max_lora_rank=32).check(LoRARequest("r32", 1, path))


def test_modules_the_model_lacks(base, checkpoint_factory, tmp_path) -> None:
    deeper = checkpoint_factory("llama", num_hidden_layers=3)  # layer 2 is not in the base
    path = make_adapter(deeper, str(tmp_path / "deep"), targets=("q_proj",))
    with pytest.raises(LoRAAdapterError, match=r"target module 'model.layers.2.self_attn.q_proj'"
                                                r" is not a module of this LlamaForCausalLM"):
        _registry(base).check(LoRARequest("deep", 1, path))


def test_another_base_models_shapes(base, checkpoint_factory, tmp_path) -> None:
    wider = checkpoint_factory("llama", hidden_size=128)
    path = make_adapter(wider, str(tmp_path / "wide"), targets=("q_proj", "o_proj"))
    with pytest.raises(LoRAAdapterError, match="an adapter of another base model"):
        _registry(base).check(LoRARequest("wide", 1, path))


@pytest.mark.parametrize("target, words", [("embed_tokens", "adapters on embeddings"),
                                           ("lm_head", "LoRA on embeddings or the LM head is not supported")])
def test_modules_that_are_not_linears(base, tmp_path, target: str, words: str) -> None:
    path = make_adapter(base, str(tmp_path / target), targets=(target,))
    with pytest.raises(LoRAAdapterError, match=words):
        _registry(base).check(LoRARequest(target, 1, path))


def test_an_id_names_one_adapter(base, good, tmp_path) -> None:
    registry = _registry(base)
    registry.check(LoRARequest("good", 1, good))
    other = make_adapter(base, str(tmp_path / "other"), seed=5)
    with pytest.raises(ValueError, match=r"lora_int_id=1 already names adapter 'good'"):
        registry.check(LoRARequest("other", 1, other))
    registry.check(LoRARequest("other", 2, other))


@pytest.mark.parametrize("kwargs, words", [
    (dict(lora_name="", lora_int_id=1), "lora_name=''"),
    (dict(lora_name="a", lora_int_id=0), "lora_int_id=0 is invalid: must be an integer >= 1"),
    (dict(lora_name="a", lora_int_id=True), "lora_int_id=True"),
    (dict(lora_name="a", lora_int_id=1, lora_path=3), "lora_path=3"),
])
def test_lora_request_fields(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LoRARequest(**kwargs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_loras=0), "max_loras=0"),
    (dict(max_lora_rank=0), "max_lora_rank=0"),
    (dict(max_lora_rank=1024), r"max_lora_rank=1024 is invalid: must be an integer in \[1, 512\]"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras=2 is invalid: must be an integer >= "
                                         r"max_loras \(4\)"),
    (dict(lora_dtype="int8"), "lora_dtype='int8'"),
])
def test_lora_config_fields(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LoRAConfig(**kwargs)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


def test_backend_without_the_capability_is_refused() -> None:
    config = types.SimpleNamespace(lora_config=LoRAConfig(), speculative_config=None)
    toy = types.SimpleNamespace(name="toy", capabilities=Capabilities())
    with pytest.raises(ValueError, match=r"enable_lora=True: the toy backend does not run LoRA "
                                         r"adapters \(Capabilities.lora\); backends that do: .*cpu"):
        check_lora(config, toy)
    check_lora(config, types.SimpleNamespace(name="ok", capabilities=Capabilities(lora=True)))
    config.speculative_config = object()
    with pytest.raises(ValueError, match="enable_lora=True with speculative_config"):
        check_lora(config, types.SimpleNamespace(name="ok", capabilities=Capabilities(lora=True)))


def test_engine_refuses_and_keeps_serving(base, good, tmp_path) -> None:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    plain = LLM(base, device="cpu", dtype="float32", max_model_len=128,
                max_num_batched_tokens=128, max_num_seqs=8)
    try:
        with pytest.raises(ValueError, match="lora_request was given but enable_lora=False"):
            plain.generate([[1, 2, 3]], params, lora_request=LoRARequest("g", 1, good),
                           use_tqdm=False)
    finally:
        plain.shutdown()
    llm = LLM(base, device="cpu", dtype="float32", max_model_len=128, enable_lora=True,
              max_num_batched_tokens=128, max_num_seqs=8)
    try:
        dora = _copy(good, str(tmp_path / "dora"), {"use_dora": True})
        with pytest.raises(ValueError, match="use_dora"):
            llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False,
                         lora_request=[LoRARequest("g", 1, good), LoRARequest("d", 2, dora)])
        with pytest.raises(ValueError, match="use_dora"):
            llm.llm_engine.add_lora(LoRARequest("d", 2, dora))
        assert llm.llm_engine.list_loras() == set()
        with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
            llm.generate([[1, 2, 3], [4, 5]], params, lora_request=[None], use_tqdm=False)
        out = llm.generate([[1, 2, 3]], params, lora_request=LoRARequest("g", 1, good),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == GREEDY_TOKENS
    finally:
        llm.shutdown()
