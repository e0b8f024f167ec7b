"""Helpers for the tensor-parallel tests: prompts, greedy runs, waiting for processes."""
from __future__ import annotations

import random
import time
from collections.abc import Callable

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 8


def tp_prompts() -> list[list[int]]:
    """Three prompts; one spans two 16-token blocks, one is a single token."""
    rng = random.Random(7)
    return [[rng.randint(3, 258) for _ in range(n)] for n in (5, 21, 1)]


def greedy(llm: LLM, prompts: list[list[int]] | None = None,
           max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts or tp_prompts()], params,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
