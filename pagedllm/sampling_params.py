"""Sampling parameters for one request (vLLM-compatible names and defaults)."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_SAMPLING_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(IntEnum):
    """Which RequestOutputs a request produces (vLLM's names): after every step, all of the text
    and tokens so far (CUMULATIVE) or only what is new since the previous output (DELTA: what a
    server streams); or only the last one (FINAL_ONLY: offline generation, ``LLM.generate``)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")


GUIDED_BACKENDS = ("xgrammar", "auto")
_GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class GuidedDecodingParams:
    """Constrain a request's output to a JSON schema, a regex, one of some strings, an EBNF/GBNF
    grammar or any JSON object (vLLM's names). Exactly one of the five is set.

    Only the syntax of the fields is checked here; the schema, regex or grammar itself is parsed
    when the request is added (``pagedllm.engine.guided``), which names the field it rejects.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        def fail(name: str, value: object, allowed: str) -> None:
            raise ValueError(f"GuidedDecodingParams.{name}={value!r} is invalid: {allowed}")

        given = [k for k in _GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"GuidedDecodingParams needs exactly one of {', '.join(_GUIDED_KINDS)}"
                             f"; got {', '.join(given) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    loaded = json.loads(self.json)
                except ValueError as exc:
                    fail("json", self.json, f"must be a JSON schema (a dict or its JSON text): {exc}")
                if not isinstance(loaded, (dict, bool)):
                    fail("json", self.json, "must be a JSON schema object")
            elif not isinstance(self.json, dict):
                fail("json", self.json, "must be a JSON schema (a dict or its JSON text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            fail("regex", self.regex, "must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                fail("choice", self.choice, "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            fail("grammar", self.grammar, "must be a non-empty EBNF/GBNF grammar string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            fail("json_object", self.json_object, "must be a bool")
        if self.backend is not None and self.backend.split(":")[0] not in GUIDED_BACKENDS:
            fail("backend", self.backend, f"allowed: {', '.join(GUIDED_BACKENDS)}")
        if self.whitespace_pattern is not None:
            fail("whitespace_pattern", self.whitespace_pattern,
                 "not supported by the xgrammar backend (JSON is generated compactly); leave unset")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, regex, choice, grammar, json_object."""
        return next(k for k in _GUIDED_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value,
                               sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(value)
        return kind, str(value)


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one request.

    Every field is validated in ``__post_init__``; an invalid value raises ValueError naming the
    field, the value and the allowed range.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    timeout_seconds: float | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: GuidedDecodingParams | None = None
    # token id -> bias added to its logit (OpenAI semantics: values in [-100, 100])
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # filled in by the engine from the tokenizer / generation config; not user-facing
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)
    # bad_words as token ids (each word with and without a leading space), set by the engine
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)

        if not is_int(self.n) or self.n < 1:
            _fail("n", self.n, "must be an integer >= 1")
        if not is_int(self.best_of) or self.best_of < self.n:
            _fail("best_of", self.best_of, f"must be an integer >= n ({self.n})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                _fail(name, v, "must be a number in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", self.repetition_penalty, "must be a number in (0, 2]")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            _fail("temperature", self.temperature, "must be a number in [0, 2]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be a number in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            _fail("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be a number in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            _fail("seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                _fail(name, v, "must be None or an integer >= 0")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                _fail("stop", s, "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                _fail("stop_token_ids", t, "token ids must be integers >= 0")
        if self.timeout_seconds is not None and (not is_num(self.timeout_seconds)
                                                 or self.timeout_seconds <= 0):
            _fail("timeout_seconds", self.timeout_seconds, "must be a number > 0 or None")
        if self.output_kind not in tuple(RequestOutputKind):
            _fail("output_kind", self.output_kind, "allowed: RequestOutputKind.CUMULATIVE, "
                  "RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY")
        if self.output_kind == RequestOutputKind.DELTA and self.best_of != self.n:
            _fail("output_kind", self.output_kind, f"DELTA needs best_of == n (best_of="
                  f"{self.best_of}, n={self.n}): the best n sequences are known only at the end")
        if self.best_of > 1 and self.sampling_type == SamplingType.GREEDY and self.best_of != self.n:
            _fail("best_of", self.best_of, "must equal n when sampling greedily (temperature=0)")
        self._verify_logits_controls(is_int, is_num)

    def _verify_logits_controls(self, is_int: Any, is_num: Any) -> None:
        """guided_decoding, logit_bias, allowed_token_ids, bad_words (token ids are checked
        against the vocabulary when the engine adds the request)."""
        if self.guided_decoding is not None:
            if isinstance(self.guided_decoding, dict):
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                _fail("guided_decoding", self.guided_decoding,
                      "must be a GuidedDecodingParams or None")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", self.logit_bias, "must be a dict {token id: bias}")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)  # JSON object keys arrive as strings
                except (TypeError, ValueError):
                    _fail("logit_bias", k, "keys must be token ids (integers >= 0)")
                if tok < 0:
                    _fail("logit_bias", k, "keys must be token ids (integers >= 0)")
                if not is_num(v) or not -100.0 <= v <= 100.0:
                    _fail("logit_bias", v, f"the bias of token {tok} must be a number in [-100, 100]")
                bias[tok] = float(v)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                _fail("allowed_token_ids", ids, "must be a non-empty list of token ids or None")
            for t in ids:
                if not is_int(t) or t < 0:
                    _fail("allowed_token_ids", t, "token ids must be integers >= 0")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                _fail("bad_words", self.bad_words, "must be a list of non-empty strings")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    _fail("bad_words", w, "each bad word must be a non-empty string")
            self.bad_words = list(self.bad_words) or None

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's tokens so far (repetition/presence/frequency
        penalties)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0
                or any(len(w) > 1 for w in self.bad_words_token_ids))

    @property
    def has_logits_controls(self) -> bool:
        """Whether the sampler edits this request's logits (logit_bias, allowed_token_ids,
        bad_words); guided decoding's mask arrives separately, per step."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def max_stop_len(self) -> int:
        """Characters of text held back while streaming so a partial stop string never leaks."""
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        """An independent copy: the fields are immutable values except these three containers
        (a deepcopy did the same at ~30x the cost, paid once per request)."""
        new = copy.copy(self)
        new.stop = list(self.stop)
        new.stop_token_ids = list(self.stop_token_ids)
        new.all_stop_token_ids = set(self.all_stop_token_ids)
        new.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        return new
