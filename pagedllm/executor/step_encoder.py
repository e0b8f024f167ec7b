"""The executor's half of the per-request state: each ScheduledBatch becomes a StepDelta holding
only what the workers do not already have (core/batch.py; worker/seq_states.py is the other
half). No torch here.

The encoder remembers, per live sequence, the block table as the workers hold it and where its
last chunk ended. How a BlockManager changes a table between two steps of a sequence, and what
is sent for it:

- a new list object (first schedule, swap-in, a fork's copy): the whole table;
- appended blocks, a table cut back (speculative decoding's trim), or entries replaced at or
  after the block of the chunk's first token (copy-on-write): the table from the first change;
- sliding window placeholders (the first k entries repeat entry k): k.

Any other in-place change would go unseen; tests/executor/test_step_encoder.py rebuilds every
batch of real engine runs (prefix caching, chunked prefill, swap and recompute preemption,
forks, sliding window) and compares.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.core.batch import NewSeq, ScheduledBatch, ScheduledSeq, SeqChunk, StepDelta

# fields a SeqChunk or NewSeq carries by name; any other ScheduledSeq field travels in
# SeqChunk.extra when it is away from its default
_NAMED = {"seq_id", "token_ids", "start_pos", "block_table", "sampling_params", "num_samples",
          "seq_index", "prompt_len", "history", "prompt_logprob_targets", "lora_request"}
EXTRA_FIELDS: tuple[tuple[str, object], ...] = tuple(
    (f.name, f.default) for f in dataclasses.fields(ScheduledSeq) if f.name not in _NAMED)


@dataclass
class _Sent:
    table: list[int]  # the BlockManager's list (identity tells a replaced table)
    sent: list[int]  # the table as the workers hold it
    end: int  # position after the sequence's last scheduled chunk
    dropped: int = 0  # sliding-window placeholders the workers have


class StepEncoder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seqs: dict[int, _Sent] = {}

    @property
    def num_seqs(self) -> int:
        """Sequences the workers hold state for."""
        return len(self._seqs)

    def encode(self, batch: ScheduledBatch) -> StepDelta:
        """The StepDelta of ``batch``; call once per batch, in the order the workers run them."""
        seqs = self._seqs
        for seq_id in batch.finished_seq_ids:
            seqs.pop(seq_id, None)
        step = StepDelta(finished_seq_ids=batch.finished_seq_ids,
                         blocks_to_swap_out=batch.blocks_to_swap_out,
                         blocks_to_swap_in=batch.blocks_to_swap_in,
                         blocks_to_copy=batch.blocks_to_copy, token_bitmask=batch.token_bitmask,
                         virtual_engine=batch.virtual_engine, kv_ops=batch.kv_ops)
        bs, entries = self.block_size, step.seqs
        for s in batch.seqs:
            extra = None
            for name, default in EXTRA_FIELDS:
                value = getattr(s, name)
                if value != default:
                    extra = extra or {}
                    extra[name] = value
            known = seqs.get(s.seq_id)
            if known is None:
                step.new_seqs.append(NewSeq(
                    s.seq_id, s.sampling_params, s.prompt_len, s.seq_index, list(s.block_table),
                    s.history[:s.start_pos] if s.history is not None else None,
                    s.lora_request))
                seqs[s.seq_id] = _Sent(s.block_table, list(s.block_table), s.seq_len)
            else:
                table, sent, start, tokens = s.block_table, known.sent, s.start_pos, s.token_ids
                # the usual decode: same list, same length, its first and last block unchanged
                if not (table is known.table and len(table) == len(sent) and start // bs
                        >= len(sent) - 1 and table[-1] == sent[-1] and table[0] == sent[0]):
                    self._table_changes(s, known, step)
                plain = (len(tokens) == 1 and s.num_samples == 1 and start == known.end
                         and s.prompt_logprob_targets is None and extra is None)
                known.end = start + len(tokens)
                if plain:
                    entries.append((s.seq_id, tokens[0]))
                    continue
            entries.append(SeqChunk(s.seq_id, s.start_pos, s.token_ids, s.num_samples,
                                    s.prompt_logprob_targets, extra))
        return step

    def _table_changes(self, s: ScheduledSeq, known: _Sent, step: StepDelta) -> None:
        table, sent = s.block_table, known.sent
        if table is not known.table:  # a new list: swapped back in
            known.table, known.sent, known.dropped = table, list(table), 0
            step.block_updates[s.seq_id] = (0, list(table))
            return
        n, n_sent = len(table), len(sent)
        if n and n_sent and table[0] != sent[0]:
            # sliding window: entries [0, k) now repeat entry k (or a copy-on-write of block 0)
            first, k = table[0], known.dropped
            while k + 1 < n and table[k + 1] == first:
                k += 1
            if k > known.dropped:
                sent[:k] = [first] * k
                step.slid[s.seq_id] = known.dropped = k
        # entries before the block of the chunk's first token do not change in place
        common = min(n, n_sent)
        lo = min(s.start_pos // self.block_size, common)
        i = common
        if table[lo:common] != sent[lo:common]:
            i = next(j for j in range(lo, common) if table[j] != sent[j])
        if i < n_sent or n > n_sent:
            blocks = table[i:]
            sent[i:] = blocks
            step.block_updates[s.seq_id] = (i, blocks)
