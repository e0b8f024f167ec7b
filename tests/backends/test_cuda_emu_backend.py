"""The cuda-emu conformance backend (tests/backends/cuda_emu, the .ci/leg_cuda_emu.sh leg):
cuda's attention and cache-op code with its kernel calls reaching the SIMT-emulated csrc/
launchers, on CPU tensors, declaring exactly what the cuda backend declares."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from pagedllm_cuda_emu import backend as emu_backend  # noqa: E402

from pagedllm.backends.cuda.backend import CudaBackend  # noqa: E402
from pagedllm.testing.harness import garbage_cache, make_attention  # noqa: E402
from pagedllm.testing.metrics import assert_close  # noqa: E402
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


def test_declares_exactly_what_cuda_declares() -> None:
    assert emu_backend.CudaEmuBackend.capabilities == CudaBackend.capabilities
    assert emu_backend.EmuPagedAttention.supported_features == \
        emu_backend.CudaPagedAttention.supported_features


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_and_cache_ops_run_the_emulated_kernels(dtype: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step (GQA group 3, head size 80, block size 16) through cuda's attention code:
    equal to the float64 reference, and every kernel call reached the emulator."""
    emu = emu_backend.emu_ops()
    calls: dict[str, int] = {}
    for name in ("paged_attention", "reshape_and_cache", "copy_blocks"):
        real = getattr(emu, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # calls through to the kernel
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(emu, name, counted)
    emu_backend._LazyOps._ns = None  # rebuild the namespace over the counted launchers
    try:
        backend = emu_backend.CudaEmuBackend()
        impl = make_attention(backend, dtype=dtype, block_size=16, num_heads=6, num_kv_heads=2,
                              head_size=80)
        assert type(impl) is emu_backend.EmuPagedAttention
        gen = torch.Generator().manual_seed(3)
        specs = [SeqSpec(33, 1), SeqSpec(15, 1), SeqSpec(0, 1)]
        batch = PagedBatch.random(specs, num_heads=6, num_kv_heads=2, head_size=80,
                                  block_size=16, dtype=getattr(torch, dtype),
                                  device=torch.device("cpu"), generator=gen)
        cache = garbage_cache(impl, batch.num_blocks, 16, dtype, torch.device("cpu"), gen)
        batch.write_context(impl, cache, torch.device("cpu"))
        out = batch.run(impl, cache, torch.device("cpu"))
        assert_close(out[:len(specs)], batch.reference(impl.scale), dtype, "emulated decode")
        pairs = torch.tensor([[0, 1]], dtype=torch.int64)
        backend.cache_ops().copy_blocks([cache], pairs)
        assert torch.equal(cache[:, 1], cache[:, 0])
    finally:
        emu_backend._LazyOps._ns = None
    assert calls.get("paged_attention", 0) >= 1 and calls.get("reshape_and_cache", 0) >= 1
    assert calls.get("copy_blocks") == 1, calls


def test_fp8_kv_cache_runs_the_torch_attention_and_byte_copies() -> None:
    """kv_cache_dtype="fp8" on cuda: the e4m3 cache is read by the torch attention (eager),
    equal to the reference over K/V rounded to e4m3; copy and swap move its bytes; naming the
    kernels is refused, naming the field."""
    from pagedllm.backends.cpu.attention import TorchPagedAttention
    from pagedllm.testing.harness import (KV_CACHE_TORCH_DTYPES, make_config, raw_config,
                                          round_to_cache)

    backend = emu_backend.CudaEmuBackend()
    config = make_config(backend, dtype="bfloat16", block_size=16, kv_cache_dtype="fp8")
    assert config.attention_backend == "torch" and config.enforce_eager
    named = raw_config(backend, dtype="bfloat16", block_size=16, kv_cache_dtype="fp8")
    named.attention_backend = "kernels"
    with pytest.raises(ValueError, match="attention_backend='kernels' .*kv_cache_dtype='fp8'"):
        backend.check_and_update_config(named)
    impl = make_attention(backend, dtype="bfloat16", block_size=16, num_heads=6, num_kv_heads=2,
                          head_size=80, kv_cache_dtype="fp8")
    assert type(impl) is TorchPagedAttention
    gen = torch.Generator().manual_seed(5)
    specs = [SeqSpec(33, 1), SeqSpec(15, 1)]
    batch = PagedBatch.random(specs, num_heads=6, num_kv_heads=2, head_size=80, block_size=16,
                              dtype=torch.bfloat16, device=torch.device("cpu"), generator=gen)
    shape = impl.kv_cache_shape(batch.num_blocks, 16, 2, 80)
    cache = torch.zeros(shape).to(KV_CACHE_TORCH_DTYPES["fp8"])
    batch.write_context(impl, cache, torch.device("cpu"))
    out = batch.run(impl, cache, torch.device("cpu"))[:len(specs)]
    rounded = PagedBatch(**{**batch.__dict__,
                            "key": round_to_cache(batch.key, "fp8"),
                            "value": round_to_cache(batch.value, "fp8"),
                            "context_keys": [round_to_cache(k, "fp8") for k in batch.context_keys],
                            "context_values": [round_to_cache(v, "fp8")
                                               for v in batch.context_values]})
    assert_close(out, rounded.reference(impl.scale), "bfloat16", "fp8 cache on cuda")
    ops = backend.cache_ops()
    ops.copy_blocks([cache], torch.tensor([[0, 1]], dtype=torch.int64))
    assert torch.equal(cache[:, 1].view(torch.uint8), cache[:, 0].view(torch.uint8))
    host = torch.zeros_like(cache)
    ops.swap_blocks([cache], [host], torch.tensor([[2, 0]], dtype=torch.int64))
    assert torch.equal(host[:, 0].view(torch.uint8), cache[:, 2].view(torch.uint8))
    assert cache[:, 2].view(torch.uint8).any()
