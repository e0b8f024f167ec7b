"""Scheduling step N+1 while step N runs (Scheduler.schedule_ahead, capabilities.async_output).

The cpu backend does not declare async_output (its steps finish before launch returns, so there is
nothing to overlap), but the engine path is the same: here it is switched on for the cpu backend
and every request must end exactly as on the plain path, token for token, with the KV blocks back.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.engine.steppers import AheadStepper, PlainStepper
from pagedllm.testing.invariants import assert_drained

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9] * (1 + i % 3) for i in range(6)]


def _make(path: str, ahead: bool, **kwargs: object) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        if ahead:
            mp.setattr(CpuBackend, "capabilities",
                       dataclasses.replace(CpuBackend.capabilities, async_output=True))
        return LLM(path, device="cpu", dtype="float32", max_model_len=128, **kwargs)


@pytest.fixture(scope="module")
def pair(llama_path: str) -> Iterator[tuple[LLM, LLM]]:
    plain, ahead = _make(llama_path, False), _make(llama_path, True)
    assert type(plain.llm_engine.stepper) is PlainStepper
    assert type(ahead.llm_engine.stepper) is AheadStepper
    yield plain, ahead


def _run(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_drained(llm.llm_engine)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


def test_same_tokens_as_the_plain_path(pair: tuple[LLM, LLM]) -> None:
    plain, ahead = pair
    params = [_greedy(max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 17, 9, 30)]
    before = ahead.llm_engine.num_steps_ahead
    assert _run(ahead, params) == _run(plain, params)
    assert ahead.llm_engine.num_steps_ahead - before >= 10  # the overlap was taken


def test_unpredictable_stops_drop_the_extra_token(pair: tuple[LLM, LLM]) -> None:
    """A sequence stopped by a sampled token (stop id, stop string) was already scheduled once
    more; that step's token must not appear and its blocks must come back."""
    plain, ahead = pair
    probe = plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           _greedy(max_tokens=12, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(probe):
        c = out.outputs[0]
        if i % 2 == 0:
            params.append(_greedy(max_tokens=12, ignore_eos=True, stop_token_ids=[c.token_ids[4]]))
        else:
            params.append(_greedy(max_tokens=12, ignore_eos=True, stop=[c.text[3:6] or "zz"]))
    got, want = _run(ahead, params), _run(plain, params)
    assert got == want
    assert any(r[0][2] == "stop" for r in got)


def test_sampling_logprobs_and_forks(pair: tuple[LLM, LLM]) -> None:
    plain, ahead = pair
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True,
                             logprobs=2) for i in range(3)]
    params += [SamplingParams(n=2, temperature=0.7, seed=7, max_tokens=8, ignore_eos=True),
               _greedy(max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
               _greedy(max_tokens=8, ignore_eos=True, min_tokens=6)]
    outs = {}
    for name, llm in (("plain", plain), ("ahead", ahead)):
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert_drained(llm.llm_engine)
        outs[name] = res
    for a, b in zip(outs["ahead"], outs["plain"]):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)
            if cb.logprobs is not None:
                assert [sorted(p) for p in ca.logprobs] == [sorted(p) for p in cb.logprobs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching(llama_path: str, mode: str) -> None:
    kw = dict(num_gpu_blocks_override=10, block_size=4, max_num_seqs=4, preemption_mode=mode,
              enable_prefix_caching=True)
    plain, ahead = _make(llama_path, False, **kw), _make(llama_path, True, **kw)
    params = [_greedy(max_tokens=10 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    assert _run(ahead, params) == _run(plain, params)
    assert ahead.llm_engine.stats().num_preemptions > 0
    assert ahead.llm_engine.num_steps_ahead > 0


def test_abort_while_a_step_is_ahead(pair: tuple[LLM, LLM]) -> None:
    eng = pair[1].llm_engine
    p = _greedy(max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    while not eng.stepper.in_flight:
        eng.step()
    eng.abort_request("r1")
    final = {}
    while eng.has_unfinished_requests():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert final["r1"].outputs[0].finish_reason == "abort"
    assert len(final["r0"].outputs[0].token_ids) == 40
    assert_drained(eng)


def test_new_requests_are_not_held_back(pair: tuple[LLM, LLM]) -> None:
    """A request arriving while steps run ahead is admitted by the next plain schedule."""
    eng = pair[1].llm_engine
    p = _greedy(max_tokens=30, ignore_eos=True)
    eng.add_request("first", {"prompt_token_ids": PROMPTS[0]}, p)
    while not eng.stepper.in_flight:
        eng.step()
    eng.add_request("late", {"prompt_token_ids": PROMPTS[1]}, p)
    for _ in range(3):
        eng.step()
    assert not eng.scheduler.waiting
    while eng.has_unfinished_requests():
        eng.step()
    assert_drained(eng)


def _ahead_prompt_tokens(llm: LLM) -> tuple[list[int], object]:
    """Records, for each step scheduled ahead, how many prompt tokens it carries."""
    sched = llm.llm_engine.scheduler
    plain = sched.schedule_ahead
    counts: list[int] = []

    def schedule_ahead(prev):  # noqa: ANN001, ANN202 - records, then behaves as the original
        out = plain(prev)
        if out is not None:
            counts.append(sum(s.num_tokens for s in out.batch.seqs if s.num_tokens > 1))
        return out

    sched.schedule_ahead = schedule_ahead  # type: ignore[method-assign]
    return counts, plain


@pytest.mark.parametrize("chunked", [False, True])
def test_waiting_requests_are_admitted_ahead(llama_path: str, chunked: bool) -> None:
    """Sequences that end by length free their slots; the step after is scheduled ahead with
    the next prompts in them, and every request ends as on the plain path."""
    kw = dict(max_num_seqs=2, enable_chunked_prefill=chunked,
              max_num_batched_tokens=16 if chunked else None)
    plain, ahead = _make(llama_path, False, **kw), _make(llama_path, True, **kw)
    counts, _ = _ahead_prompt_tokens(ahead)
    params = [_greedy(max_tokens=m, ignore_eos=True) for m in (3, 7, 4, 9, 2, 6)]
    assert _run(ahead, params) == _run(plain, params)
    assert sum(1 for c in counts if c > 0) >= 3, counts  # prompts admitted in steps ahead


def test_no_admission_ahead_with_prefix_caching(llama_path: str) -> None:
    ahead = _make(llama_path, True, max_num_seqs=2, enable_prefix_caching=True)
    counts, _ = _ahead_prompt_tokens(ahead)
    _run(ahead, [_greedy(max_tokens=m, ignore_eos=True) for m in (3, 7, 4, 9, 2, 6)])
    assert counts and not any(counts)
