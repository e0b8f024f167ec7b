"""Speculative decoding's counters, with vLLM's meanings (no torch here):

- drafts: verifications run (one per sequence per step that carried drafts);
- draft tokens: tokens proposed and verified;
- accepted tokens: drafts the target accepted;
- emitted tokens: tokens the verifications emitted (accepted drafts plus one each);
- acceptance rate = accepted / draft tokens; mean accepted length = emitted / drafts (vLLM's
  "mean acceptance length": 1 + the accepted drafts per verification);
- accepted per position: how often the i-th draft of a verification was accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # steps the guard ran with and without speculation
    num_spec_steps: int = 0
    num_plain_steps: int = 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification of ``num_draft_tokens`` drafts, ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float | int | list[int]]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_emitted_tokens": self.num_emitted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "accepted_per_position": list(self.accepted_per_position),
                "num_spec_steps": self.num_spec_steps, "num_plain_steps": self.num_plain_steps}
