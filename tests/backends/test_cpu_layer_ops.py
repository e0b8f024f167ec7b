"""The cpu backend's fused layer ops (csrc/cpu/layer_ops_cpu.cpp) against the torch reference ops
of pagedllm/models/layers/ops.py, in float32, bfloat16 and float16: rotary, silu_and_mul and the
KV-cache write bit for bit, rms_norm within one rounding of its mean (float32: of the float32
result; bf16/fp16: at most one ulp of the dtype, on rare elements); their argument checks; and the
backend's wiring (registered by default, not with attention_backend="torch"). Skipped where the
cpu kernels cannot be built (the cpu_kernels fixture in tests/conftest.py)."""
from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.core.batch import ScheduledSeq
from pagedllm.models.layers import ops as reference
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import build_metadata


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    from pagedllm.backends.cpu.layer_ops import layer_ops

    return layer_ops(cpu_kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,d", [(1, 1, 64), (7, 20, 64), (64, 6, 128), (3, 2, 80)])
def test_rotary_bit_identical(ops, tokens: int, heads: int, d: int, dtype: torch.dtype) -> None:
    """Every dtype: half dtypes round each product and the sum as the reference's separate ops
    do (head_size 80: 40-wide halves, so vector and scalar tail both run)."""
    gen = torch.Generator().manual_seed(tokens * heads + d)
    qkv = torch.randn(tokens, (heads + 3) * d, generator=gen).to(dtype)  # x: a strided view
    x = qkv[:, : heads * d].view(tokens, heads, d)
    angles = torch.rand(tokens, d // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)  # the model's tables: its dtype
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
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


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 16), (5, 352), (64, 2816), (3, 27)])
def test_silu_and_mul_half_bit_identical(ops, tokens: int, inter: int, dtype: torch.dtype) -> None:
    """bf16/fp16: silu rounded to the dtype before the product, as F.silu's output is; the
    float32 ulp by which torch's AVX-512 exp may differ vanishes in that rounding (no element
    of these inputs lies that close to a half-precision rounding boundary)."""
    gen = torch.Generator().manual_seed(inter + 7)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 11.0, -11.0])
    assert _same_bits(ops["silu_and_mul"](x), reference.silu_and_mul(x))


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


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (9, 1024), (64, 4096), (2, 100)])
def test_rms_norm_half(ops, tokens: int, hidden: int, with_residual: bool,
                       dtype: torch.dtype) -> None:
    """bf16/fp16: the new residual bit for bit (x + residual rounded to the dtype); the output
    is T(w * T(h * inv_rms)) as the reference's, so it differs only where the float32 mean's last
    bit (summation order) moves T(h * inv_rms) across a rounding boundary: that value one ulp of
    the dtype away, so the output (its product with w, rounded) at most two, on at most 0.2% of
    the elements. Skipping either rounding fails this."""
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = (torch.randn(tokens, hidden + 8, generator=gen)[:, :hidden] * 3).to(dtype)  # strided
    weight = torch.randn(hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype) if with_residual else None
    got, got_h = ops["rms_norm"](x, weight, 1e-5, residual)
    ref, ref_h = reference.rms_norm(x, weight, 1e-5, residual)
    assert _same_bits(got_h, ref_h) and got.dtype == dtype
    differ = got != ref
    assert differ.sum().item() <= max(1, got.numel() // 500)
    if differ.any():  # bit patterns of one sign: their distance counts ulps
        steps = (_bits(got).int() - _bits(ref).int())[differ].abs()
        assert int(steps.max()) <= 2


def test_half_ops_with_mixed_dtypes_use_the_reference(ops) -> None:
    """A bf16 x with float32 cos/sin, weight or residual (type promotion to float32 in the
    reference) is not the kernels' case: the reference runs and returns its dtype."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    cos, sin = torch.rand(4, 64, generator=gen), torch.rand(4, 64, generator=gen)
    got = ops["rotary"](x, cos, sin)
    assert got.dtype == torch.float32 and _same_bits(got, reference.rotary(x, cos, sin))
    h = x.view(4, 128)
    w = torch.randn(128, generator=gen)
    for weight, residual in ((w, None), (w.bfloat16(), h.float())):
        got, got_h = ops["rms_norm"](h, weight, 1e-6, residual)
        ref, ref_h = reference.rms_norm(h, weight, 1e-6, residual)
        assert _same_bits(got, ref) and _same_bits(got_h, ref_h)


@pytest.mark.parametrize("rows,vocab", [(1, 4096), (64, 4096), (5, 1000), (3, 7)])
def test_greedy_logprobs_bit_identical(ops, rows: int, vocab: int) -> None:
    """torch.argmax's token and log_softmax's value at it, bit for bit (the kernel runs torch's
    own reduce/exp/log vector code); vocab 1000 and 7 take the partial-vector tails."""
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 8
    logits[0, vocab // 2] = float("-inf")
    tokens, lp = ops["greedy_logprobs"](logits)
    ref_tokens, ref_lp = reference.greedy_logprobs(logits)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, ref_tokens)
    assert _same_bits(lp, ref_lp)


def test_greedy_logprobs_ties_and_nan(ops) -> None:
    """A tied maximum gives its first index (torch.argmax's rule); a row with a NaN gives the
    first NaN's index and a NaN logprob, as the reference; strided rows (a logits view) work."""
    logits = torch.zeros(3, 40 + 3)[:, :40]
    logits[0, [5, 17, 30]] = 2.5
    logits[1, [3, 9]] = float("nan")
    logits[1, 20] = 100.0
    logits[2] = -torch.arange(40.0)
    tokens, lp = ops["greedy_logprobs"](logits)
    ref_tokens, ref_lp = reference.greedy_logprobs(logits)
    assert tokens.tolist() == ref_tokens.tolist() == [5, 3, 0]
    assert _same_bits(lp, ref_lp) and lp[1].isnan()


def _metadata(slots: list[int]) -> AttentionMetadata:
    """The model runner's metadata for a decode step of len(slots) tokens, with ``slots`` as its
    slot mapping (padding and out-of-range slots included)."""
    seqs = [ScheduledSeq(seq_id=i, token_ids=[0], start_pos=0, block_table=[0],
                         sampling_params=SamplingParams(), num_samples=1)
            for i in range(len(slots))]
    meta = build_metadata(seqs, 4, torch.device("cpu"))[2]
    return dataclasses.replace(meta, slot_mapping=torch.tensor(slots, dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_rotary_matches_rotary_then_write_kv(cpu_kernels, dtype: torch.dtype) -> None:
    """The native attention's forward_rotary (rotary_and_cache: q and k rotated in place in qkv,
    k and v into the cache) against the template's rotary op + write_kv + attend: the same
    attention output and cache bits, padding slots untouched."""
    from pagedllm.backends.attention import AttentionImpl
    from pagedllm.backends.cpu.layer_ops import layer_ops
    from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

    heads, kv_heads, d = 4, 2, 16
    slots = [5, -1, 0, 23, 12, -1]
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angles = torch.rand(len(slots), d // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    rotary = layer_ops(cpu_kernels)["rotary"]
    meta = _metadata(slots)
    outs, caches = [], []
    for fused in (False, True):
        impl = CpuNativePagedAttention(heads, d, kv_heads, 0.25)
        cache = torch.full((2, 6, 4, kv_heads, d), float("nan"), dtype=dtype)
        forward = impl.forward_rotary if fused else partial(AttentionImpl.forward_rotary, impl)
        caches.append(cache)
        outs.append(forward(qkv.clone(), cos, sin, rotary, cache, meta))
    assert _same_bits(outs[0], outs[1])
    assert torch.equal(caches[0].isnan(), caches[1].isnan())
    assert _same_bits(caches[0].nan_to_num(), caches[1].nan_to_num())
    bad = qkv.clone()
    with pytest.raises(RuntimeError, match="slot_mapping"):
        cpu_kernels.rotary_and_cache(bad, cos, sin, caches[1],
                                     torch.tensor([5, -1, 0, 24, 12, -1]), heads)
    with pytest.raises(RuntimeError, match="qkv"):
        cpu_kernels.rotary_and_cache(bad[:, :-d], cos, sin, caches[1], meta.slot_mapping, heads)
    with pytest.raises(RuntimeError, match="kv_cache"):
        cpu_kernels.rotary_and_cache(bad, cos, sin, caches[1].float() if dtype != torch.float32
                                     else caches[1].double(), meta.slot_mapping, heads)


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
        ("weight", lambda: cpu_kernels.rms_norm(x.bfloat16(), w, 1e-6, None)),
        ("residual", lambda: cpu_kernels.rms_norm(x.half(), w.half(), 1e-6, x)),
        ("sin", lambda: cpu_kernels.rotary(x.view(4, 2, 32).bfloat16(), x[:, :32].bfloat16(),
                                           x[:, :32])),
        ("x", lambda: cpu_kernels.silu_and_mul(x.to(torch.int32))),
        ("logits", lambda: cpu_kernels.greedy_logprobs(x.double())),
        ("logits", lambda: cpu_kernels.greedy_logprobs(x[0])),
        ("logits", lambda: cpu_kernels.greedy_logprobs(x.t())),
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
    fused_names = ["rms_norm", "rotary", "silu_and_mul", "greedy_logprobs"]
    names = [n for n in fused_names if getattr(table, n) is not getattr(reference, n)]
    assert names == (fused_names if fused else [])
