"""One row of logits to sample from, as the model runner hands it to the sampler and to the
per-request logits controls (its own module so both may import it)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """One row of logits to sample ``num_samples`` tokens from."""

    params: SamplingParams
    num_samples: int
    seq_index: int
    output_len: int
    history: list[int] | None  # prompt + outputs, when penalties need it
    prompt_len: int
