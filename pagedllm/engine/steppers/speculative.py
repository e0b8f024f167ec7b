"""The speculative stepper: each step, decoding sequences carry drafts (n-gram on the host
before scheduling, or the device proposer's from the previous step), the scheduler builds the
verification batch (k + 1 query tokens per such sequence, beside prompts and plain decodes),
the workers verify with the rejection sampler and propose again; after the step the rejected
drafts' slots are released and the accepted tokens count as computed.

A guard (spec_decode/guard.py) decides per step whether to speculate: ``disable_by_batch_size``
or, unset, the measured faster of the two modes at this batch size.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.steppers.base import StepDone, Stepper
from pagedllm.spec_decode.guard import SpecGuard
from pagedllm.spec_decode.metrics import SpecDecodeMetrics
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.scheduler import SpecBlockManager, SpecScheduler, accept

if TYPE_CHECKING:
    from pagedllm.core.batch import SeqOutput
    from pagedllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)
PER_REQUEST_HISTORY = 100_000
UNFOLLOW_AFTER = 16  # steps preferring no speculation before the device proposer stops following


def can_speculate(group: SequenceGroup) -> bool:
    """Whether a request's decodes may carry drafts: not guided (its grammar advances over
    sampled tokens only) and past its first sample (forks, prompt logprobs)."""
    params = group.sampling_params
    return (params.guided_decoding is None and (group.forked or params.best_of == 1)
            and not group.wants_prompt_logprobs())


class SpecStepper(Stepper):
    def __init__(self, *args: object, speculative_config: SpeculativeConfig,
                 max_model_len: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        spec = speculative_config
        assert isinstance(self.scheduler, SpecScheduler)
        assert isinstance(self.scheduler.block_manager, SpecBlockManager)
        self.k = int(spec.num_speculative_tokens)  # type: ignore[arg-type]
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(spec) if spec.method == "ngram" else None
        self.guard = SpecGuard(spec.disable_by_batch_size)
        self.metrics = SpecDecodeMetrics()
        # request id -> [verifications, draft tokens, accepted drafts] (the most recent requests;
        # benchmarks report per-request acceptance from it)
        self.per_request: OrderedDict[str, list[int]] = OrderedDict()
        # device proposers: whether the proposer follows a sequence, decided when the stepper
        # first schedules it (by the guard's preferred mode at that batch size) and dropped when
        # its blocks are freed; steps the guard keeps speculation off in a row (past
        # UNFOLLOW_AFTER the proposer stops following every sequence: no mirror cost)
        self._follow: dict[int, bool] = {}
        self._off_streak = 0
        self._decode_batch = 0  # the batch the last scheduled step's sequences decode in

    # --- limits ----------------------------------------------------------------------------
    def _room(self, group: SequenceGroup, seq: Sequence, length: int) -> int:
        """Drafts a sequence of ``length`` tokens may verify: all of them plus the bonus token
        fit max_tokens and the model length."""
        params = group.sampling_params
        room = self.max_model_len - length - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - (length - seq.prompt_len) - 1)
        return max(0, min(self.k, room))

    @staticmethod
    def _running(sch: SpecScheduler) -> list[tuple[SequenceGroup, Sequence]]:
        return [(g, s) for g in sch.running for s in g.get_seqs(SequenceStatus.RUNNING)]

    # --- the step --------------------------------------------------------------------------
    def step(self) -> StepDone:
        sch: SpecScheduler = self.scheduler  # type: ignore[assignment]
        start = time.perf_counter()
        speculate, batch_size = self._plan(sch)
        sched = sch.schedule()
        outputs: list[SeqOutput] = []
        if not sched.batch.is_empty():
            self._before_launch(sch, sched, speculate)
            outputs = self.executor.execute(sched.batch)
            self._after(sch, sched, outputs)
            self._measure(sched, outputs, time.perf_counter() - start, batch_size)
        sch.after_step(sched)
        return StepDone(sch, sched, outputs)

    def _plan(self, sch: SpecScheduler) -> tuple[bool, int]:
        """Before ``sch`` schedules: whether its step speculates (the guard, at its running
        sequences' count) and the drafts each sequence carries into it; returns (speculate,
        that count)."""
        running = self._running(sch)
        speculate = self.guard.speculate(len(running))
        if not speculate:
            sch.clear_drafts()
        else:
            for group, seq in running:
                if not can_speculate(group):
                    sch.set_drafts(seq, [])
                elif self.ngram is not None:
                    if seq.num_uncomputed_tokens == 1:
                        sch.set_drafts(seq, self.ngram.propose(seq.token_ids,
                                                               self._room(group, seq, len(seq))))
                else:
                    sch.limit_drafts(seq, self._room(group, seq, len(seq)))
        return speculate, len(running)

    def _before_launch(self, sch: SpecScheduler, sched: SchedulerOutput, speculate: bool) -> None:
        """After ``sch`` scheduled a non-empty step: what the device proposer follows, its
        lookahead slots, the host-side inputs."""
        if self.ngram is None:
            self._decode_batch = self._decode_batch_size(sch)
            self._mark_followed(sched, speculate, self._decode_batch)
            if speculate:
                self._reserve_lookahead(sch, sched)
        self._prepare(sched)

    def _decode_batch_size(self, sch: SpecScheduler) -> int:
        """The batch the scheduled sequences will decode in: the running ones and those still
        waiting for their prefill, up to max_num_seqs (a wave of prompts is admitted over
        several steps: judged by the running count alone, its first sequences would be
        followed as if they were to decode alone)."""
        waiting = sum(g.num_unfinished_seqs() for g in sch.waiting)
        return min(sch.config.max_num_seqs, len(self._running(sch)) + waiting)

    def _mark_followed(self, sched: SchedulerOutput, speculate: bool, batch_size: int) -> None:
        """Which scheduled sequences the device proposer follows (ScheduledSeq.proposer_skip):
        a sequence seen for the first time is followed where the guard says so
        (``SpecGuard.follows``: speculation preferred, by a margin at large batches); after
        UNFOLLOW_AFTER steps in a row where the guard prefers no speculation none is, so a
        loaded engine whose guard keeps speculation off pays nothing for the proposer. (The
        streak counts the guard's preference, not the steps that speculated: its exploration
        step, one in ``explore_every``, would otherwise reset it before it ever ran out.)"""
        for seq_id in sched.batch.finished_seq_ids:
            self._follow.pop(seq_id, None)
        new = any(s.seq_id not in self._follow for s in sched.batch.seqs)
        if new:
            self.guard.new_sequences(batch_size)  # small batches: their drafts measured afresh
        prefer = self.guard.prefers(batch_size)
        self._off_streak = 0 if prefer else self._off_streak + 1
        if self._off_streak == UNFOLLOW_AFTER:
            self._follow = dict.fromkeys(self._follow, False)
        start = new and self.guard.follows(batch_size)  # what new sequences get
        for s in sched.batch.seqs:
            s.proposer_skip = not self._follow.setdefault(s.seq_id, start)

    def _reserve_lookahead(self, sch: SpecScheduler, sched: SchedulerOutput) -> None:
        """Slots for the drafts the device proposer makes after this step (it writes their KV
        while drafting); a sequence gets none when the cache is short of free blocks."""
        bm: SpecBlockManager = sch.block_manager  # type: ignore[assignment]
        for s, (group, seq) in zip(sched.batch.seqs, sched.entries):
            if s.num_samples == 0 or s.proposer_skip or not can_speculate(group):
                continue
            end = s.start_pos + s.num_tokens  # the sampled token's position, at the latest
            d = max(0, min(self.k, self.max_model_len - end - 1))
            if d and bm.reserve_lookahead(seq, end + d):
                s.num_lookahead = d

    def _after(self, sch: SpecScheduler, sched: SchedulerOutput,
               outputs: list[SeqOutput]) -> None:
        """Rejected drafts are not computed; every slot past the computed tokens (rejected
        drafts, lookahead) goes back before a fork could share it; the proposer's drafts are
        carried into the next step (for the length the sequence will have)."""
        bm: SpecBlockManager = sch.block_manager  # type: ignore[assignment]
        for s, (group, seq), out in zip(sched.batch.seqs, sched.entries, outputs):
            if s.num_spec_tokens and out.samples:
                accepted = accept(seq, s.num_spec_tokens, len(out.samples))
                self.metrics.record(s.num_spec_tokens, accepted)
                self._per_request(group.request_id, s.num_spec_tokens, accepted)
            bm.trim(seq)
            if out.spec_token_ids and out.samples:
                sch.set_drafts(seq, out.spec_token_ids, length=len(seq) + len(out.samples))

    def _per_request(self, request_id: str, drafts: int, accepted: int) -> None:
        entry = self.per_request.get(request_id)
        if entry is None:
            entry = self.per_request[request_id] = [0, 0, 0]
            if len(self.per_request) > PER_REQUEST_HISTORY:
                self.per_request.popitem(last=False)
        entry[0] += 1
        entry[1] += drafts
        entry[2] += accepted

    def _measure(self, sched: SchedulerOutput, outputs: list[SeqOutput], seconds: float,
                 batch_size: int) -> None:
        """Steps of decodes only feed the guard (a prompt's prefill would swamp them). What the
        device proposer spends outside speculative steps is charged to speculation: its pass
        over new prompts (at the batch they will decode in) and its mirroring of plain steps,
        which are recorded without it (the guard weighs speculation against plain decoding with
        the proposer off, which is what it switches to: after UNFOLLOW_AFTER steps preferring
        plain nothing is mirrored)."""
        verified = any(s.num_spec_tokens for s in sched.batch.seqs)
        if verified:
            self.metrics.num_spec_steps += 1
        else:
            self.metrics.num_plain_steps += 1
        proposer_s = outputs[0].proposer_s if outputs else 0.0
        if any(s.num_tokens - s.num_spec_tokens > 1 for s in sched.batch.seqs):
            self.guard.charge(self._decode_batch, proposer_s)
            return
        tokens = sum(len(o.samples) for o in outputs)
        if not verified:
            mirror = min(proposer_s, seconds / 2)
            seconds -= mirror
            self.guard.charge(batch_size, mirror)
        self.guard.record(batch_size, verified, tokens, seconds)
