"""Sequences and sequence groups: the scheduler's view of a request. No torch here."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedllm.outputs import PositionLogprobs, RequestMetrics
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_TIMEOUT = "timeout"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISH_REASONS = {"stop", "length", "timeout", "abort"}
# checked for every sequence several times a step: membership in a tuple compares identities
# first (a frozenset would call Enum.__hash__, a Python function, on every check)
FINISHED_STATUSES = tuple(s for s in SequenceStatus if s.is_finished)


class Sequence:
    """One token sequence: the prompt followed by the tokens generated so far.

    Invariant: ``num_computed_tokens <= len(self)``; the KV of tokens ``[0, num_computed_tokens)``
    is in this sequence's blocks. A running sequence that is decoding has exactly one uncomputed
    token (the last sampled one). Exception: while a step scheduled ahead (Scheduler.schedule_ahead)
    is in flight and the previous step's token is not yet appended, ``num_computed_tokens`` is
    ``len(self) + 1``; appending that token restores the invariant.
    """

    # the request's adapter id (LoRARequest.lora_int_id), 0: none; roots the prefix-cache keys
    # of its blocks, so sequences of different adapters never share KV blocks
    lora_int_id: int = 0

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0) -> None:
        self.seq_id = seq_id
        self.index = index  # position among the request's completions (0 .. best_of-1)
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # incremental detokenizer state, owned by the engine's detokenizer
        self.output_text = ""
        self.detok_state: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token still needs its KV computed (a prompt or a recompute)."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    def append_token(self, token_id: int, logprob: float, logprobs: PositionLogprobs | None) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy sharing history; the caller forks the block table alongside and starts the
        child's detokenizer (its state is not copyable with every tokenizers version)."""
        import copy

        child = copy.copy(self)
        child.seq_id = seq_id
        child.index = index
        child.token_ids = list(self.token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.detok_state = None
        return child


@dataclass
class SequenceGroup:
    """A request: one prompt and the sequences sampled from it (n / best_of of them)."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    priority: int = 0
    deadline: float | None = None  # monotonic clock; finished as "timeout" once passed
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    lora_request: Any = None  # pagedllm.lora.request.LoRARequest or None
    forked: bool = False  # set once the first sample created the best_of sequences
    order: int = field(default=0, compare=False)  # tie-breaker: admission counter

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def num_unfinished_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.is_finished())

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    def is_prefill(self) -> bool:
        return any(s.is_prefill for s in self.seqs if s.status not in FINISHED_STATUSES)

    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and not all prompt positions have them yet."""
        if self.sampling_params.prompt_logprobs is None:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 without one."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def sort_key(self) -> tuple[int, float, int]:
        """Lower sorts first: higher priority (smaller number), then earlier arrival."""
        return (self.priority, self.arrival_time, self.order)
