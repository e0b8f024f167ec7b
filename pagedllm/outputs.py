"""What the engine returns for a request (vLLM-compatible)."""
from __future__ import annotations

from dataclasses import dataclass, field

# token id -> logprob, for the sampled token and the top-k alternatives at one position
Logprob = float
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion (one of the n sequences) of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "timeout" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step: cumulative text and tokens so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = field(default=None, repr=False)
