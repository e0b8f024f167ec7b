"""Per-request edits of the logits before sampling: the guided-decoding token bitmask (an op in
the ops registry), ``allowed_token_ids``, ``logit_bias`` and ``bad_words`` (vLLM's semantics:
the logprobs a request sees are those of the edited distribution)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.worker.host_copy import to_device
from pagedllm.worker.sample_row import SampleRow

# (logits [rows, vocab] float, bitmask [rows, ceil(vocab / 32)] int32) -> None, in place
ApplyTokenBitmask = Callable[[torch.Tensor, torch.Tensor], None]

_MASK = float("-inf")


def _banned_bad_words(row: SampleRow) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output so far."""
    banned = []
    output = row.history[row.prompt_len:] if row.history is not None else []
    for word in row.params.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def apply_logits_controls(logits: torch.Tensor, rows: list[SampleRow],
                          bitmask: torch.Tensor | None,
                          apply_token_bitmask: ApplyTokenBitmask) -> torch.Tensor:
    """``logits`` [len(rows), vocab] float32 with every row's controls applied (a new tensor when
    anything changes; the caller's logits stay). ``bitmask`` [len(rows), words] int32 on the
    logits' device, or None."""
    controlled = [i for i, r in enumerate(rows) if r.params.has_logits_controls]
    if bitmask is None and not controlled:
        return logits
    logits = logits.clone()
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    vocab, device = logits.shape[1], logits.device
    for i in controlled:
        params = rows[i].params
        if params.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool, device=device)
            keep[to_device(params.allowed_token_ids, device, torch.int64)] = True
            logits[i].masked_fill_(~keep, _MASK)
        if params.logit_bias:
            ids = to_device(list(params.logit_bias), device, torch.int64)
            logits[i].index_add_(0, ids, to_device(list(params.logit_bias.values()), device,
                                                   logits.dtype))
        if params.bad_words_token_ids:
            banned = _banned_bad_words(rows[i])
            if banned:
                logits[i, to_device(banned, device, torch.int64)] = _MASK
    return logits
