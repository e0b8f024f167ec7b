from __future__ import annotations

import pytest

from pagedllm import LLM


@pytest.fixture(scope="module")
def llm(llama_path: str) -> LLM:
    return LLM(llama_path, device="cpu", dtype="float32", max_model_len=256)

