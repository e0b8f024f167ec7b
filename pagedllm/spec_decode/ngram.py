"""Prompt lookup (n-gram) proposals, on the host: the tokens that followed the most recent
earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min). No model and no device work; code and summaries repeat their input often.
"""
from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.config import SpeculativeConfig


def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest suffix n-gram
    (``max_n`` >= n >= ``min_n``) of ``tokens``; [] when no suffix n-gram occurred before.

    A match must end before the suffix itself starts being matched against (positions
    ``i + n <= len - 1``), so at least one token follows it."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # windows starting at 0 .. length - n - 1 (the suffix's own window excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    """Drafts for host-side speculation (``method="ngram"``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = int(config.num_speculative_tokens)  # type: ignore[arg-type]
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Drafts following ``tokens`` (the sequence so far): at most ``k`` (default: the
        config's num_speculative_tokens)."""
        return propose_ngram(tokens, self.k if k is None else k, self.min_n, self.max_n)
