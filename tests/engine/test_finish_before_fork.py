"""Issue 28 item 6: a request with n > 1 (or best_of > n) that times out or is aborted before its
first sample forked its sequences still reports n choices, each with that finish reason."""
from __future__ import annotations

import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.testing.invariants import assert_drained


def _final(llm: LLM) -> dict:
    eng, final = llm.llm_engine, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


@pytest.mark.parametrize("n, best_of", [(3, None), (2, 4), (1, 3)])
def test_timeout_before_scheduling_returns_n_choices(llm: LLM, n: int, best_of: int | None
                                                     ) -> None:
    eng = llm.llm_engine
    params = SamplingParams(n=n, best_of=best_of, temperature=1.0, seed=0, max_tokens=8,
                            timeout_seconds=0.01)
    eng.add_request("late", {"prompt_token_ids": [5, 6, 7]}, params)
    time.sleep(0.05)  # the deadline passes before the first schedule()
    out = _final(llm)["late"]
    assert [(c.index, c.finish_reason, c.token_ids) for c in out.outputs] == \
        [(i, "timeout", []) for i in range(n)]
    assert_drained(eng)


def test_abort_before_prefill_returns_n_choices(llm: LLM) -> None:
    eng = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8)
    eng.add_request("gone", {"prompt_token_ids": [5, 6, 7]}, params)
    eng.add_request("kept", {"prompt_token_ids": [8, 9]}, params)
    eng.abort_request("gone")
    final = _final(llm)
    assert [(c.index, c.finish_reason) for c in final["gone"].outputs] == \
        [(i, "abort") for i in range(3)]
    assert [len(c.token_ids) for c in final["kept"].outputs] == [8, 8, 8]  # forked as before
    assert_drained(eng)
