"""Applies a step's samples to sequences (fork, detokenize, stop) and builds RequestOutputs:
cumulative (everything so far), deltas (what is new since the request's last output) or the final
one only, as each request's ``SamplingParams.output_kind`` asks."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.core.batch import Sample, SeqOutput
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.engine.detokenizer import Detokenizer
from pagedllm.engine.stop_checker import check_stop
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

ForkFn = Callable[[SequenceGroup, Sequence, int], Sequence]


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: set[int], max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        # DELTA requests: request id -> completion index -> (tokens, characters) reported so far
        self._reported: dict[str, dict[int, tuple[int, int]]] = {}

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
            # a forked group's samples are one sequence's run of tokens (speculative decoding
            # accepts several per step); the first sample's are the group's n / best_of choices
            run = out.samples if group.forked else out.samples[:1]
            if not group.forked:
                group.forked = True
                for j, sample in enumerate(out.samples[1:], start=1):
                    child = fork(group, seq, j)  # forked before the first output token
                    self.start(child, group.sampling_params)
                    self._append(group, child, sample)
            for sample in run:
                if seq.is_finished():  # a stop inside the run: the rest is dropped
                    break
                self._append(group, seq, sample)
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
        """The request's output now. DELTA: only the tokens, logprobs and text not reported
        before (O(new tokens)), and the prompt fields in the first output only (as vLLM)."""
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
        delta = params.output_kind == RequestOutputKind.DELTA
        reported = self._reported.get(group.request_id) if delta else None
        first = reported is None
        if delta and first:
            reported = self._reported[group.request_id] = {}
        holdback = max(0, params.max_stop_len - 1)
        want_logprobs = params.logprobs is not None
        completions = []
        for i, seq in enumerate(seqs):
            text = seq.output_text
            # text that a stop string may still take back is not shown before the end
            shown = len(text) if not holdback or seq.is_finished() else max(0, len(text) - holdback)
            if reported is not None:  # DELTA (best_of == n: index i is always the same sequence)
                tokens, chars = reported.get(i, (0, 0))
                token_ids = seq.token_ids[seq.prompt_len + tokens:]
                logprobs = seq.output_logprobs[tokens:] if want_logprobs else None
                reported[i] = (tokens + len(token_ids), max(chars, shown))
                text = text[chars:shown]
            else:
                token_ids = seq.output_token_ids
                logprobs = list(seq.output_logprobs) if want_logprobs else None
                text = text[:shown]
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        if finished:
            self._reported.pop(group.request_id, None)
        with_prompt = first  # a DELTA request's later outputs leave the prompt out
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt if with_prompt else None,
            prompt_token_ids=group.prompt_token_ids if with_prompt else None,
            prompt_logprobs=(group.prompt_logprobs
                             if with_prompt and params.prompt_logprobs is not None else None),
            outputs=completions, finished=finished, metrics=group.metrics)
