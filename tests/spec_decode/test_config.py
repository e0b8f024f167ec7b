"""SpeculativeConfig: vLLM's keys, validation naming the field and the allowed values, and the
ways a user passes it (LLM keyword dict, --speculative-config JSON)."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.spec_decode import SpeculativeConfig


def test_ngram_defaults_and_bounds() -> None:
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert not c.uses_device_proposer


def test_methods_and_aliases() -> None:
    assert SpeculativeConfig(method="draft", model="/m", num_speculative_tokens=1).method == \
        "draft_model"
    assert SpeculativeConfig(model="/m", num_speculative_tokens=1).method is None  # decided later
    assert SpeculativeConfig(method="eagle", num_speculative_tokens=4).uses_device_proposer


@pytest.mark.parametrize("value,field,allowed", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method", "ngram, draft_model, eagle"),
    ({"method": "ngram"}, "num_speculative_tokens", "[1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens", "[1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens", "[1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min", "<= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max", ">= 1"),
    ({"method": "eagle", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max", "method 'ngram' only"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "model", "no model"),
    ({"num_speculative_tokens": 2}, "method", "give a method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
     "disable_by_batch_size", ">= 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical"},
     "acceptance_method", "rejection_sampler"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size", "1 or None"),
])
def test_invalid_values_name_field_and_allowed(value: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as exc:
        SpeculativeConfig.from_value(value)
    assert f"speculative_config.{field}=" in str(exc.value)
    assert allowed in str(exc.value)


def test_unknown_key_and_bad_json_are_named() -> None:
    with pytest.raises(ValueError, match="unknown key 'num_spec_tokens'.*num_speculative_tokens"):
        SpeculativeConfig.from_value({"method": "ngram", "num_spec_tokens": 2})
    with pytest.raises(ValueError, match="must be a JSON object"):
        SpeculativeConfig.from_value("{method: ngram}")
    with pytest.raises(ValueError, match="must be a dict"):
        SpeculativeConfig.from_value(["ngram"])  # type: ignore[arg-type]


def test_engine_args_and_cli_flag(llama_path: str) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", llama_path, "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 3, 2, 4)
    as_dict = EngineArgs(model=llama_path, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}).create_engine_config()
    assert as_dict.speculative_config.num_speculative_tokens == 3
    assert EngineArgs(model=llama_path).create_engine_config().speculative_config is None
