"""Decides whether a sequence is finished after a new token, and trims stop strings from its text."""
from __future__ import annotations

from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams


def check_stop(seq: Sequence, params: SamplingParams, new_text_len: int, eos_ids: set[int],
               max_model_len: int) -> None:
    """Sets ``seq.status`` (and ``stop_reason``) when the last token ends the sequence."""
    token = seq.token_ids[-1]
    n_out = seq.num_output_tokens
    if n_out >= params.min_tokens:
        if not params.ignore_eos and token in eos_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if token in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = token
            return
        if params.stop and _truncate_at_stop(seq, params, new_text_len):
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
    if params.max_tokens is not None and n_out >= params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH
    elif len(seq) >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH


def _truncate_at_stop(seq: Sequence, params: SamplingParams, new_text_len: int) -> bool:
    """Find a stop string that ends in the new text (it may start in earlier text)."""
    if new_text_len == 0:
        return False
    text = seq.output_text
    best: tuple[int, str] | None = None
    for stop in params.stop:  # type: ignore[union-attr]
        # only occurrences overlapping the new text can be new
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return False
    idx, stop = best
    seq.output_text = text[: idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
    seq.stop_reason = stop
    return True
