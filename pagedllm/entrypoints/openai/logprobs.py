"""Logprobs in the two OpenAI shapes: legacy completions and chat ``logprobs.content``.

The engine gives, per position, ``{token_id: logprob}`` holding the chosen token and the top k.
"""
from __future__ import annotations

import math
from typing import Any

from pagedllm.outputs import PositionLogprobs

_FLOOR = -9999.0  # JSON has no -inf


def _clamp(value: float) -> float:
    return _FLOOR if math.isnan(value) or value < _FLOOR else float(value)


class TokenTexts:
    """Decoded text of single token ids, cached (the vocabulary is small and fixed)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id])
            except Exception:  # an id the tokenizer does not know (model vocab > tokenizer)
                text = ""
            self._cache[token_id] = text
        return text


def _top(entry: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


class CompletionLogprobs:
    """Accumulates ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` chunk by chunk."""

    def __init__(self, texts: TokenTexts, k: int, offset: int = 0) -> None:
        self.texts = texts
        self.k = k
        self.offset = offset  # character offset of the next token in the returned text

    def format(self, token_ids: list[int], entries: list[PositionLogprobs | None]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries):
            text = self.texts(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:  # the first prompt token has no logprob
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_clamp(entry.get(token_id, _FLOOR)))
            top = {self.texts(t): _clamp(v) for t, v in _top(entry, self.k)}
            top.setdefault(text, _clamp(entry.get(token_id, _FLOOR)))  # always the chosen token
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[PositionLogprobs],
                  k: int) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = texts(token_id)
        content.append({
            "token": text, "logprob": _clamp(entry.get(token_id, _FLOOR)),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": texts(t), "logprob": _clamp(v),
                              "bytes": list(texts(t).encode("utf-8"))} for t, v in _top(entry, k)],
        })
    return {"content": content, "refusal": None}
