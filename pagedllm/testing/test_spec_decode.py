"""Speculative decoding's device parts: the rejection sampler (``Ops.rejection_sample``, the
backend's registered kernel or the torch reference) and verification sampling on the device.

The statistical checks draw many verifications of one target distribution and test the
emitted tokens against it (chi-square): a sampler that accepts every draft (a port without a
device random generator, say) emits the drafts' distribution instead, and fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.reference import rejection as reference
from pagedllm.reference.ops import Ops
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.sampler import VerifyRow, VerifySampler
from pagedllm.testing.paged_batch import SeqSpec
from pagedllm.worker.sampler import Sampler, SampleRow

AREA = "speculative decoding"
CAPABILITY_OF = {"test_rejection_sample_greedy": "rejection sampler (greedy)",
                 "test_rejection_sample_consumes_the_draws": "rejection sampler (draws)",
                 "test_deterministic_drafts_keep_the_target_distribution":
                     "rejection sampler (distribution)",
                 "test_sampled_drafts_keep_the_target_distribution":
                     "rejection sampler (distribution)",
                 "test_seeded_verification_is_reproducible": "rejection sampler (seeds)",
                 "test_verification_attention": "multi-token decode"}
# significance of each chi-square check: a correct sampler fails one in 10^4 seeds, and the
# seeds are fixed, so a run is reproducible
ALPHA_Z = 3.719  # the standard normal quantile of 1 - 1e-4


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    """The chi-square quantile (Wilson-Hilferty approximation: for df >= 3 at most 4% above the
    exact one, a slightly lenient bound)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_statistic(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of ``tokens`` against ``probs`` [V]; categories with
    expected counts under 5 are pooled."""
    n = tokens.numel()
    observed = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    if bool((observed[expected == 0] > 0).any()):  # a token of probability 0 was emitted
        return float("inf"), max(1, int(keep.sum()) - 1)
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), max(1, int(keep.sum()) - 1)


def assert_distribution(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    stat, df = chi2_statistic(tokens, probs)
    limit = chi2_critical(df)
    freq = torch.bincount(tokens.cpu(), minlength=probs.numel()).double() / tokens.numel()
    assert stat < limit, (f"{what}: chi-square {stat:.1f} > {limit:.1f} ({df} dof): emitted "
                          f"frequencies {[round(f, 3) for f in freq.tolist()]} vs target "
                          f"{[round(p, 3) for p in probs.tolist()]}")


def backend_ops(backend: Backend) -> Ops:
    ops = Ops()
    backend.register_ops(ops)
    return ops


# --- the op on given draws -----------------------------------------------------------------
def _python_greedy(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """The tokens greedy decoding emits: drafts while each is the argmax, then the argmax."""
    out = []
    for b, d in enumerate(drafts):
        best = logits[b].argmax(-1).tolist()
        row = []
        for i, x in enumerate(d):
            if x != best[i]:
                break
            row.append(x)
        row.append(best[len(row)])
        out.append(row)
    return out


def test_rejection_sample_greedy(conformance_backend: Backend, conformance_device: torch.device,
                                 conformance_rng: torch.Generator) -> None:
    """Greedy rows emit exactly greedy decoding's tokens, for every draft count 0..K."""
    k, vocab = 8, 50
    logits = torch.randn(k + 1, k + 1, vocab, generator=conformance_rng) * 3
    best = logits.argmax(-1)
    drafts = []
    for b in range(k + 1):  # row b: its first b drafts match, then (if any) a mismatch
        d = best[b, :b].tolist()
        if b < k:
            d.append((int(best[b, b]) + 1) % vocab)
        drafts.append(d)
    drafts[3] = best[3, :2].tolist()  # a short row: 2 drafts, both accepted, then the bonus
    got = run_op(backend_ops(conformance_backend), logits, drafts, conformance_device,
                 greedy=True, rng=conformance_rng)
    assert got == _python_greedy(logits, drafts)


def run_op(ops: Ops, logits: torch.Tensor, drafts: list[list[int]], device: torch.device, *,
           greedy: bool, rng: torch.Generator, draft_probs: torch.Tensor | None = None,
           draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[list[int]]:
    """``ops.rejection_sample`` on the device; each row's emitted tokens."""
    b, k1, vocab = logits.shape
    k = k1 - 1
    padded = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int64)
    num = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    uniform, noise = draws if draws is not None else (
        torch.rand(b, k, generator=rng), torch.empty(b, vocab).exponential_(generator=rng))
    out = ops.rejection_sample(
        logits.to(device), padded.view(b, k).to(device), num.to(device),
        None if draft_probs is None else draft_probs.to(device),
        torch.full((b,), greedy, dtype=torch.bool, device=device), uniform.to(device),
        noise.to(device))
    assert tuple(out.shape) == (b, k + 1) and out.dtype == torch.int64, (
        f"rejection_sample returned {tuple(out.shape)} {out.dtype}, expected {(b, k + 1)} int64")
    rows = []
    for row in out.cpu().tolist():
        n = row.index(reference.PLACEHOLDER_TOKEN_ID) if reference.PLACEHOLDER_TOKEN_ID in row \
            else len(row)
        assert all(t == reference.PLACEHOLDER_TOKEN_ID for t in row[n:]), f"row {row}"
        rows.append(row[:n])
    return rows


def test_rejection_sample_consumes_the_draws(conformance_backend: Backend,
                                             conformance_device: torch.device,
                                             conformance_rng: torch.Generator) -> None:
    """Given the same uniform and exponential draws, the registered op emits what the torch
    reference emits (a kernel must use the caller's draws, never randomness of its own)."""
    b, k, vocab = 64, 4, 32
    logits = torch.randn(b, k + 1, vocab, generator=conformance_rng)
    q = torch.softmax(torch.randn(b, k, vocab, generator=conformance_rng), -1)
    drafts = [torch.multinomial(q[i], 1, generator=conformance_rng).flatten().tolist()[:1 + i % k]
              for i in range(b)]
    draws = (torch.rand(b, k, generator=conformance_rng),
             torch.empty(b, vocab).exponential_(generator=conformance_rng))
    ops = backend_ops(conformance_backend)
    for probs in (None, q):
        got = run_op(ops, logits, drafts, conformance_device, greedy=False, rng=conformance_rng,
                     draft_probs=probs, draws=draws)
        ref = run_op(Ops(), logits, drafts, torch.device("cpu"), greedy=False,
                     rng=conformance_rng, draft_probs=probs, draws=draws)
        same = sum(g == r for g, r in zip(got, ref))
        # a draw within float rounding of its threshold may go either way on another device
        assert same >= b - 1, f"{b - same} of {b} rows differ from the reference on equal draws"


# --- distributions, through verification sampling on the device ----------------------------
TARGET = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                       [0.0, 1.0, 2.0, 0.5, -1.0, 1.5, 0.2, -2.0]])


