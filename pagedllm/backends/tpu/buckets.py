"""Static step shapes for XLA: every step is padded to one of a few power-of-two buckets.

XLA compiles one program per input shape. A step's shape is (tokens, rows, width):

* ``tokens``: rows of the model input (prefill chunks and decodes together), padded with
  token 0 / position 0 / slot -1;
* ``rows``: hidden-state rows the LM head turns into logits (one per sampled sequence), padded
  by repeating row 0, whose logits are dropped; a step wanting more rows (prompt logprobs)
  takes all ``tokens`` rows;
* ``width``: block-table columns per token, padded with block 0, which attention never reads
  past a sequence's length.

A step runs as two programs: the model (KV writes + layers), keyed by (tokens, width), and the
LM head over the selected rows, keyed by (tokens, rows). So the grid compiles
``|tokens| * |widths| + |tokens| * |rows|`` programs, and only the first kind is heavy. Each
dimension takes powers of two between a floor and the smallest power of two that holds the
configured maximum; a single width (the full table) is used where attention cost does not grow
with it (the TPU kernel). Plain Python: no torch, no torch_xla.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 16  # XLA on TPU tiles rows by 8/16; smaller steps are padded up to this
MIN_ROWS = 8
MIN_WIDTH_TOKENS = 128  # the smallest block-table bucket covers at least this many tokens


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two from next_power_of_two(low) up to next_power_of_two(high), inclusive."""
    low, high = next_power_of_two(low), next_power_of_two(max(low, high))
    out = []
    while low <= high:
        out.append(low)
        low *= 2
    return out


@dataclass(frozen=True, order=True)
class StepShape:
    """The padded shape of one step: it runs the model program of (tokens, width) and the
    LM-head program of (tokens, rows)."""

    tokens: int
    rows: int
    width: int


@dataclass(frozen=True)
class BucketGrid:
    token_buckets: tuple[int, ...]
    row_buckets: tuple[int, ...]
    width_buckets: tuple[int, ...]

    @classmethod
    def from_limits(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                    block_size: int, bucket_width: bool = True,
                    rows_per_seq: int = 1) -> BucketGrid:
        """The grid for a scheduler that sends at most ``max_num_batched_tokens`` tokens and
        ``max_num_seqs`` sequences per step, each at most ``max_model_len`` tokens long and
        sampled at up to ``rows_per_seq`` rows (speculative decoding verifies 1 + k).
        ``bucket_width=False``: one width, the full block table."""
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("block_size", block_size), ("rows_per_seq", rows_per_seq)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1 to build static-shape buckets")
        max_width = -(-max_model_len // block_size)
        min_width = min(max(1, MIN_WIDTH_TOKENS // block_size), next_power_of_two(max_width))
        widths = powers_of_two(min_width if bucket_width else max_width, max_width)
        max_rows = min(max_num_seqs * rows_per_seq, max_num_batched_tokens)
        return cls(token_buckets=tuple(powers_of_two(MIN_TOKENS, max(max_num_batched_tokens,
                                                                     MIN_TOKENS))),
                   row_buckets=tuple(powers_of_two(min(MIN_ROWS, next_power_of_two(max_rows)),
                                                   max_rows)),
                   width_buckets=tuple(widths))

    @staticmethod
    def _pick(buckets: tuple[int, ...], n: int) -> int:
        for b in buckets:
            if b >= n:
                return b
        # past the grid (a caller that ignores the scheduler's limits): still a power of two,
        # compiled on first use
        return next_power_of_two(n)

    def shape_for(self, num_tokens: int, num_rows: int, width: int) -> StepShape:
        """The bucket of a step with these real sizes. More logit rows than the largest row
        bucket (prompt logprobs) take the LM head over every token row."""
        tokens = self._pick(self.token_buckets, num_tokens)
        rows = (self._pick(self.row_buckets, max(1, num_rows))
                if num_rows <= self.row_buckets[-1] else tokens)
        return StepShape(tokens, min(rows, tokens),
                         self._pick(self.width_buckets, max(1, width)))

    def model_shapes(self) -> list[tuple[int, int]]:
        """(tokens, width) of every model program."""
        return [(t, w) for t in self.token_buckets for w in self.width_buckets]

    def head_shapes(self) -> list[tuple[int, int]]:
        """(tokens, rows) of every LM-head program: each row bucket, and all rows (prompt
        logprobs); rows never exceed tokens."""
        return sorted({(t, min(r, t)) for t in self.token_buckets
                       for r in (*self.row_buckets, t)})

    @property
    def num_programs(self) -> int:
        return len(self.model_shapes()) + len(self.head_shapes())

    def describe(self) -> str:
        return (f"tokens {list(self.token_buckets)} x block-table width "
                f"{list(self.width_buckets)} model programs + tokens x rows "
                f"{list(self.row_buckets)} LM-head programs = {self.num_programs} programs")
