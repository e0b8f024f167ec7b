"""Speculative decoding: proposers (n-gram on the host, a draft model or an EAGLE head on the
workers) draft tokens, the target model verifies k + 1 tokens per sequence in one step, and the
rejection sampler (an op of the ops table) keeps what the target's distribution accepts.

Importing this package imports no torch; the device parts live in their own modules.
"""
from __future__ import annotations

from pagedllm.spec_decode.config import METHODS, SpeculativeConfig

__all__ = ["METHODS", "SpeculativeConfig"]
