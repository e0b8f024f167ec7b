"""Incremental detokenization, one new token at a time, per sequence."""
from __future__ import annotations

from typing import Any

from pagedllm.core.sequence import Sequence


class _FullDecodeStream:
    """Fallback for tokenizers without a Rust backend: decode the outputs and emit the new suffix.

    A trailing U+FFFD (an incomplete UTF-8 sequence) is held back until it completes.
    """

    def __init__(self, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.ids: list[int] = []
        self.emitted = ""
        self.skip = skip_special_tokens

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        self.ids.append(token_id)
        text = tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return None
        new, self.emitted = text[len(self.emitted):], text
        return new or None


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)

    def start(self, seq: Sequence, skip_special_tokens: bool) -> None:
        """Prime the stream with the prompt, so the first output token is decoded in context."""
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            seq.detok_state = DecodeStream(ids=seq.prompt_token_ids,
                                           skip_special_tokens=skip_special_tokens)
        else:
            seq.detok_state = _FullDecodeStream(seq.prompt_token_ids, skip_special_tokens)

    def step(self, seq: Sequence, token_id: int) -> str:
        """Append the text of ``token_id`` to ``seq.output_text``; returns the new text."""
        tok = self.backend if self.backend is not None else self.tokenizer
        try:
            chunk = seq.detok_state.step(tok, token_id) or ""
        except Exception:  # an id the tokenizer cannot decode (e.g. beyond its vocab)
            chunk = ""
        seq.output_text += chunk
        return chunk
