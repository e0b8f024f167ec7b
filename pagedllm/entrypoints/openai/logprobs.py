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


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """Text and bytes of single token ids, cached (the vocabulary is small and fixed).

    A token that is only part of a UTF-8 character decodes to U+FFFD; its text is then written
    ``bytes:\\xNN...`` (as OpenAI does) so distinct tokens keep distinct strings.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int], int]] = {}

    def _lookup(self, token_id: int) -> tuple[str, list[int], int]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._decode(token_id)
        return entry

    def _decode(self, token_id: int) -> tuple[str, list[int], int]:
        """(display text, bytes, characters it adds to the output text)."""
        try:
            text = self.tokenizer.decode([token_id])
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # an id the tokenizer does not know (model vocab > tokenizer)
            return f"token_id:{token_id}", [], 0
        if isinstance(raw, str) and raw and all(c in _BYTE_DECODER for c in raw):
            data = [_BYTE_DECODER[c] for c in raw]
        else:
            data = list(text.encode("utf-8"))
        width = len(text)
        if "\ufffd" in text and data:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        return text, data, width

    def __call__(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def width(self, token_id: int) -> int:
        """Characters the token adds to decoded text (an incomplete UTF-8 byte counts as one)."""
        return self._lookup(token_id)[2]


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
            self.offset += self.texts.width(token_id)
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
            "bytes": texts.bytes(token_id),
            "top_logprobs": [{"token": texts(t), "logprob": _clamp(v), "bytes": texts.bytes(t)}
                             for t, v in _top(entry, k)],
        })
    return {"content": content, "refusal": None}