def verify_many(backend: Backend, device: torch.device, drafts: list[list[int]],
                params: SamplingParams, draft_probs: torch.Tensor | None = None,
                seed: int = 0) -> list[list[int]]:
    """One verification of ``TARGET`` (2 positions: 1 draft + the bonus) per row of
    ``drafts``, in one batch, through VerifySampler with the backend's op."""
    ops = backend_ops(backend)
    sampler = VerifySampler(Sampler(device, seed), ops.rejection_sample)
    logits = TARGET.to(device)
    rows = []
    for i, d in enumerate(drafts):
        probs = None if draft_probs is None else draft_probs[i:i + 1]  # host rows: one copy
        rows.append(VerifyRow(SampleRow(params, 1, seq_index=0, output_len=3, history=None,
                                        prompt_len=4), d, probs))
    out = sampler(logits.repeat(len(drafts), 1), rows)
    return [[s.token_id for s in samples] for samples in out]


def test_deterministic_drafts_keep_the_target_distribution(
        conformance_backend: Backend, conformance_device: torch.device) -> None:
    """n-gram / greedy drafts (q = one-hot): the first emitted token follows the target
    distribution whichever token was drafted, the draft is accepted with probability p(x),
    and after an accepted draft the bonus token follows the next position's distribution."""
    n = 6000
    temperature = 0.8
    params = SamplingParams(temperature=temperature)
    p = torch.softmax(TARGET.double() / temperature, -1)
    for draft in (0, 4):  # a likely draft and an unlikely one
        out = verify_many(conformance_backend, conformance_device, [[draft]] * n, params)
        first = torch.tensor([o[0] for o in out])
        assert_distribution(first, p[0], f"first emitted token, draft {draft}")
        accepted = sum(len(o) == 2 for o in out)
        expect = p[0, draft].item() * n
        assert abs(accepted - expect) < 4.5 * math.sqrt(expect * (1 - expect / n)) + 1, (
            f"draft {draft} accepted {accepted} times in {n}, expected ~{expect:.0f}")
        if draft == 0:
            bonus = torch.tensor([o[1] for o in out if len(o) == 2])
            assert_distribution(bonus, p[1], "bonus token after an accepted draft")


