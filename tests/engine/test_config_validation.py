"""engine/config_validation.py: every check of a configuration against the model, the backend's
declared capabilities and the parallel layout, each refusal naming the field, its value and what
is allowed; and the engine running it before anything is loaded."""
from __future__ import annotations

import dataclasses
import multiprocessing
import re
import types

import pytest

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_validation import (check_capabilities, check_model,
                                               check_pipeline_parallel, check_tensor_parallel,
                                               validate_config)
from pagedllm.testing.harness import raw_config


def _declaring(**caps: object) -> CpuBackend:
    """A cpu backend declaring other capabilities (the checks read only the declarations)."""
    declared = dataclasses.replace(CpuBackend.capabilities, **caps)
    return type("Narrow", (CpuBackend,), {"name": "narrow", "capabilities": declared})()


def _config(backend: CpuBackend, **kwargs: object):
    args = dict(dtype="float32", block_size=16)
    args.update(kwargs)
    config = raw_config(backend, **args)
    config.model.hf_config.architectures = ["LlamaForCausalLM"]
    return config


def test_a_config_within_the_declarations_passes() -> None:
    backend = CpuBackend()
    assert validate_config(_config(backend), backend) == "LlamaForCausalLM"


@pytest.mark.parametrize("caps,kwargs,message", [
    ({"dtypes": ("bfloat16",)}, {}, "dtype='float32' is not supported by the narrow backend; "
                                    "supported: bfloat16"),
    ({"block_sizes": (32,)}, {}, "block_size=16 is not supported by the narrow backend; "
                                 "supported: (32,)"),
    ({"prefix_caching": False}, {"enable_prefix_caching": True},
     "enable_prefix_caching is not supported by the narrow backend"),
    ({"chunked_prefill": False}, {"enable_chunked_prefill": True},
     "enable_chunked_prefill is not supported by the narrow backend"),
    ({"swap": False}, {"preemption_mode": "swap"},
     "preemption_mode='swap' is not supported by the narrow backend"),
    ({"kv_cache_dtypes": ("auto",)}, {"kv_cache_dtype": "fp8"},
     "kv_cache_dtype='fp8' is not supported by the narrow backend; supported: auto"),
])
def test_undeclared_capability_is_refused(caps: dict, kwargs: dict, message: str) -> None:
    backend = _declaring(**caps)
    config = _config(backend, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(config, backend)
    check_capabilities(_config(CpuBackend(), **kwargs), CpuBackend())  # cpu declares them all


def test_tensor_parallel_size_above_the_declared_maximum() -> None:
    backend = _declaring(max_tensor_parallel_size=1)
    config = _config(backend)
    config.parallel.tensor_parallel_size = 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported by the narrow "
                                         r"backend yet; use at most 1"):
        check_capabilities(config, backend)


@pytest.mark.parametrize("limit,kwargs,message", [
    ({"head_sizes": (128,)}, {}, "head_size=64 (the model's) is not supported by the narrow "
                                 "backend; it declares head_sizes=128"),
    ({"max_gqa_group": 2}, {"num_heads": 6, "num_kv_heads": 2},
     "GQA group 3 (num_attention_heads=6 / num_key_value_heads=2) exceeds the narrow backend's "
     "max_gqa_group=2"),
    ({"max_context_len": 1024}, {}, "max_model_len=8192 exceeds the narrow backend's "
                                    "max_context_len=1024"),
])
def test_attention_limits(limit: dict, kwargs: dict, message: str) -> None:
    backend = _declaring(**limit)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(_config(backend, **kwargs), backend)


def test_model_feature_the_backend_lacks() -> None:
    backend = _declaring(attention_features=())
    config = _config(backend, logits_soft_cap=30.0)
    config.model.hf_config.architectures = ["Gemma2ForCausalLM"]
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM with this config needs the attention "
                                         r"feature\(s\) logits_soft_cap.*narrow backend"):
        check_model(config, backend)
    check_model(config, CpuBackend())


def test_unknown_architecture() -> None:
    config = _config(CpuBackend())
    config.model.hf_config.architectures = ["NoSuchForCausalLM"]
    with pytest.raises(ValueError,
                       match="model architecture .*NoSuchForCausalLM.* is not supported"):
        validate_config(config, CpuBackend())


@pytest.mark.parametrize("heads,kv_heads,tp,ok", [
    (4, 2, 2, True), (4, 1, 2, True), (4, 2, 4, True), (8, 8, 4, True),
    (4, 2, 3, False), (6, 3, 2, False), (12, 3, 6, True), (12, 4, 6, False),
])
def test_tensor_parallel_split_of_the_heads(heads: int, kv_heads: int, tp: int, ok: bool) -> None:
    config = _config(CpuBackend(), num_heads=heads, num_kv_heads=kv_heads)
    config.parallel = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                            distributed_executor_backend="mp")
    if ok:
        check_tensor_parallel(config, CpuBackend())
    else:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} .*num_"):
            check_tensor_parallel(config, CpuBackend())


def test_one_device_per_rank_on_one_host() -> None:
    backend = types.SimpleNamespace(name="cuda", dist_backend="nccl", device_count=lambda: 1)
    config = _config(CpuBackend())
    config.parallel = types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                            distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 cuda devices on this "
                                         "host but 1 are visible"):
        check_tensor_parallel(config, backend)
    config.parallel.distributed_executor_backend = "ray"  # across hosts: not counted here
    check_tensor_parallel(config, backend)


def test_pipeline_layout(checkpoint_factory) -> None:
    config = EngineArgs(model=checkpoint_factory("llama"), device="cpu",
                        pipeline_parallel_size=2, pp_layer_partition=[1, 2]
                        ).create_engine_config()
    with pytest.raises(ValueError, match=re.escape("pp_layer_partition=[1, 2] is invalid: it "
                                                   "covers 3 layers but the model has 2")):
        check_pipeline_parallel(config, CpuBackend())
    config.parallel.pp_layer_partition = (1, 1)
    check_pipeline_parallel(config, CpuBackend())
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: the narrow backend does not "
                                         "support pipeline parallelism"):
        check_pipeline_parallel(config, _declaring(pipeline_parallel=False))


def test_the_engine_refuses_before_loading_or_spawning(checkpoint_factory) -> None:
    """Through LLM(...): the refusal comes from the one check, before any worker exists."""
    from pagedllm import LLM

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=re.escape("pp_layer_partition=[2, 1] is invalid")):
        LLM(checkpoint_factory("llama"), device="cpu", pipeline_parallel_size=2,
            pp_layer_partition=[2, 1])
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's "
                                         "num_attention_heads=4"):
        LLM(checkpoint_factory("llama"), device="cpu", tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) <= before
