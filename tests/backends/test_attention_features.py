"""Sliding window and logit soft-capping in the cpu torch attention, against a dense float64
masked reference, through every path: prefill, prefill over cached context (prefix hits,
chunks), decode and mixed batches; windows smaller than the prompt; several block sizes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.backends.attention import AttentionImpl
from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

HEADS, KV_HEADS, HEAD_SIZE = 6, 2, 16  # GQA group 3
SCALE = HEAD_SIZE ** -0.5

# (name, specs): multi-token entries first, then decodes (the engine's layout)
BATCHES = {
    "prefill": [SeqSpec(0, 13), SeqSpec(0, 5)],
    "prefill_over_context": [SeqSpec(9, 6), SeqSpec(16, 3)],
    "decode": [SeqSpec(20, 1), SeqSpec(3, 1), SeqSpec(0, 1)],
    "mixed": [SeqSpec(0, 11), SeqSpec(7, 4), SeqSpec(30, 1), SeqSpec(5, 1)],
}


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    window: int | None, cap: float | None) -> torch.Tensor:
    """float64. q [n, H, D] at positions start..start+n-1; k/v [start + n, kvH, D].

    Key j is visible to the query at position p iff j <= p and (no window or j > p - window)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        p = start + i
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), k[lo:p + 1]) * SCALE  # [H, visible]
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        out[i] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo:p + 1])
    return out


def expected(batch: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    outs, row = [], 0
    for i, s in enumerate(batch.specs):
        rows = slice(row, row + s.query_len)
        k = torch.cat([batch.context_keys[i], batch.key[rows]])
        v = torch.cat([batch.context_values[i], batch.value[rows]])
        outs.append(dense_reference(batch.query[rows], k, v, s.context_len, window, cap))
        row += s.query_len
    return torch.cat(outs)


def run(specs: list[SeqSpec], block_size: int, window: int | None,
        cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(hash((block_size, window, cap, len(specs))) % 2**31)
    batch = PagedBatch.random(specs, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                              block_size=block_size, dtype=torch.float32,
                              device=torch.device("cpu"), generator=gen)
    kwargs = {}
    if window is not None:
        kwargs["sliding_window"] = window
    if cap is not None:
        kwargs["logits_soft_cap"] = cap
    impl = TorchPagedAttention(HEADS, HEAD_SIZE, KV_HEADS, SCALE, **kwargs)
    cache = torch.zeros(impl.kv_cache_shape(batch.num_blocks, block_size, KV_HEADS, HEAD_SIZE))
    batch.write_context(impl, cache, torch.device("cpu"))
    out = batch.run(impl, cache, torch.device("cpu"))
    return out.double(), expected(batch, window, cap)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 4, 7])
@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("case", list(BATCHES))
def test_torch_attention_matches_dense_reference(case: str, cap: float | None,
                                                 window: int | None, block_size: int) -> None:
    out, ref = run(BATCHES[case], block_size, window, cap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["prefill", "prefill_over_context", "decode"])
def test_window_and_cap_change_the_result(case: str) -> None:
    """The reference is sensitive to both features here (a test that could not fail otherwise)."""
    plain, _ = run(BATCHES[case], 4, None, None)
    windowed, _ = run(BATCHES[case], 4, 4, None)
    capped, _ = run(BATCHES[case], 4, None, 0.5)
    assert not torch.allclose(plain, windowed, atol=1e-3)
    assert not torch.allclose(plain, capped, atol=1e-3)


def test_features_are_declared_per_class_not_inherited() -> None:
    class Kernelized(TorchPagedAttention):  # e.g. a subclass with its own decode kernel
        name = "kernelized"

    assert TorchPagedAttention.supported_features == ("sliding_window", "logits_soft_cap")
    assert Kernelized.supported_features == ()
    assert Kernelized.missing_features(["sliding_window"]) == ["sliding_window"]
    with pytest.raises(ValueError, match="does not support sliding_window"):
        Kernelized(4, 16, 2, 0.25, sliding_window=8)
    Kernelized(4, 16, 2, 0.25)  # plain layers still build


@pytest.mark.parametrize("kwargs, field", [({"sliding_window": 0}, "sliding_window"),
                                           ({"sliding_window": 2.5}, "sliding_window"),
                                           ({"logits_soft_cap": -1.0}, "logits_soft_cap")])
def test_bad_feature_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TorchPagedAttention(4, 16, 2, 0.25, **kwargs)


def test_base_class_declares_nothing() -> None:
    assert AttentionImpl.supported_features == ()


def _config(attention_backend: str | None, **hf: object) -> SimpleNamespace:
    import transformers

    hf_config = transformers.MistralConfig(architectures=["MistralForCausalLM"], **hf)
    return SimpleNamespace(attention_backend=attention_backend,
                           model=SimpleNamespace(hf_config=hf_config))


def test_cpu_backend_picks_an_attention_that_runs_the_window(cpu_kernels) -> None:
    """The native kernels' class declares its own features; where it lacks the window, the
    default is the torch attention and asking for "native" by name is refused, naming it."""
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

    backend = CpuBackend()
    assert "sliding_window" in backend.capabilities.attention_features
    assert backend.attention_cls(_config(None, sliding_window=None)) is CpuNativePagedAttention
    chosen = backend.attention_cls(_config(None, sliding_window=8))
    assert "sliding_window" in chosen.supported_features
    if "sliding_window" not in CpuNativePagedAttention.supported_features:
        assert chosen is TorchPagedAttention
        with pytest.raises(ValueError, match="'native' does not support sliding_window"):
            backend.attention_cls(_config("native", sliding_window=8))
