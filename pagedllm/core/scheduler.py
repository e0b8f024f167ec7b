"""Continuous batching: which sequences run each step, under token and sequence budgets. No torch."""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.batch import PENDING_TOKEN, ScheduledBatch, ScheduledSeq
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus

Chunk = tuple[Sequence, int]  # a sequence and how many of its uncomputed tokens run this step


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch
    # parallel to batch.seqs: the group and sequence each ScheduledSeq belongs to
    entries: list[tuple[SequenceGroup, Sequence]] = field(default_factory=list)
    timed_out: list[SequenceGroup] = field(default_factory=list)
    num_preempted: int = 0


@dataclass
class _Budget:
    tokens: int
    seqs: int


class Scheduler:
    """Three queues (waiting, running, swapped) and one policy.

    Each step: (1) running sequences get their next token (decodes first, then the next chunk of
    any partial prefill), preempting the lowest-priority running requests when blocks run out;
    (2) if nothing was preempted, swapped requests come back; (3) if nothing is swapped out, waiting
    requests are admitted in priority order while the token budget, the sequence budget and the
    free blocks (above the watermark) allow.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 can_swap: bool = True) -> None:
        self.config = config
        self.block_manager = block_manager
        self.can_swap = can_swap and block_manager.num_host_blocks > 0
        self.waiting: list[SequenceGroup] = []  # kept sorted by SequenceGroup.sort_key
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self._finished_seq_ids: list[int] = []
        self._order = 0
        # KV connectors / offload tiers (kv_transfer/scheduler_side.KVConnectorManager), set
        # by the engine: loads prefixes held below the device before admitting a request
        self.kv = None

    # --- queue management ----------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        group.order = self._order
        self._order += 1
        self._enqueue_waiting(group)

    def _enqueue_waiting(self, group: SequenceGroup) -> None:
        bisect.insort_right(self.waiting, group, key=SequenceGroup.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def _finish(self, group: SequenceGroup, status: SequenceStatus) -> None:
        for seq in group.unfinished_seqs():
            seq.status = status
        for seq in group.seqs:
            self._free_seq(seq)

    def _free_seq(self, seq: Sequence) -> None:
        if seq.seq_id in self.block_manager.block_tables or seq.seq_id in self.block_manager.host_tables:
            self._finished_seq_ids.append(seq.seq_id)
        self.block_manager.free(seq)

    def abort(self, request_ids: set[str]) -> list[SequenceGroup]:
        """Finish the given requests as aborted, in whatever state they are; frees their blocks."""
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in request_ids]:
                queue.remove(group)
                self._finish(group, SequenceStatus.FINISHED_ABORTED)
                aborted.append(group)
        return aborted

    def free_finished(self) -> None:
        """Release blocks of finished sequences and drop finished requests from the running queue."""
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished():
                    self._free_seq(seq)
        self.running = [g for g in self.running if not g.is_finished()]

    def _expire(self, now: float) -> list[SequenceGroup]:
        expired = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.deadline is not None and now >= g.deadline]:
                queue.remove(group)
                self._finish(group, SequenceStatus.FINISHED_TIMEOUT)
                expired.append(group)
        return expired

    # --- the policy ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(batch=ScheduledBatch())
        out.timed_out = self._expire(time.monotonic())
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        chunks: list[tuple[SequenceGroup, list[Chunk]]] = []

        self._schedule_running(out, budget, chunks)
        if out.num_preempted == 0:
            self._schedule_swapped(out, budget, chunks)
        if out.num_preempted == 0 and not self.swapped:
            self._schedule_waiting(budget, chunks)

        self._build_batch(out, chunks)
        out.batch.finished_seq_ids = self._finished_seq_ids
        self._finished_seq_ids = []
        if self.kv is not None:
            self.kv.end_schedule(out.batch)
        return out

    def _running_chunks(self, group: SequenceGroup, budget: _Budget) -> list[Chunk]:
        result = []
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            n = min(seq.num_uncomputed_tokens, budget.tokens)
            if n <= 0:
                break
            budget.tokens -= n
            result.append((seq, n))
        return result

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget,
                          chunks: list[tuple[SequenceGroup, list[Chunk]]]) -> None:
        decodes: list[SequenceGroup] = []
        prefills: list[SequenceGroup] = []
        for group in sorted(self.running, key=SequenceGroup.sort_key):
            (prefills if group.is_prefill() else decodes).append(group)
        # decodes before partial prefills, so ongoing generations keep a steady pace
        pending = decodes + prefills
        kept: list[SequenceGroup] = []
        while pending:
            group = pending.pop(0)
            budget.seqs -= group.num_unfinished_seqs()
            group_chunks = self._running_chunks(group, budget)
            if not group_chunks:
                kept.append(group)  # out of token budget this step; stays running
                continue
            while not self.block_manager.can_append(group_chunks):
                victim = max(pending, key=SequenceGroup.sort_key) if pending else group
                if victim is group:
                    break
                pending.remove(victim)
                budget.seqs += victim.num_unfinished_seqs()
                self._preempt(victim, out)
            else:
                for seq, n in group_chunks:
                    out.batch.blocks_to_copy.extend(self.block_manager.append_slots(seq, n))
                chunks.append((group, group_chunks))
                kept.append(group)
                continue
            budget.tokens += sum(n for _, n in group_chunks)
            budget.seqs += group.num_unfinished_seqs()
            self._preempt(group, out)
        self.running = kept

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        out.num_preempted += 1
        self.num_preemptions += 1
        if (self.config.preemption_mode == "swap" and self.can_swap
                and self.block_manager.can_swap_out(group)):
            out.batch.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in group.unfinished_seqs():
            self._free_seq(seq)  # the workers forget it too; it comes back as a new sequence
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self._enqueue_waiting(group)

    def _lora_fits(self, group: SequenceGroup) -> bool:
        """Whether ``group`` may join the running requests without more distinct adapters
        running than ``max_loras`` (the workers' device slots; 0: LoRA is off)."""
        lora_id = group.lora_int_id
        if not lora_id or not self.config.max_loras:
            return True
        running = {g.lora_int_id for g in self.running} - {0}
        return lora_id in running or len(running) < self.config.max_loras

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget,
                          chunks: list[tuple[SequenceGroup, list[Chunk]]]) -> None:
        for group in sorted(self.swapped, key=SequenceGroup.sort_key):
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if budget.seqs < len(seqs) or budget.tokens < len(seqs):
                break
            if not self._lora_fits(group):
                continue  # its adapter waits for a slot; others may come back
            if not self.block_manager.can_swap_in(group):
                break
            out.batch.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            group_chunks = []
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                out.batch.blocks_to_copy.extend(self.block_manager.append_slots(seq, 1))
                group_chunks.append((seq, 1))
            budget.seqs -= len(seqs)
            budget.tokens -= len(seqs)
            self.swapped.remove(group)
            self.running.append(group)
            chunks.append((group, group_chunks))

    def _schedule_waiting(self, budget: _Budget,
                          chunks: list[tuple[SequenceGroup, list[Chunk]]]) -> None:
        chunked = self.config.enable_chunked_prefill
        skipped: list[SequenceGroup] = []  # waiting for an adapter slot (LoRA), order kept
        try:
            self._admit_waiting(budget, chunks, chunked, skipped)
        finally:
            for group in reversed(skipped):
                self.waiting.insert(0, group)

    def _admit_waiting(self, budget: _Budget, chunks: list[tuple[SequenceGroup, list[Chunk]]],
                       chunked: bool, skipped: list[SequenceGroup]) -> None:
        while self.waiting:
            group = self.waiting[0]
            if not self._lora_fits(group):
                skipped.append(self.waiting.pop(0))  # later requests may use running adapters
                continue
            if self.kv is not None and not self.kv.ready(group):
                skipped.append(self.waiting.pop(0))  # its prefix is loading from a KV store
                continue
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if budget.seqs < len(seqs):
                return
            group_chunks: list[Chunk] = []
            tokens = budget.tokens
            for seq in seqs:
                need = len(seq) - self.block_manager.num_prefix_hit_tokens(seq)
                n = min(need, tokens) if chunked else need
                if n <= 0 or n > tokens:
                    return
                group_chunks.append((seq, n))
                tokens -= n
            if not self.block_manager.can_allocate(group_chunks):
                return
            for seq, n in group_chunks:
                self.block_manager.allocate(seq, n)
                seq.status = SequenceStatus.RUNNING
            budget.tokens = tokens
            budget.seqs -= len(seqs)
            self.waiting.pop(0)
            self.running.append(group)
            chunks.append((group, group_chunks))

    def _build_batch(self, out: SchedulerOutput,
                     chunks: list[tuple[SequenceGroup, list[Chunk]]]) -> None:
        entries: list[tuple[int, ScheduledSeq, SequenceGroup, Sequence]] = []
        for group, group_chunks in chunks:
            params = group.sampling_params
            needs_history = params.needs_history
            for seq, n in group_chunks:
                start = seq.num_computed_tokens
                done = start + n == len(seq)
                num_samples = 0
                if done:
                    num_samples = params.best_of if not group.forked else 1
                sched = ScheduledSeq(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[start:start + n],
                    start_pos=start,
                    block_table=self.block_manager.block_tables[seq.seq_id],
                    sampling_params=params,
                    num_samples=num_samples,
                    seq_index=seq.index,
                    prompt_len=seq.prompt_len,
                    history=seq.token_ids if needs_history else None,
                    prompt_logprob_targets=(seq.token_ids[start + 1:min(start + n + 1, seq.prompt_len)]
                                            if group.wants_prompt_logprobs() else None),
                    lora_request=group.lora_request,
                )
                seq.num_computed_tokens += n
                # multi-token chunks first: the worker lays prefills out before decodes
                entries.append((0 if n > 1 else 1, sched, group, seq))
        entries.sort(key=lambda e: e[0])
        out.batch.seqs = [e[1] for e in entries]
        out.entries = [(e[2], e[3]) for e in entries]

    # --- scheduling ahead of the device ---------------------------------------------------
    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``prev`` while ``prev`` still runs: each sequence ``prev`` samples for
        decodes its pending token (PENDING_TOKEN; the worker takes it from prev's draws).

        Waiting requests are admitted into the sequence slots and tokens that the continuing
        decodes leave, as the plain ``schedule()`` would admit them after prev's outputs (so the
        host prepares a step with new prompts while the device still runs prev).

        None when the plain ``schedule()`` could decide differently: requests swapped out,
        running requests prev did not sample, a request whose next step needs prev's tokens on
        the host (penalties, best_of forks, prompt logprobs) or has a deadline, too few free
        blocks for the decodes (that would preempt) or for whatever the budgets could admit,
        or waiting requests with prefix caching on (prev's blocks are not yet in the cache).
        Sequences that prev's token finishes by length are left out; one that stops on a sampled
        token (EOS, stop string) computes one wasted token, dropped when its output is applied.
        """
        if self.swapped:
            return None
        sampled = {e.seq_id for e in prev.batch.seqs if e.num_samples > 0}
        chunks: list[tuple[SequenceGroup, Sequence]] = []  # the sequences prev does not finish
        for group in self.running:
            params = group.sampling_params
            if (group.deadline is not None or (params.best_of > 1 and not group.forked)
                    or group.wants_prompt_logprobs() or params.needs_history):
                return None
            for seq in group.unfinished_seqs():
                if seq.seq_id not in sampled or seq.num_computed_tokens != len(seq):
                    return None
                outputs = seq.num_output_tokens + 1  # once prev's token is appended
                if not ((params.max_tokens is not None and outputs >= params.max_tokens)
                        or len(seq) + 1 >= self.config.max_model_len):
                    chunks.append((group, seq))
        budget = _Budget(self.config.max_num_batched_tokens - len(chunks),
                         self.config.max_num_seqs - len(chunks))
        admit = bool(self.waiting) and budget.seqs > 0 and budget.tokens > 0
        if admit and not self._can_admit_ahead(budget, len(chunks)):
            return None
        if not (chunks or admit):
            return None
        if not self.block_manager.can_append((seq, 1) for _, seq in chunks):
            return None
        out = SchedulerOutput(batch=ScheduledBatch())
        for _, seq in chunks:
            out.batch.blocks_to_copy.extend(self.block_manager.append_slots(seq, 1))
        admitted: list[tuple[SequenceGroup, list[Chunk]]] = []
        if admit:
            self._schedule_waiting(budget, admitted)
            if not (chunks or admitted):
                return None
        self._build_batch(out, admitted)  # the new prompts, then the decodes of pending tokens
        for group, seq in chunks:
            out.batch.seqs.append(ScheduledSeq(
                seq_id=seq.seq_id, token_ids=[PENDING_TOKEN], start_pos=seq.num_computed_tokens,
                block_table=self.block_manager.block_tables[seq.seq_id],
                sampling_params=group.sampling_params, num_samples=1, seq_index=seq.index,
                prompt_len=seq.prompt_len, lora_request=group.lora_request))
            out.entries.append((group, seq))
            seq.num_computed_tokens += 1  # one past len(seq) until prev's token is appended
        out.batch.finished_seq_ids = self._finished_seq_ids
        self._finished_seq_ids = []
        if self.kv is not None:
            self.kv.end_schedule(out.batch)
        return out

    def _can_admit_ahead(self, budget: _Budget, num_decodes: int) -> bool:
        """Whether admitting ahead is sure to admit what the plain schedule() would: no prefix
        caching, no deadlines, and enough free blocks for the most the budgets allow (each
        sequence's tokens plus a partial block) on top of one new block per decode."""
        if self.block_manager.enable_caching or any(g.deadline is not None for g in self.waiting):
            return False
        worst = budget.tokens // self.block_manager.block_size + budget.seqs + num_decodes
        return self.block_manager.device.num_available - worst >= self.block_manager.watermark_blocks

    def after_step(self, out: SchedulerOutput) -> None:
        """The step's KV is written: full blocks may now serve as prefix-cache hits."""
        for _, seq in out.entries:
            self.block_manager.cache_full_blocks(seq)
