"""Declared attention limits enforced at engine construction (issue 29, item 2): a model whose
head size, GQA group or max_model_len is outside the backend's ``Capabilities`` is refused with
the field, the value, the backend and what it declares; and every built-in backend's
declarations admit the models the repository tests on it."""
from __future__ import annotations

import dataclasses

import pytest

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.cuda.backend import CudaBackend
from pagedllm.backends.hpu.backend import HpuBackend
from pagedllm.backends.interface import Backend, Capabilities
from pagedllm.backends.rocm.backend import RocmBackend
from pagedllm.backends.tpu.backend import TpuBackend
from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)
from pagedllm.engine.config_validation import check_attention_limits, check_backend
from pagedllm.testing.checkpoints import FAMILY_CONFIGS, tiny_config
from pagedllm.testing.harness import raw_config


def _limited(**limits: object) -> Backend:
    """A cpu backend declaring narrower attention limits (everything else as cpu)."""
    caps = dataclasses.replace(CpuBackend.capabilities, **limits)
    return type("LimitedBackend", (CpuBackend,), {"name": "limited", "capabilities": caps})()


def _engine_check(backend: Backend, config: EngineConfig) -> None:
    """What the engine does at start: the backend's hook, then the configuration check."""
    backend.check_and_update_config(config)
    check_backend(config, backend)


def _config_for(backend: Backend, hf_config: object, max_model_len: int = 256) -> EngineConfig:
    caps = backend.capabilities
    model = ModelConfig(model="m", tokenizer="m", dtype=caps.dtypes[0],
                        max_model_len=max_model_len, hf_config=hf_config)
    sched = SchedulerConfig(max_num_seqs=4)
    sched.resolve(max_model_len)
    return EngineConfig(model=model, cache=CacheConfig(block_size=caps.preferred_block_size),
                        scheduler=sched, parallel=ParallelConfig(), device=backend.name)


def test_undeclared_head_size_is_refused_by_the_engine(tmp_path) -> None:
    """Through LLM(...): head size 24 (hidden 96 / 4 heads) is not among cpu's head_sizes."""
    from pagedllm import LLM
    from pagedllm.testing.checkpoints import make_checkpoint

    assert 24 not in CpuBackend.capabilities.head_sizes
    path = make_checkpoint(str(tmp_path / "hs24"), "llama", hidden_size=96)
    with pytest.raises(ValueError) as info:
        LLM(path, device="cpu", dtype="float32", max_model_len=64)
    message = str(info.value)
    assert "head_size=24" in message and "cpu backend" in message, message
    assert ", ".join(map(str, CpuBackend.capabilities.head_sizes)) in message, message


def test_gqa_group_above_the_declared_maximum_is_refused() -> None:
    backend = _limited(max_gqa_group=2)
    ok = raw_config(backend, dtype="float32", block_size=16, num_heads=4, num_kv_heads=2)
    _engine_check(backend, ok)  # group 2: at the limit
    bad = raw_config(backend, dtype="float32", block_size=16, num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"GQA group 3 .*num_attention_heads=6 / "
                                         r"num_key_value_heads=2.*limited.*max_gqa_group=2"):
        _engine_check(backend, bad)


def test_cuda_refuses_a_gqa_group_beyond_its_kernels() -> None:
    """The cuda backend (checked without a GPU: only its declarations are used)."""
    config = raw_config(CudaBackend(), dtype="float32", block_size=16, num_heads=32,
                        num_kv_heads=2)
    with pytest.raises(ValueError, match="GQA group 16 .*cuda backend's max_gqa_group=8"):
        _engine_check(CudaBackend(), config)


def test_max_model_len_beyond_max_context_len_is_refused() -> None:
    backend = _limited(max_context_len=1024)
    _engine_check(backend, _config_for(backend, tiny_config("llama"), 1024))
    with pytest.raises(ValueError, match=r"max_model_len=2048 exceeds the limited backend's "
                                         r"max_context_len=1024; pass max_model_len <= 1024"):
        _engine_check(backend, _config_for(backend, tiny_config("llama"), 2048))


# the families the repository's tests run (tests/models, the backend legs); cuda/rocm also run
# the kernel shape of tests/backends/test_cuda_backend.py (head size 64). xpu is not listed: no
# test runs a model with --device xpu (its IPEX attention is tested on the cpu backend, whose
# declarations cover those models)
ARCHS = ["llama", "qwen2", "mistral", "opt", *FAMILY_CONFIGS]
BUILTIN: list[type[Backend]] = [CpuBackend, CudaBackend, RocmBackend, TpuBackend, HpuBackend]


@pytest.mark.parametrize("backend_cls", BUILTIN, ids=lambda c: c.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_builtin_declarations_admit_the_tested_models(backend_cls: type[Backend],
                                                      arch: str) -> None:
    backend = backend_cls()
    config = _config_for(backend, tiny_config(arch))
    check_attention_limits(config, backend)


def test_defaults_are_the_safe_set() -> None:
    """A plugin that declares nothing claims head sizes 64 and 128, GQA groups up to 8."""
    caps = Capabilities()
    assert caps.head_sizes == (64, 128) and caps.max_gqa_group == 8
    assert caps.max_context_len is None
