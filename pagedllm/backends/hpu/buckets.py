"""Bucketing for Gaudi: the shapes HPU graphs are captured for (plain Python, runs anywhere).

Gaudi's graph compiler, like XLA, wants a few static shapes. Following vLLM's HPU port, a step
is one of two kinds, each bucketed over two dimensions:

* prefill: (batch size, padded prompt length): every prompt is padded to the same length, so
  the step is a [batch, length] grid of tokens;
* decode: (batch size, number of KV blocks in the flattened block list of the whole batch).

Each dimension uses a ``BucketRange``: powers of two from ``min`` up to ``step``, then
multiples of ``step`` up to ``max`` (vLLM's ``warmup_range``), so small sizes are fine-grained
and large ones grow linearly. Warm-up runs every (kind, batch, size) pair that fits the
scheduler's limits.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketRange:
    min: int
    step: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max or self.step < 1:
            raise ValueError(f"bucket range (min={self.min}, step={self.step}, max={self.max}) "
                             "needs 1 <= min <= max and step >= 1")

    def values(self) -> list[int]:
        """min, 2*min, 4*min, ... below step, then step, 2*step, ... until one covers max."""
        out, v = [], self.min
        while v < min(self.step, self.max):  # exponential ramp
            out.append(v)
            v *= 2
        if self.max <= self.step:
            return out + [v]  # the first ramp value at or past max covers it
        v = -(-max(v, self.step) // self.step) * self.step
        while True:  # linear part
            out.append(v)
            if v >= self.max:
                return out
            v += self.step

    def bucket(self, n: int) -> int:
        """The smallest value >= n; past ``max``, n rounded up to a multiple of ``step``."""
        for v in self.values():
            if v >= n:
                return v
        return -(-n // self.step) * self.step


@dataclass(frozen=True)
class HpuBuckets:
    prompt_bs: BucketRange
    prompt_len: BucketRange
    decode_bs: BucketRange
    decode_blocks: BucketRange

    @classmethod
    def from_limits(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                    block_size: int) -> HpuBuckets:
        max_blocks_per_seq = -(-max_model_len // block_size)
        bs_step = min(32, max_num_seqs)
        return cls(prompt_bs=BucketRange(1, bs_step, max_num_seqs),
                   prompt_len=BucketRange(block_size, block_size, max_model_len),
                   decode_bs=BucketRange(1, bs_step, max_num_seqs),
                   decode_blocks=BucketRange(1, 128, max(1, max_num_seqs * max_blocks_per_seq)))

    def prefill_shape(self, batch: int, max_len: int) -> tuple[int, int]:
        return self.prompt_bs.bucket(batch), self.prompt_len.bucket(max_len)

    def decode_shape(self, batch: int, num_blocks: int) -> tuple[int, int]:
        return self.decode_bs.bucket(batch), self.decode_blocks.bucket(num_blocks)

    def prefill_shapes(self, max_num_batched_tokens: int) -> list[tuple[int, int]]:
        """(batch, length) buckets some step within the token budget maps to: the smallest
        batch and prompt length landing in a bucket are one past the bucket below it."""
        def smallest(values: list[int]) -> list[tuple[int, int]]:
            return [(v, (values[i - 1] if i else 0) + 1) for i, v in enumerate(values)]

        return [(b, n) for b, min_b in smallest(self.prompt_bs.values())
                for n, min_n in smallest(self.prompt_len.values())
                if min_b * min_n <= max_num_batched_tokens]

    def decode_shapes(self, max_blocks_per_seq: int) -> list[tuple[int, int]]:
        """(batch, blocks) pairs a decode batch can produce: every sequence holds 1 to
        max_blocks_per_seq blocks."""
        return [(b, nb) for b in self.decode_bs.values() for nb in self.decode_blocks.values()
                if nb <= self.decode_blocks.bucket(b * max_blocks_per_seq)
                and 2 * nb >= b]
