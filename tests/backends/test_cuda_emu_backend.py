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