def test_sampled_drafts_keep_the_target_distribution(
        conformance_backend: Backend, conformance_device: torch.device) -> None:
    """Drafts drawn from a distribution q far from p: accepted with probability
    min(1, p(x)/q(x)), recovered from norm(max(0, p - q)); the emitted token follows p (it would
    follow q if every draft were accepted)."""
    n = 6000
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(TARGET[0].double(), -1)
    q_logits = torch.tensor([-2.0, 0.0, 0.5, 1.0, 2.5, 0.0, 1.5, 0.5])
    q = torch.softmax(q_logits, -1)
    gen = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    out = verify_many(conformance_backend, conformance_device, [[d] for d in drafts], params,
                      draft_probs=q.expand(n, -1).contiguous())
    first = torch.tensor([o[0] for o in out])
    assert_distribution(first, p, "first emitted token of drafts sampled from q")
    accepted = sum(len(o) == 2 for o in out)
    expect = torch.minimum(p, q.double()).sum().item() * n
    assert abs(accepted - expect) < 4.5 * math.sqrt(expect * (1 - expect / n)) + 1, (
        f"{accepted} of {n} drafts accepted, expected ~{expect:.0f} (sum of min(p, q))")


def test_seeded_verification_is_reproducible(conformance_backend: Backend,
                                             conformance_device: torch.device) -> None:
    """A seeded request's verification depends on its seed, completion index and output length
    only: not on the sampler's own generator or the other rows of the batch."""
    drafts = [[i % 8] for i in range(32)]
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(32)]

    def run(seed: int, order: list[int]) -> list[list[int]]:
        ops = backend_ops(conformance_backend)
        sampler = VerifySampler(Sampler(conformance_device, seed), ops.rejection_sample)
        rows = [VerifyRow(SampleRow(seeded[i], 1, 0, 5, None, 3), drafts[i]) for i in order]
        out = sampler(TARGET.to(conformance_device).repeat(len(order), 1), rows)
        got = {i: [s.token_id for s in o] for i, o in zip(order, out)}
        return [got[i] for i in sorted(order)]

    first = run(0, list(range(32)))
    assert run(123, list(range(31, -1, -1))) == first
    assert len({tuple(o) for o in first}) > 1, "32 seeds all emitted the same tokens"


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_verification_equals_the_plain_sampler(conformance_backend: Backend,
                                                      conformance_device: torch.device,
                                                      conformance_rng: torch.Generator,
                                                      k: int) -> None:
    """Greedy verification with penalties and min_tokens: each emitted token is the plain
    sampler's greedy token for the history including the accepted drafts before it."""
    vocab = 40
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, min_tokens=4, logprobs=2)
    params.all_stop_token_ids = {2}
    logits = torch.randn(k + 1, vocab, generator=conformance_rng) * 2
    history = [5, 6, 7]
    plain = Sampler(conformance_device, 0)
    # drafts: the plain sampler's own choices (all accepted), then its choice at the end
    drafts: list[int] = []
    for i in range(k):
        row = SampleRow(params, 1, 0, 1 + i, history + drafts, len(history) - 1)
        drafts.append(plain(logits[i:i + 1].to(conformance_device), [row])[0][0].token_id)
    ops = backend_ops(conformance_backend)
    verify = VerifySampler(plain, ops.rejection_sample)
    base = SampleRow(params, 1, 0, 1, list(history), len(history) - 1)
    out = verify(logits.to(conformance_device), [VerifyRow(base, drafts)])[0]
    expected_last = plain(logits[k:].to(conformance_device),
                          [SampleRow(params, 1, 0, 1 + k, history + drafts,
                                     len(history) - 1)])[0][0]
    assert [s.token_id for s in out] == drafts + [expected_last.token_id]
    assert abs(out[-1].logprob - expected_last.logprob) < 1e-4
    assert out[-1].top_logprobs is not None and len(out[-1].top_logprobs) >= 2


# --- attention over verification chunks ----------------------------------------------------
@pytest.mark.capability("multi_token_decode")
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
def test_verification_attention(conformance_backend: Backend, conformance_dtype: str,
                                conformance_block_size: int, conformance_device: torch.device,
                                conformance_rng: torch.Generator, k: int) -> None:
    """Decode sequences with k + 1 query tokens (the last token and k drafts, causal within,
    over their cached context; one of them starting on a block boundary, one crossing one) in
    one step with a prompt, a prompt over cached context and plain decodes, against the float64
    reference."""
    from pagedllm.testing.test_attention import assert_matches, run_case

    bs = conformance_block_size
    specs = [SeqSpec(bs * 2, k + 1), SeqSpec(bs + bs // 2 + 1, k + 1), SeqSpec(0, 6),
             SeqSpec(5, 3), SeqSpec(3 * bs - 1, k + 1), SeqSpec(bs, 1), SeqSpec(7, 1)]
    got, ref = run_case(conformance_backend, specs, dtype=conformance_dtype, block_size=bs,
                        num_heads=8, num_kv_heads=2, head_size=64, device=conformance_device,
                        rng=conformance_rng)
    assert_matches(got, ref, conformance_dtype, f"verification chunks of {k + 1} tokens "
                   "beside prompts and decodes")
