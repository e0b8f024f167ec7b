"""The rejection sampler's torch reference, and the conformance checks' power: a port that
accepts every draft, or draws its own randomness, fails them."""
from __future__ import annotations

import pytest
import torch

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.models.layers.ops import Ops
from pagedllm.reference.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from pagedllm.testing import test_spec_decode as checks

CPU = torch.device("cpu")


def _accept_everything(target_logits, draft_token_ids, num_draft_tokens, draft_probs,
                       is_greedy, uniform, noise):
    """A broken port: every draft accepted, the bonus drawn from the last position."""
    b, k1, _ = target_logits.shape
    out = torch.full((b, k1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    for i in range(b):
        n = int(num_draft_tokens[i])
        out[i, :n] = draft_token_ids[i, :n]
        out[i, n] = int((torch.softmax(target_logits[i, n], -1) / noise[i]).argmax())
    return out


def _own_randomness(*args):
    """A broken port: ignores the caller's draws (as a kernel with its own RNG would)."""
    target_logits, drafts, num, probs, greedy, uniform, noise = args
    return rejection_sample(target_logits, drafts, num, probs, greedy, torch.rand_like(uniform),
                            torch.empty_like(noise).exponential_())


def _backend_with(op) -> CpuBackend:
    class Broken(CpuBackend):
        def register_ops(self, ops: Ops) -> None:
            super().register_ops(ops)
            ops.register("rejection_sample", op)

    return Broken()


def test_accepting_everything_fails_the_distribution_checks() -> None:
    backend = _backend_with(_accept_everything)
    with pytest.raises(AssertionError, match="chi-square"):
        checks.test_deterministic_drafts_keep_the_target_distribution(backend, CPU)
    with pytest.raises(AssertionError, match="chi-square"):
        checks.test_sampled_drafts_keep_the_target_distribution(backend, CPU)


def test_own_randomness_fails_the_draws_check() -> None:
    with pytest.raises(AssertionError, match="differ from the reference"):
        checks.test_rejection_sample_consumes_the_draws(_backend_with(_own_randomness), CPU,
                                                        torch.Generator().manual_seed(1))


def test_chi2_critical_values() -> None:
    # tabulated chi-square quantiles at 1 - 1e-4
    for df, table in ((3, 21.108), (7, 29.878), (20, 52.386)):
        # Wilson-Hilferty errs a little high (a slightly more lenient bound), within 4%
        assert 0 <= (checks.chi2_critical(df) - table) / table < 0.04


def test_layout_and_edge_rows() -> None:
    """Placeholders after the emitted tokens; a row with no drafts samples position 0; a draft
    whose q equals p is always accepted; q = p everywhere emits the drafts plus a bonus."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 3, 3, 6
    logits = torch.randn(b, k + 1, v, generator=g)
    p = torch.softmax(logits, -1)
    drafts = torch.tensor([[1, 2, 3], [0, 0, 0], [4, 5, 0]])
    num = torch.tensor([3, 0, 2])
    q = p[:, :k].clone()
    out = rejection_sample(logits, drafts, num, q, torch.zeros(b, dtype=torch.bool),
                           torch.rand(b, k, generator=g) * 0.999,
                           torch.empty(b, v).exponential_(generator=g))
    assert out[0, :3].tolist() == [1, 2, 3] and out[0, 3] >= 0
    assert out[1, 0] >= 0 and (out[1, 1:] == PLACEHOLDER_TOKEN_ID).all()
    assert out[2, :2].tolist() == [4, 5] and out[2, 2] >= 0 and out[2, 3] == PLACEHOLDER_TOKEN_ID


def test_no_drafts_samples_the_target() -> None:
    """num_draft_tokens = 0: one token from p (the plain sampler's exponential race)."""
    g = torch.Generator().manual_seed(3)
    n, v = 8000, 5
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5]).expand(n, 1, v).contiguous()
    out = rejection_sample(logits, torch.zeros(n, 0, dtype=torch.int64),
                           torch.zeros(n, dtype=torch.int64), None,
                           torch.zeros(n, dtype=torch.bool), torch.rand(n, 0, generator=g),
                           torch.empty(n, v).exponential_(generator=g))
    assert out.shape == (n, 1)
    checks.assert_distribution(out[:, 0], torch.softmax(logits[0, 0].double(), -1), "no drafts")


def test_masked_tokens_are_never_emitted() -> None:
    """-inf logits (top-k, bitmasks) have probability 0: never recovered, never a bonus."""
    g = torch.Generator().manual_seed(5)
    n, v = 2000, 6
    logits = torch.tensor([0.0, 1.0, float("-inf"), 0.5, float("-inf"), 2.0])
    out = rejection_sample(logits.expand(n, 2, v).contiguous(),
                           torch.full((n, 1), 5, dtype=torch.int64), torch.ones(n, dtype=torch.int64),
                           None, torch.zeros(n, dtype=torch.bool), torch.rand(n, 1, generator=g),
                           torch.empty(n, v).exponential_(generator=g))
    emitted = out[out >= 0]
    assert not ((emitted == 2) | (emitted == 4)).any()
    assert Ops().rejection_sample is rejection_sample and "rejection_sample" in Ops.NAMES
