"""Applies a step's samples to sequences (fork, detokenize, stop) and builds RequestOutputs."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.core.batch import Sample, SeqOutput
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.engine.detokenizer import Detokenizer
from pagedllm.engine.stop_checker import check_stop
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

ForkFn = Callable[[SequenceGroup, Sequence, int], Sequence]


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: set[int], max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def start(self, seq: Sequence, params: SamplingParams) -> None:
        self.detokenizer.start(seq, params.skip_special_tokens)

    def apply(self, sched: Any, outputs: list[SeqOutput], fork: ForkFn) -> list[SequenceGroup]:
        """Returns the groups that got new tokens, in batch order, each once."""
        touched: dict[str, SequenceGroup] = {}
        now = time.time()
        for (group, seq), sched_seq, out in zip(sched.entries, sched.batch.seqs, outputs):
            if group.metrics is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            if out.prompt_logprobs is not None:
                self._store_prompt_logprobs(group, sched_seq.start_pos, out.prompt_logprobs)
            if not out.samples or seq.is_finished():
                continue
            if not group.forked:
                group.forked = True
                for j, sample in enumerate(out.samples[1:], start=1):
                    child = fork(group, seq, j)  # forked before the first output token
                    self.start(child, group.sampling_params)
                    self._append(group, child, sample)
            self._append(group, seq, out.samples[0])
            if group.metrics is not None:
                group.metrics.first_token_time = group.metrics.first_token_time or now
                group.metrics.last_token_time = now
            touched[group.request_id] = group
        return list(touched.values())

    @staticmethod
    def _store_prompt_logprobs(group: SequenceGroup, start: int, lps: list) -> None:
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        for j, lp in enumerate(lps):
            pos = start + 1 + j
            if pos < len(group.prompt_logprobs):
                group.prompt_logprobs[pos] = lp
            else:
                group.prompt_logprobs.append(lp)

    def _append(self, group: SequenceGroup, seq: Sequence, sample: Sample) -> None:
        params = group.sampling_params
        seq.append_token(sample.token_id, sample.logprob,
                         sample.top_logprobs if params.logprobs is not None else None)
        new_text = self.detokenizer.step(seq, sample.token_id)
        check_stop(seq, params, len(new_text), self.eos_ids, self.max_model_len)

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs = sorted(group.seqs, key=lambda s: s.index)
        if params.best_of > params.n:  # type: ignore[operator]
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
        seqs = seqs[: params.n]
        finished = group.is_finished()
        if finished and not group.forked:
            # timed out or aborted before the first sample forked the group's n sequences: each of
            # the n choices reports the one sequence's (empty) output and its finish reason
            seqs = seqs * params.n
        if finished and group.metrics is not None and group.metrics.finished_time is None:
            group.metrics.finished_time = time.time()
        holdback = max(0, params.max_stop_len - 1)
        completions = []
        for i, seq in enumerate(seqs):
            text = seq.output_text
            if holdback and not seq.is_finished():
                text = text[: max(0, len(text) - holdback)]
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids,
                             prompt_logprobs=group.prompt_logprobs if params.prompt_logprobs is not None else None,
                             outputs=completions, finished=finished, metrics=group.metrics)
