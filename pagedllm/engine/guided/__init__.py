"""Guided decoding (structured output): grammars compiled with xgrammar on a worker thread,
per-request matchers on the host, and the packed token bitmask each step sends to the worker.

The core scheduler never sees any of this: the engine holds a guided request here until its
grammar is compiled, fills ``ScheduledBatch.token_bitmask`` for the sampled rows of a step, and
advances the matchers with the step's tokens.
"""
from __future__ import annotations

from pagedllm.engine.guided.compiler import GrammarCompileError, GrammarCompilerService
from pagedllm.engine.guided.manager import GuidedManager
from pagedllm.engine.guided.validate import (GuidedBackendUnavailable, guided_backend_problem,
                                             validate_guided_params)

__all__ = ["GrammarCompileError", "GrammarCompilerService", "GuidedBackendUnavailable",
           "GuidedManager", "guided_backend_problem", "validate_guided_params"]
