"""The worker's per-sequence state: what it keeps of every live sequence between steps, so that a
step arrives as a StepDelta (only what changed; executor/step_encoder.py) and is rebuilt here
into the ScheduledBatch the model runner reads. Every rank keeps its own copy (each tensor
parallel rank, each pipeline stage). No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.batch import ScheduledBatch, ScheduledSeq, StepDelta
from pagedllm.sampling_params import SamplingParams


@dataclass
class SeqState:
    sampling_params: SamplingParams
    prompt_len: int
    seq_index: int
    block_table: list[int]
    # positions [0, end) where sampling reads the whole sequence (penalties), else None;
    # a position scheduled ahead (PENDING_TOKEN) stays so: such sequences never need it
    tokens: list[int] | None
    end: int = 0  # position after the last scheduled chunk
    lora_request: Any = None  # the sequence's adapter (NewSeq.lora_request)


class SeqStates:
    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}

    def apply(self, step: StepDelta) -> ScheduledBatch:
        """Update the kept state with ``step`` and return the step's batch (block tables and
        histories are the kept lists themselves: read them during the step only)."""
        seqs = self.seqs
        for seq_id in step.finished_seq_ids:
            seqs.pop(seq_id, None)
        for new in step.new_seqs:
            seqs[new.seq_id] = SeqState(
                new.sampling_params, new.prompt_len, new.seq_index, list(new.block_table),
                list(new.token_ids) if new.token_ids is not None else None,
                lora_request=new.lora_request)
        for seq_id, (i, blocks) in step.block_updates.items():
            seqs[seq_id].block_table[i:] = blocks
        for seq_id, k in step.slid.items():
            table = seqs[seq_id].block_table
            table[:k] = [table[k]] * k
        batch = []
        for entry in step.seqs:
            if type(entry) is tuple:  # a Decode: (seq_id, token)
                seq_id, token = entry
                state = seqs[seq_id]
                start, token_ids, num_samples, targets, extra = state.end, [token], 1, None, None
            else:
                seq_id, start, token_ids, num_samples, targets, extra = entry  # a SeqChunk
                state = seqs[seq_id]
            state.end = start + len(token_ids)
            tokens = state.tokens
            if tokens is not None:
                del tokens[start:]
                tokens.extend(token_ids)
            batch.append(ScheduledSeq(
                seq_id, token_ids, start, state.block_table, state.sampling_params, num_samples,
                state.seq_index, state.prompt_len, tokens, targets,
                lora_request=state.lora_request, **(extra or {})))
        return ScheduledBatch(batch, step.blocks_to_swap_out, step.blocks_to_swap_in,
                              step.blocks_to_copy, step.finished_seq_ids, step.token_bitmask,
                              step.virtual_engine, step.kv_ops)
