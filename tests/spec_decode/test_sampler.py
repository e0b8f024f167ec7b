"""spec_decode/sampler.py: a step whose rows are all plain greedy takes the argmax path (the
plain sampler's greedy op), which must emit what the rejection sampler emits for those rows."""
from __future__ import annotations

import pytest
import torch

from pagedllm.reference.ops import greedy_logprobs
from pagedllm.reference.rejection import rejection_sample
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.sampler import VerifyRow, VerifySampler
from pagedllm.worker.sampler import Sampler, SampleRow


def _rows(logits: torch.Tensor, ks: list[int], agree: list[int], logprobs: int | None
          ) -> list[VerifyRow]:
    """Row j drafts ks[j] tokens, the first agree[j] of them the target's argmax."""
    rows, at = [], 0
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    for j, (k, a) in enumerate(zip(ks, agree)):
        best = logits[at:at + k + 1].argmax(-1).tolist()
        drafts = [best[i] if i < a else (best[i] + 1) % logits.shape[1] for i in range(k)]
        rows.append(VerifyRow(SampleRow(params, 1, j, 5, None, 3), drafts))
        at += k + 1
    return rows


@pytest.mark.parametrize("logprobs", [None, 0])
def test_greedy_path_emits_what_rejection_sampling_emits(logprobs: int | None) -> None:
    torch.manual_seed(0)
    ks, agree = [4, 4, 2, 0, 3, 4], [4, 1, 0, 0, 3, 2]
    logits = torch.randn(sum(k + 1 for k in ks), 50)
    rows = _rows(logits, ks, agree, logprobs)
    fast = VerifySampler(Sampler(torch.device("cpu"), 0, greedy_logprobs), rejection_sample)
    general = VerifySampler(Sampler(torch.device("cpu"), 0, None), rejection_sample)
    got, want = fast(logits, rows), general(logits, rows)
    assert [[s.token_id for s in r] for r in got] == [[s.token_id for s in r] for r in want]
    assert [len(r) for r in got] == [min(a, k) + 1 for k, a in zip(ks, agree)]
    for r_got, r_want in zip(got, want):
        for a, b in zip(r_got, r_want):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert (a.top_logprobs is None) == (b.top_logprobs is None)
