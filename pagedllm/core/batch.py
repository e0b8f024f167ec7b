"""What crosses from the scheduler to a worker and back: plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedllm.outputs import PositionLogprobs
from pagedllm.sampling_params import SamplingParams


# In ScheduledSeq.token_ids: the token the previous step sampled for this sequence, not yet seen
# by the host; the worker takes it from that step's device-side draws (Scheduler.schedule_ahead).
PENDING_TOKEN = -1


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute KV (and maybe sample) for ``token_ids``.

    ``token_ids`` are the tokens at positions ``[start_pos, start_pos + len(token_ids))``; the
    block table covers all of them. ``num_samples`` > 0 when this chunk ends the sequence, so its
    last position's logits are sampled (best_of times for a request's first sample).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling_params: SamplingParams
    num_samples: int
    seq_index: int = 0  # completion index, with the seed and output length drives seeded sampling
    prompt_len: int = 0
    # the whole sequence (prompt + outputs) when penalties need it, else None
    history: list[int] | None = None
    # prompt tokens at positions start_pos+1 .. start_pos+len(targets): their logprobs are wanted
    # (prompt_logprobs), predicted by the first len(targets) positions of this chunk
    prompt_logprob_targets: list[int] | None = None
    # speculative decoding (pagedllm/spec_decode): the last ``num_spec_tokens`` of token_ids are
    # drafts the step verifies (their positions' logits are sampled too; the row emits 1 to
    # num_spec_tokens + 1 tokens); ``num_lookahead`` > 0: the worker's proposer drafts that many
    # tokens after the step's sampled one (the block table covers their positions)
    num_spec_tokens: int = 0
    num_lookahead: int = 0
    # the worker's proposer (draft model, EAGLE head) does not follow this sequence: it neither
    # runs its tokens nor drafts for it (its KV for the sequence is then incomplete for good)
    proposer_skip: bool = False
    # the request's adapter (pagedllm.lora.request.LoRARequest) or None: the base model alone;
    # reaches the workers once, with the sequence (NewSeq)
    lora_request: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length once this chunk is computed."""
        return self.start_pos + len(self.token_ids)


@dataclass
class ScheduledBatch:
    """A step's work for a worker. Prefill chunks (num_tokens > 1 or first sample) come first."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    # sequences whose blocks were freed since the last batch (finished, aborted, or preempted by
    # recomputation): the workers drop what they keep of them
    finished_seq_ids: list[int] = field(default_factory=list)
    # guided decoding: int32 [len(seqs), ceil(vocab / 32)] (a host torch tensor, filled by the
    # engine after scheduling; the scheduler never sets it): bit t of row i set iff token t may
    # be sampled for seqs[i]; None when no sampled sequence is guided
    token_bitmask: Any = None
    # which virtual engine (pipeline slot) scheduled this batch: its block ids index that
    # engine's own KV cache (one per engine, as in vLLM 0.7); 0 without pipeline parallelism
    virtual_engine: int = 0
    # KV offload / connector block moves of this step (pagedllm.kv_transfer.base.KVStepOps),
    # None when there are none: saves of evicted blocks before the step's writes, loads after
    kv_ops: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def is_empty(self) -> bool:
        """Nothing for the workers to do or to forget (a batch that only finishes sequences
        still goes to them: they drop their state of those)."""
        return not (self.seqs or self.blocks_to_swap_in or self.blocks_to_swap_out
                    or self.blocks_to_copy or self.finished_seq_ids or self.kv_ops is not None)


# --- what the executor sends: a step as a change to the state the workers keep ------------------
@dataclass
class NewSeq:
    """A sequence the workers do not hold yet: a new request, a fork, or one coming back after
    preemption by recomputation (which made the workers forget it)."""

    seq_id: int
    sampling_params: SamplingParams
    prompt_len: int
    seq_index: int
    block_table: list[int]
    # positions [0, start_pos of its first chunk) when its sampling reads the whole sequence
    # (penalties: ScheduledSeq.history), else None: the workers keep no tokens for it
    token_ids: list[int] | None = None
    lora_request: Any = None  # its adapter (ScheduledSeq.lora_request)


class SeqChunk(NamedTuple):
    """A scheduled sequence in a StepDelta, in full (ScheduledSeq's per-step fields)."""

    seq_id: int
    start_pos: int
    token_ids: list[int]
    num_samples: int
    prompt_logprob_targets: list[int] | None = None
    extra: dict[str, Any] | None = None  # other ScheduledSeq fields away from their defaults


# A scheduled sequence in a StepDelta in short: (seq_id, token), one token at the position after
# the sequence's last scheduled one, sampled once (a plain decode: most of every step).
Decode = tuple[int, int]


@dataclass
class StepDelta:
    """A step as the executor sends it: what the workers do not already hold.

    Each worker keeps every live sequence's sampling parameters, block table and (where its
    sampling reads them) tokens (worker/seq_states.py), and rebuilds the ScheduledBatch from
    this; so the bytes of a decode step grow with the batch, not with batch x context.
    Applied in order: ``finished_seq_ids`` dropped, ``new_seqs`` added, ``block_updates`` then
    ``slid`` applied to the tables, then ``seqs`` (batch order) scheduled.
    """

    seqs: list[SeqChunk | Decode] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    # seq_id -> (i, blocks): the table's entries from index i on are now ``blocks`` (appended
    # blocks, a copy-on-write replacement, a table cut back or a whole new one)
    block_updates: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    # seq_id -> k: sliding window: the first k entries now repeat entry k (BlockManager._slide)
    slid: dict[int, int] = field(default_factory=dict)
    finished_seq_ids: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    token_bitmask: Any = None
    virtual_engine: int = 0
    kv_ops: Any = None  # ScheduledBatch.kv_ops


@dataclass
class Sample:
    token_id: int
    logprob: float
    top_logprobs: PositionLogprobs | None = None  # includes the sampled token when requested


@dataclass
class SeqOutput:
    """The worker's result for one ScheduledSeq, in batch order."""

    seq_id: int
    samples: list[Sample]
    prompt_logprobs: list[PositionLogprobs] | None = None
    # speculative decoding: the drafts the worker's proposer made for the next step, and (on
    # the batch's first output only) the seconds its proposer took in this step
    spec_token_ids: list[int] | None = None
    proposer_s: float = 0.0
