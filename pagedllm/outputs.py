"""What the engine returns for a request (vLLM-compatible)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class Logprob(float):
    """A token's logprob that reads like vLLM's ``Logprob``: ``.logprob``, ``.rank`` (1 = the
    most likely token; None where unknown: a sampled token outside the top k) and
    ``.decoded_token``. It is the float itself too, so arithmetic and comparisons work as on
    the plain floats the engine passes around."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")


# token id -> logprob, for the sampled token and the top-k alternatives at one position
PositionLogprobs = dict[int, float]


def to_logprob_objects(entry: PositionLogprobs | None, k: int,
                       decode: Callable[[int], str]) -> dict[int, Logprob] | None:
    """``entry`` (the chosen token plus the top ``k``) as Logprob objects: the top k ranked 1..k
    by value; a chosen token outside them gets rank None."""
    if entry is None:
        return None
    ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
    top = ranked[:k]
    out = {t: Logprob(v, r, decode(t)) for r, (t, v) in enumerate(top, start=1)}
    for t, v in ranked[k:]:
        out[t] = Logprob(v, None, decode(t))
    return out


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
    """One request after an engine step. With ``RequestOutputKind.CUMULATIVE`` (the default)
    each output holds all of the text and tokens so far; with ``DELTA`` only what is new since
    the request's previous output (the prompt fields then come in the first output only, as in
    vLLM); with ``FINAL_ONLY`` there is one output, at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = field(default=None, repr=False)

    def use_logprob_objects(self, k: int | None, prompt_k: int | None,
                            decode: Callable[[int], str]) -> None:
        """In place: every logprob becomes a ``Logprob`` (offline outputs, as vLLM's)."""
        for c in self.outputs:
            if c.logprobs is not None:
                c.logprobs = [to_logprob_objects(e, k or 0, decode) for e in c.logprobs]  # type: ignore[misc]
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = [to_logprob_objects(e, prompt_k or 0, decode)
                                    for e in self.prompt_logprobs]
