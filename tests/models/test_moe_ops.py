"""The fused_moe op: the torch reference against a plain per-token loop, and the cpu grouped path
against the reference (bit-equal in float32), routing with and without renormalization."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.layers.moe_ops import fused_moe, fused_moe_grouped, select_experts
from pagedllm.models.layers.ops import Ops


def _case(tokens: int, experts: int, hidden: int, inter: int, seed: int,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    return x, w13, w2, logits


def _per_token(x, w13, w2, logits, topk, renormalize) -> torch.Tensor:
    """Float64, token by token: sum over the chosen experts of weight * expert(x)."""
    probs = torch.softmax(logits.double(), dim=-1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], topk)
        if renormalize:
            w = w / w.sum()
        for weight, e in zip(w, ids):
            h = w13[e].double() @ x[t].double()
            out[t] += weight * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,topk", [(1, 8, 2), (7, 8, 2), (33, 4, 1), (20, 16, 4)])
def test_reference_matches_per_token_loop(tokens, experts, topk, renormalize) -> None:
    x, w13, w2, logits = _case(tokens, experts, 32, 48, seed=tokens + experts)
    out = fused_moe(x, w13, w2, logits, topk, renormalize)
    torch.testing.assert_close(out.double(), _per_token(x, w13, w2, logits, topk, renormalize),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,topk", [(1, 8, 2), (7, 8, 2), (64, 8, 2), (5, 16, 6)])
def test_grouped_cpu_path_equals_reference(tokens, experts, topk, renormalize) -> None:
    x, w13, w2, logits = _case(tokens, experts, 32, 24, seed=3 * tokens + topk)
    assert torch.equal(fused_moe_grouped(x, w13, w2, logits, topk, renormalize),
                       fused_moe(x, w13, w2, logits, topk, renormalize))


def test_grouped_cpu_path_bfloat16_close() -> None:
    x, w13, w2, logits = _case(16, 8, 64, 32, seed=5, dtype=torch.bfloat16)
    ref = _per_token(x, w13, w2, logits, 2, True)
    torch.testing.assert_close(fused_moe_grouped(x, w13, w2, logits, 2, True).double(), ref,
                               rtol=3e-2, atol=3e-2)


def test_routing_weights() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2]]
    probs = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(w[0], probs[[3, 2]])
    w, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))


def test_bad_shapes_are_named() -> None:
    x, w13, w2, logits = _case(4, 8, 32, 24, seed=0)
    with pytest.raises(ValueError, match="topk=9"):
        fused_moe(x, w13, w2, logits, 9, True)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :5], logits, 2, True)


def test_op_is_registered() -> None:
    ops = Ops()
    assert "fused_moe" in Ops.NAMES and ops.fused_moe is fused_moe
    ops.register("fused_moe", fused_moe_grouped)
    assert ops.fused_moe is fused_moe_grouped


@pytest.mark.parametrize("tokens,experts,topk", [(1, 8, 2), (9, 8, 2), (6, 4, 3)])
def test_dense_static_shape_path_matches_reference(tokens, experts, topk) -> None:
    from pagedllm.models.layers.moe_ops import fused_moe_dense

    x, w13, w2, logits = _case(tokens, experts, 32, 24, seed=11 * tokens + topk)
    for renormalize in (True, False):
        torch.testing.assert_close(fused_moe_dense(x, w13, w2, logits, topk, renormalize),
                                   fused_moe(x, w13, w2, logits, topk, renormalize),
                                   rtol=1e-6, atol=1e-6)
