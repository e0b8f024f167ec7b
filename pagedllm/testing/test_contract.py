"""The plugin contract itself: identity, declared capabilities, implementation classes, config."""
from __future__ import annotations

import pytest
import torch

from pagedllm.contract.attention import AttentionImpl
from pagedllm.contract.backend import Backend
from pagedllm.contract.cache_ops import CacheOps
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.harness import ENGINE_DTYPES, make_attention, raw_config

AREA = "contract"


def test_identity_and_availability(conformance_backend: Backend, conformance_device_name: str,
                                   conformance_device: torch.device) -> None:
    b = conformance_backend
    assert b.name == conformance_device_name, (
        f"the class registered as {conformance_device_name!r} says name={b.name!r}; "
        "the entry-point name and Backend.name must agree")
    ok, reason = type(b).availability()
    assert ok is True and isinstance(reason, str) and reason, (
        f"availability() must return (True, non-empty reason) here, got {(ok, reason)!r}")
    assert isinstance(b.dist_backend, str) and b.dist_backend
    probe = torch.arange(4, device=conformance_device)  # the declared torch device works
    assert probe.sum().item() == 6


def test_declared_capabilities_are_consistent(conformance_caps: Capabilities,
                                              conformance_backend: Backend) -> None:
    caps = conformance_caps
    assert caps.dtypes and set(caps.dtypes) <= set(ENGINE_DTYPES), (
        f"capabilities.dtypes={caps.dtypes} must be a non-empty subset of {ENGINE_DTYPES}")
    assert conformance_backend.default_dtype in caps.dtypes, (
        f"default_dtype={conformance_backend.default_dtype!r} is not in dtypes={caps.dtypes}")
    assert caps.block_sizes and caps.preferred_block_size in caps.block_sizes, (
        f"preferred_block_size={caps.preferred_block_size} is not in "
        f"block_sizes={caps.block_sizes}")
    assert all(s in (1, 2, 4, 8, 16, 32, 64, 128) for s in caps.block_sizes), caps.block_sizes


def test_implementation_classes(conformance_backend: Backend, conformance_caps: Capabilities
                                ) -> None:
    from pagedllm.worker.worker import Worker

    impl = make_attention(conformance_backend, dtype=conformance_caps.dtypes[0],
                          block_size=conformance_caps.preferred_block_size, num_heads=4,
                          num_kv_heads=2, head_size=64)
    assert isinstance(impl, AttentionImpl)
    assert isinstance(conformance_backend.cache_ops(), CacheOps)
    worker = conformance_backend.worker_cls()
    assert isinstance(worker, type) and issubclass(worker, Worker), worker
    assert conformance_backend.device_count() >= 1


@pytest.mark.parametrize("num_blocks", [1, 7])
def test_kv_cache_shape_indexes_blocks_on_dim_1(conformance_backend: Backend,
                                                conformance_caps: Capabilities,
                                                num_blocks: int) -> None:
    bs = conformance_caps.preferred_block_size
    impl = make_attention(conformance_backend, dtype=conformance_caps.dtypes[0], block_size=bs,
                          num_heads=8, num_kv_heads=2, head_size=128)
    shape = tuple(impl.kv_cache_shape(num_blocks, bs, 2, 128))
    assert len(shape) >= 2 and shape[1] == num_blocks, (
        f"kv_cache_shape({num_blocks}, ...) = {shape}: dim 1 must index blocks (block copy, swap "
        "and the scheduler's block ids rely on it)")
    per_block = 2 * bs * 2 * 128
    assert torch.Size(shape).numel() >= per_block * num_blocks, (
        f"kv_cache_shape {shape} cannot hold K and V for {num_blocks} blocks of {bs} tokens")


def test_config_rejects_what_is_not_declared(conformance_backend: Backend,
                                             conformance_caps: Capabilities) -> None:
    """What the backend does not declare is refused, naming it: by the engine's configuration
    check (engine/config_validation.py) right after the backend's check_and_update_config hook,
    which must leave the declared configuration as it is."""
    from pagedllm.engine.config_validation import check_backend

    caps = conformance_caps
    dtype, bs = caps.dtypes[0], caps.preferred_block_size
    bad: list[tuple[str, dict]] = [("dtype", dict(dtype=d, block_size=bs))
                                   for d in ENGINE_DTYPES if d not in caps.dtypes]
    bad += [("block_size", dict(dtype=dtype, block_size=s))
            for s in (1, 2, 4, 8, 16, 32, 64, 128) if s not in caps.block_sizes][:1]
    if not caps.prefix_caching:
        bad.append(("prefix_caching", dict(dtype=dtype, block_size=bs, enable_prefix_caching=True)))
    if not caps.chunked_prefill:
        bad.append(("chunked_prefill", dict(dtype=dtype, block_size=bs,
                                            enable_chunked_prefill=True)))
    if not caps.swap:
        bad.append(("swap", dict(dtype=dtype, block_size=bs, preemption_mode="swap")))
    for word, kwargs in bad:
        config = raw_config(conformance_backend, **kwargs)
        with pytest.raises(ValueError, match=word):
            conformance_backend.check_and_update_config(config)
            check_backend(config, conformance_backend)
    ok = raw_config(conformance_backend, dtype=dtype, block_size=bs)
    conformance_backend.check_and_update_config(ok)
    check_backend(ok, conformance_backend)
    assert ok.model.dtype == dtype and ok.cache.block_size == bs
