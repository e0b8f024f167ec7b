"""SpeculativeConfig: which proposer drafts tokens and how many (vLLM's names). No torch here.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM(model, speculative_config={"model": DRAFT_PATH, "num_speculative_tokens": 4})
    LLM(model, speculative_config={"method": "eagle", "model": HEAD_PATH,
                                   "num_speculative_tokens": 4})
    pagedllm serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Validation here checks the fields alone; what needs the target model or the backend (a draft
sharing the tokenizer, the backend's multi-token decode) is checked when the engine starts
(``pagedllm.spec_decode.setup``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# vLLM's method names; "draft" is this project's short name for "draft_model"
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
_METHOD_ALIASES = {"draft": "draft_model"}
ACCEPTANCE_METHODS = ("rejection_sampler",)
MAX_SPECULATIVE_TOKENS = 16
# n-gram lengths when neither bound is given (vLLM's default)
DEFAULT_PROMPT_LOOKUP = 5


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"speculative_config.{name}={value!r} is invalid: {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts ``num_speculative_tokens`` tokens per decoding
    sequence, the target model scores them in one step (k + 1 query tokens per sequence), and
    the rejection sampler keeps the longest prefix that the target's distribution accepts plus
    one token of its own. Greedy output is the target's, token for token."""

    num_speculative_tokens: int | None = None
    # None: "draft_model" when ``model`` is given (or "eagle"/"eagle3" when the checkpoint is an
    # EAGLE head; decided at start-up), else an error
    method: str | None = None
    # the draft model or EAGLE head folder; None with "eagle"/"draft_model" on the demo model:
    # the head/draft shipped with it
    model: str | None = None
    # n-gram lengths searched, longest first (ngram only)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # no speculation in a step whose running batch is larger than this (None: the engine's
    # adaptive guard decides)
    disable_by_batch_size: int | None = None
    # accepted for vLLM compatibility; only these values are supported
    acceptance_method: str = "rejection_sampler"
    draft_tensor_parallel_size: int | None = None
    disable_logprobs: bool = False
    quantization: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None:
            if not isinstance(self.method, str):
                _fail("method", self.method, f"allowed values are {', '.join(METHODS)}")
            self.method = _METHOD_ALIASES.get(self.method, self.method)
            if self.method not in METHODS:
                _fail("method", self.method,
                      f"allowed values are {', '.join(METHODS)} (or 'draft' for draft_model)")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            _fail("model", self.model, "must be a local checkpoint folder (a non-empty string)")
        if self.method == "ngram" and self.model not in (None, "ngram", "[ngram]"):
            _fail("model", self.model, "method 'ngram' takes no model (prompt lookup uses the "
                  "request's own tokens)")
        if self.method == "ngram":
            self.model = None
        if self.method is None and self.model is None:
            _fail("method", None, f"give a method ({', '.join(METHODS)}) or a draft model "
                  "folder as 'model'")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:  # type: ignore[operator]
            _fail("num_speculative_tokens", k,
                  f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        self._check_lookup()
        if self.disable_by_batch_size is not None and (
                not _is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 2):
            _fail("disable_by_batch_size", self.disable_by_batch_size,
                  "must be an integer >= 2 or None")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            _fail("acceptance_method", self.acceptance_method,
                  f"allowed values are {', '.join(ACCEPTANCE_METHODS)}")
        if self.draft_tensor_parallel_size not in (None, 1):
            _fail("draft_tensor_parallel_size", self.draft_tensor_parallel_size,
                  "allowed values are 1 or None (the draft runs unsharded)")
        if not isinstance(self.disable_logprobs, bool):
            _fail("disable_logprobs", self.disable_logprobs, "must be true or false")
        if self.quantization is not None:
            _fail("quantization", self.quantization, "allowed value is None (the draft's "
                  "checkpoint decides)")
        if self.max_model_len is not None and (not _is_int(self.max_model_len)
                                               or self.max_model_len < 1):
            _fail("max_model_len", self.max_model_len, "must be an integer >= 1 or None")

    def _check_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:
                    _fail(name, value, f"applies to method 'ngram' only (method is "
                          f"{self.method!r})")
            return
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                _fail(name, value, "must be an integer >= 1 or None")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:  # type: ignore[operator]
            _fail("prompt_lookup_min", lo, f"must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from what a user passes: a dict (``LLM(speculative_config=...)``), its JSON
        text (``--speculative-config``), a config, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return None
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"speculative_config={text!r} is invalid: must be a JSON "
                                 f"object ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} is invalid: must be a dict (or its "
                             "JSON text) with keys such as method, model, num_speculative_tokens")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}; allowed keys: "
                             f"{', '.join(known)}")
        return cls(**value)

    @property
    def uses_device_proposer(self) -> bool:
        """Whether drafts come from a model on the workers (draft model, EAGLE head) rather
        than from the host (n-gram)."""
        return self.method != "ngram"

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}
