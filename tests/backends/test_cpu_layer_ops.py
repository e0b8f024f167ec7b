"""The cpu backend's fused float32 layer ops (csrc/cpu/layer_ops_cpu.cpp) against the torch
reference ops of pagedllm/models/layers/ops.py: rotary, silu_and_mul and the KV-cache write bit for
bit, rms_norm within one float32 rounding of its mean; their argument checks; and the backend's
wiring (registered by default, not with attention_backend="torch"). Skipped where the cpu kernels
cannot be built (the cpu_kernels fixture in tests/conftest.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.core.batch import ScheduledSeq
from pagedllm.models.layers import ops as reference
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import build_metadata


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    from pagedllm.backends.cpu.layer_ops import layer_ops

    return layer_ops(cpu_kernels)


@pytest.mark.parametrize("tokens,heads,d", [(1, 1, 64), (7, 20, 64), (64, 6, 128), (3, 2, 80)])
def test_rotary_bit_identical(ops, tokens: int, heads: int, d: int) -> None:
    gen = torch.Generator().manual_seed(tokens * heads + d)
    qkv = torch.randn(tokens, (heads + 3) * d, generator=gen)  # x is a strided view, as in llama
    x = qkv[:, : heads * d].view(tokens, heads, d)
    angles = torch.rand(tokens, d // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1)
    sin = torch.cat([angles.sin()] * 2, dim=-1)
    got = ops["rotary"](x, cos, sin)
    assert got.is_contiguous() and _same_bits(got, reference.rotary(x, cos, sin))


@pytest.mark.parametrize("tokens,inter", [(1, 16), (5, 352), (64, 2816)])
def test_silu_and_mul_bit_identical(ops, tokens: int, inter: int) -> None:
    """Bit for bit where torch's own CPU kernels are the AVX2 ones the kernel is built with; where
    torch runs its AVX-512 kernels, their 16-lane exp may round the other way (one ulp)."""
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(tokens, 2 * inter, generator=gen) * 4
    x[0, :4] = torch.tensor([0.0, -0.0, 88.0, -88.0])  # exp near its range ends
    got, want = ops["silu_and_mul"](x), reference.silu_and_mul(x)
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert _same_bits(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1.2e-7, atol=0)


def test_silu_and_mul_odd_width_within_one_ulp(ops) -> None:
    """Widths that are not a multiple of 16: torch runs its tail through std::exp, the kernel
    through the vectorized exp where 8 lanes remain; both within a float32 rounding."""
    x = torch.randn(3, 2 * 27, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ops["silu_and_mul"](x), reference.silu_and_mul(x), rtol=3e-7, atol=0)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (9, 1024), (64, 4096), (2, 100)])
def test_rms_norm(ops, tokens: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden + 8, generator=gen)[:, :hidden] * 3  # strided rows
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(tokens, hidden, generator=gen) if with_residual else None
    got, got_h = ops["rms_norm"](x, weight, 1e-5, residual)
    ref, ref_h = reference.rms_norm(x, weight, 1e-5, residual)
    assert _same_bits(got_h, ref_h)
    # only the sum of squares is ordered differently: the result is within a rounding or two
    torch.testing.assert_close(got, ref, rtol=5e-7, atol=0)
    h = ref_h.double()
    exact = weight.double() * h / (h.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-7)


def _metadata(slots: list[int]) -> AttentionMetadata:
    """The model runner's metadata for a decode step of len(slots) tokens, with ``slots`` as its
    slot mapping (padding and out-of-range slots included)."""
    seqs = [ScheduledSeq(seq_id=i, token_ids=[0], start_pos=0, block_table=[0],
                         sampling_params=SamplingParams(), num_samples=1)
            for i in range(len(slots))]
    meta = build_metadata(seqs, 4, torch.device("cpu"))[2]
    return dataclasses.replace(meta, slot_mapping=torch.tensor(slots, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(cpu_kernels, dtype: torch.dtype) -> None:
    from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

    gen = torch.Generator().manual_seed(0)
    slots = [5, -1, 0, 23, 12, -1]
    qkv = torch.randn(len(slots), 3 * 2 * 16, generator=gen).to(dtype)
    key = qkv[:, :32].view(-1, 2, 16)  # strided views into the projection, as in the model
    value = qkv[:, 32:64].view(-1, 2, 16)
    caches = [torch.full((2, 6, 4, 2, 16), float("nan"), dtype=dtype) for _ in range(2)]
    for impl, cache in zip((TorchPagedAttention, CpuNativePagedAttention), caches):
        impl(4, 16, 2, 0.25).write_kv(key, value, cache, _metadata(slots))
    assert torch.equal(caches[0].isnan(), caches[1].isnan())
    assert torch.equal(caches[0].nan_to_num(), caches[1].nan_to_num())
    native = CpuNativePagedAttention(4, 16, 2, 0.25)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        native.write_kv(key, value, caches[1], _metadata([5, -1, 0, 24, 12, -1]))  # 24 slots
    with pytest.raises(ValueError, match="slot_mapping"):
        native.write_kv(key, value, caches[1], _metadata([5, -1]))


def test_bad_arguments_raise(cpu_kernels) -> None:
    x = torch.randn(4, 64)
    w = torch.ones(64)
    bad = [
        ("weight", lambda: cpu_kernels.rms_norm(x, w[:32], 1e-6, None)),
        ("residual", lambda: cpu_kernels.rms_norm(x, w, 1e-6, x[:2])),
        ("x", lambda: cpu_kernels.rms_norm(x.double(), w, 1e-6, None)),
        ("eps", lambda: cpu_kernels.rms_norm(x, w, -1.0, None)),
        ("cos", lambda: cpu_kernels.rotary(x.view(4, 2, 32), w.view(2, 32), w.view(2, 32))),
        ("head_size", lambda: cpu_kernels.rotary(x[:, :63].reshape(4, 1, 63), x[:, :63],
                                                 x[:, :63])),
        ("x", lambda: cpu_kernels.silu_and_mul(x[:, :63])),
        ("x", lambda: cpu_kernels.silu_and_mul(x.t())),
    ]
    for name, call in bad:
        with pytest.raises(RuntimeError, match=rf"\b{name}\b"):
            call()


@pytest.mark.parametrize("attention,fused", [(None, True), ("native", True), ("torch", False)])
def test_backend_registers_the_fused_ops(cpu_kernels, attention: str | None, fused: bool) -> None:
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.models.layers.ops import Ops
    from pagedllm.testing.harness import raw_config

    backend = CpuBackend()
    config = raw_config(backend, dtype="float32", block_size=16)
    config.attention_backend = attention
    backend.check_and_update_config(config)
    table = Ops()
    backend.register_ops(table)
    names = [n for n in ("rms_norm", "rotary", "silu_and_mul")
             if getattr(table, n) is not getattr(reference, n)]
    assert names == (["rms_norm", "rotary", "silu_and_mul"] if fused else [])
