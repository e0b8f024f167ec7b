"""The sampler on the backend's device: greedy, logprobs, penalties, top-k/top-p/min-p support,
the sampled distribution, and seeded reproducibility (it uses sort, cumsum, scatter and device
random generators, which is where ports break)."""
from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SampleRow

AREA = "sampling"


def _rows(params: list[SamplingParams], history: list[int] | None = None) -> list[SampleRow]:
    return [SampleRow(p, 1, seq_index=i, output_len=0, history=history, prompt_len=1)
            for i, p in enumerate(params)]


def _tokens(out: list) -> list[int]:
    return [samples[0].token_id for samples in out]


def test_greedy_and_logprobs(conformance_device: torch.device,
                             conformance_rng: torch.Generator) -> None:
    logits = torch.randn(6, 300, generator=conformance_rng) * 3
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = Sampler(conformance_device, seed=0)(logits.to(conformance_device), _rows([params] * 6))
    ref = logits.double().log_softmax(-1)
    assert _tokens(out) == ref.argmax(-1).tolist(), "greedy tokens differ from argmax"
    for row, samples in enumerate(out):
        s = samples[0]
        assert abs(s.logprob - ref[row, s.token_id].item()) < 1e-4, (row, s.logprob)
        top = ref[row].topk(3)
        assert s.top_logprobs is not None
        assert set(top.indices.tolist()) <= set(s.top_logprobs), "top-3 logprob ids differ"
        for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(s.top_logprobs[tok] - lp) < 1e-4, (row, tok)


def test_repetition_penalty(conformance_device: torch.device,
                            conformance_rng: torch.Generator) -> None:
    logits = torch.randn(1, 50, generator=conformance_rng) * 0.1
    logits[0, 11], logits[0, 22], logits[0, 33] = 3.0, 2.0, -1.0  # 11 leads until penalized
    history = [11, 11, 33, 7]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=0)
    out = Sampler(conformance_device, seed=0)(logits.to(conformance_device),
                                              _rows([params], history=history))
    penalized = logits[0].double().clone()
    for tok in set(history):
        penalized[tok] = penalized[tok] / 2.0 if penalized[tok] > 0 else penalized[tok] * 2.0
    assert _tokens(out) == [int(penalized.argmax())] == [22]


def test_top_k_top_p_min_p_restrict_the_support(conformance_device: torch.device,
                                                conformance_rng: torch.Generator) -> None:
    logits = torch.randn(40, generator=conformance_rng) * 2
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True)
    exclusive = probs[order].cumsum(0) - probs[order]
    allowed = {
        "top_k": set(order[:5].tolist()),
        "top_p": set(order[exclusive <= 0.6].tolist()),
        "min_p": set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist()),
    }
    sampler = Sampler(conformance_device, seed=0)
    n = 500
    for name, params in (("top_k", SamplingParams(temperature=1.0, top_k=5)),
                         ("top_p", SamplingParams(temperature=1.0, top_p=0.6)),
                         ("min_p", SamplingParams(temperature=1.0, min_p=0.2))):
        batch = logits.expand(n, -1).contiguous().to(conformance_device)
        got = set(_tokens(sampler(batch, _rows([params] * n))))
        assert got <= allowed[name], f"{name}: sampled tokens {sorted(got - allowed[name])} " \
                                     f"outside the allowed set {sorted(allowed[name])}"
        assert len(got) > 1, f"{name}: {n} draws all gave one token"


def test_sampled_frequencies_follow_the_distribution(conformance_device: torch.device) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 6000
    params = SamplingParams(temperature=0.7)
    batch = logits.expand(n, -1).contiguous().to(conformance_device)
    tokens = torch.tensor(_tokens(Sampler(conformance_device, seed=0)(batch, _rows([params] * n))))
    freq = torch.bincount(tokens, minlength=6).double() / n
    expected = (logits.double() / 0.7).softmax(-1)
    assert (freq - expected).abs().max() < 0.03, (
        f"frequencies {freq.tolist()} vs probabilities {expected.tolist()}")


def test_seeded_sampling_is_reproducible(conformance_device: torch.device,
                                         conformance_rng: torch.Generator) -> None:
    """A seeded request's token depends on (seed, completion index, step) only: not on the
    sampler instance, the batch it shares or its row."""
    logits = torch.randn(8, 100, generator=conformance_rng).to(conformance_device)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    first = _tokens(Sampler(conformance_device, seed=0)(logits, _rows(params)))
    again = _tokens(Sampler(conformance_device, seed=99)(logits, _rows(params)))
    assert first == again
    rows = _rows(params)
    reversed_out = Sampler(conformance_device, seed=1)(logits.flip(0), rows[::-1])
    assert _tokens(reversed_out)[::-1] == first
    many = [SamplingParams(temperature=1.0, seed=s) for s in range(64)]
    spread = _tokens(Sampler(conformance_device, seed=0)(logits[:1].expand(64, -1), _rows(many)))
    assert len(set(spread)) > 1, "64 different seeds all drew the same token"
