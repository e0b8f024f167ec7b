"""The cpu backend's fused_moe (backends/cpu/fused_moe.py): experts packed once after loading,
against the per-expert torch reference (moe_ops.fused_moe) in float32 and bfloat16; the fallback
for unpacked weights; the wiring through Ops and the model loader (Mixtral's token equality with
transformers runs on this path: tests/models/test_mixtral.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.backends.cpu import fused_moe as cpu_moe
from pagedllm.models.layers.moe import FusedExperts
from pagedllm.models.layers.moe_ops import fused_moe, fused_moe_grouped


class _Tp:
    size, rank = 1, 0

    @staticmethod
    def shard(n: int, what: str) -> int:
        return n


class _Ctx:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.device, self.tp = dtype, torch.device("cpu"), _Tp()


def _experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> FusedExperts:
    experts = FusedExperts(e, h, i, _Ctx(dtype))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.w13.weight.copy_(torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5)
        experts.w2.weight.copy_(torch.randn(e, h, i, generator=gen) / i ** 0.5)
    return experts


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens,topk,renormalize", [(1, 2, True), (9, 2, True), (40, 3, False)])
def test_packed_experts_match_the_reference(dtype: torch.dtype, tol: float, tokens: int,
                                            topk: int, renormalize: bool) -> None:
    """Every routed (token, expert) pair through the packed GEMMs: the same sum as the
    reference within the GEMMs' accumulation order (float32) or a bf16 rounding or two."""
    experts = _experts(8, 64, 96, dtype, tokens)
    cpu_moe.fused_moe_prepare(experts)
    w13, w2 = experts.w13.weight, experts.w2.weight
    assert len(getattr(w13, cpu_moe.PACKED)) == 8 and len(getattr(w2, cpu_moe.PACKED)) == 8
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    logits = torch.randn(tokens, 8, generator=gen).to(dtype)
    got = cpu_moe.fused_moe(x, w13, w2, logits, topk, renormalize)
    want = fused_moe(x, w13, w2, logits, topk, renormalize)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # a wrong routing weight or a dropped pair is far outside that
    wrong = fused_moe(x, w13, w2, logits, topk, not renormalize) if topk < 8 else want * 2
    assert not torch.allclose(got.float(), wrong.float(), rtol=tol, atol=tol)


def test_unpacked_weights_take_the_grouped_path() -> None:
    experts = _experts(4, 32, 48, torch.float32, 0)
    w13, w2 = experts.w13.weight, experts.w2.weight
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(cpu_moe.fused_moe(x, w13, w2, logits, 2, True),
                       fused_moe_grouped(x, w13, w2, logits, 2, True))
    with pytest.raises(ValueError, match="fused_moe"):
        cpu_moe.fused_moe(x, w13, w2, logits, 5, True)


def test_cpu_backend_registers_packed_moe() -> None:
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.models.layers.ops import Ops

    ops = Ops()
    assert "fused_moe_prepare" in Ops.NAMES
    ops.fused_moe_prepare(_experts(2, 16, 16, torch.float32, 0))  # the reference: a no-op
    CpuBackend().register_ops(ops)
    assert ops.fused_moe is cpu_moe.fused_moe
    assert ops.fused_moe_prepare is cpu_moe.fused_moe_prepare


def test_loader_prepares_the_experts(checkpoint_factory) -> None:
    """LLM(...) on a Mixtral checkpoint packs every MoE block's experts."""
    from pagedllm import LLM

    llm = LLM(checkpoint_factory("mixtral"), device="cpu", dtype="float32")
    blocks = [m for m in llm.llm_engine.executor.worker.model.modules()
              if isinstance(m, FusedExperts)]
    assert blocks and all(hasattr(b.w13.weight, cpu_moe.PACKED) for b in blocks)
