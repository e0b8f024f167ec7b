"""The verification batch, built by the scheduler like any other: a decoding sequence with
drafts runs its last token plus the drafts (k + 1 query tokens, causal within) as one chunk of
the step, under the same token budget, block checks and preemption. No torch here.

``SpecScheduler`` extends the core Scheduler with the drafts each sequence carries into the
next step; ``SpecBlockManager`` adds the lookahead slots a device proposer drafts into and the
release of slots past the accepted tokens after a step.
"""
from __future__ import annotations

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Chunk, Scheduler, SchedulerOutput, _Budget
from pagedllm.core.sequence import Sequence, SequenceGroup


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SpecBlockManager(BlockManager):
    """Block tables that may reach past the scheduled tokens while a step runs.

    Invariant between steps (restored by ``trim``): a sequence's table covers exactly its
    computed tokens' blocks plus what the next schedule appends; the slots a step reserved for
    drafts that were rejected, or for the proposer's lookahead, are released after the step,
    before any fork copies the table (so no block beyond the computed tokens is ever shared).
    """

    def reserve_lookahead(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s table to cover its first ``num_tokens`` positions with fresh blocks,
        if that many are free above the watermark; False (nothing taken) otherwise."""
        table = self.block_tables[seq.seq_id]
        need = _cdiv(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if self.device.num_available - need < self.watermark_blocks:
            return False
        for _ in range(need):
            table.append(self.device.allocate())
        return True

    def trim(self, seq: Sequence) -> int:
        """Release the blocks past ``seq``'s computed tokens; returns how many were freed.
        (They hold only rejected drafts' or lookahead KV: never registered in the prefix cache,
        which takes full computed blocks only.)"""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return 0
        keep = max(1, _cdiv(seq.num_computed_tokens, self.block_size))
        freed = 0
        while len(table) > keep:
            self.device.free(table.pop())
            freed += 1
        return freed


class SpecScheduler(Scheduler):
    """A Scheduler whose decoding sequences may carry drafts (``set_drafts``): each such
    sequence is scheduled with 1 + len(drafts) tokens, drafts last (``ScheduledSeq.
    num_spec_tokens``), counted against the token budget like prompt tokens."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # seq_id -> (len(seq) when proposed, drafts); valid only while the length is unchanged
        self._drafts: dict[int, tuple[int, list[int]]] = {}

    def set_drafts(self, seq: Sequence, drafts: list[int], length: int | None = None) -> None:
        """``seq`` carries ``drafts`` into the next schedule, if its length is then ``length``
        (default: its length now)."""
        if drafts:
            self._drafts[seq.seq_id] = (len(seq) if length is None else length, list(drafts))
        else:
            self._drafts.pop(seq.seq_id, None)

    def carried_drafts(self) -> dict[int, list[int]]:
        """seq_id -> the drafts set for the next schedule (valid or not)."""
        return {seq_id: d for seq_id, (_, d) in self._drafts.items()}

    def limit_drafts(self, seq: Sequence, limit: int) -> None:
        """Keep at most ``limit`` of ``seq``'s drafts."""
        entry = self._drafts.get(seq.seq_id)
        if entry is not None:
            if limit <= 0:
                del self._drafts[seq.seq_id]
            else:
                self._drafts[seq.seq_id] = (entry[0], entry[1][:limit])

    def clear_drafts(self) -> None:
        self._drafts.clear()

    def drafts_of(self, seq: Sequence) -> list[int]:
        """The drafts ``seq`` carries into this schedule: [] unless it is decoding (one
        uncomputed token) at the length they were proposed for."""
        entry = self._drafts.get(seq.seq_id)
        if entry is None or entry[0] != len(seq) or seq.num_uncomputed_tokens != 1:
            return []
        return entry[1]

    def _running_chunks(self, group: SequenceGroup, budget: _Budget) -> list[Chunk]:
        chunks = []
        for seq, n in super()._running_chunks(group, budget):
            m = min(len(self.drafts_of(seq)), budget.tokens) if n == 1 else 0
            budget.tokens -= m
            chunks.append((seq, n + m))
        return chunks

    def _build_batch(self, out: SchedulerOutput,
                     chunks: list[tuple[SequenceGroup, list[Chunk]]]) -> None:
        """The plain chunks first (the drafts taken off), then each verification chunk gets its
        drafts appended; multi-token chunks are laid out first, as the worker expects."""
        spec: dict[int, list[int]] = {}
        plain: list[tuple[SequenceGroup, list[Chunk]]] = []
        for group, group_chunks in chunks:
            fixed = []
            for seq, n in group_chunks:
                m = n - seq.num_uncomputed_tokens
                if m > 0:
                    spec[seq.seq_id] = self.drafts_of(seq)[:m]
                    n -= m
                fixed.append((seq, n))
            plain.append((group, fixed))
        super()._build_batch(out, plain)
        self._drafts.clear()  # drafts are proposed anew for every step
        if not spec:
            return
        for sched, (_, seq) in zip(out.batch.seqs, out.entries):
            drafts = spec.get(seq.seq_id)
            if drafts:
                sched.token_ids = sched.token_ids + drafts
                sched.num_spec_tokens = len(drafts)
                seq.num_computed_tokens += len(drafts)
        order = sorted(range(len(out.batch.seqs)),
                       key=lambda i: 0 if out.batch.seqs[i].num_tokens > 1 else 1)
        out.batch.seqs = [out.batch.seqs[i] for i in order]
        out.entries = [out.entries[i] for i in order]


def accept(seq: Sequence, num_spec_tokens: int, num_emitted: int) -> int:
    """After a verification of ``num_spec_tokens`` drafts emitted ``num_emitted`` tokens
    (the accepted drafts plus one): the rejected drafts are no longer computed. Returns the
    number of drafts accepted."""
    accepted = max(0, min(num_spec_tokens, num_emitted - 1))
    seq.num_computed_tokens -= num_spec_tokens - accepted
    return accepted
