"""pagedllm: LLM inference and serving with a paged KV cache on many hardware backends."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.entrypoints.omp_env import set_spin_default

set_spin_default()  # before anything imports torch: libgomp reads it once, when loaded

from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from pagedllm.version import __version__  # noqa: E402

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm import LLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.lora.request import LoRARequest

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams",
           "RequestOutput", "RequestOutputKind", "CompletionOutput", "LoRARequest", "__version__"]

_LAZY = {
    "LLM": "pagedllm.engine.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "AsyncEngineArgs": "pagedllm.engine.arg_utils",
    "AsyncLLMEngine": "pagedllm.engine.async_engine",
    "LoRARequest": "pagedllm.lora.request",
}


def __getattr__(name: str) -> object:
    """Engine classes import torch; load them on first use so `import pagedllm` stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
