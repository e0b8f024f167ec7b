"""toyaccel worker: static shapes by bucketing, KV cache sized from a fixed device arena.

A compiler-driven accelerator builds one program per input shape, so every step is padded to
the next power-of-two token count (at least ``MIN_BUCKET``): a handful of shapes instead of one
per batch. Pad rows get token 0, position 0 and slot -1; ``write_kv`` skips slot -1, the
attention template returns zeros for rows past the real tokens, and only real rows are sampled.
A real port would also pad the number of sequences and the block-table width, and compile every
bucket in ``after_cache_init`` (warm-up) so no request pays for compilation.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.worker.model_runner import ModelInput
from pagedllm.worker.worker import GiB, Worker

MIN_BUCKET = 16
ARENA_ENV = "TOYACCEL_MEMORY_GIB"
DEFAULT_ARENA_GIB = 1.0


def bucket_for(num_tokens: int) -> int:
    """The smallest power of two >= num_tokens (and >= MIN_BUCKET)."""
    return max(MIN_BUCKET, 1 << max(0, num_tokens - 1).bit_length())


def pad_to_bucket(inp: ModelInput) -> ModelInput:
    """``inp`` with input_ids/positions/slot_mapping padded to ``bucket_for(num_tokens)`` rows."""
    n = inp.input_ids.shape[0]
    extra = bucket_for(n) - n
    if extra == 0:
        return inp
    zeros = inp.input_ids.new_zeros(extra)
    meta = inp.metadata
    meta = dataclasses.replace(
        meta, slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((extra,), -1)]),
        extras={**meta.extras, "bucket": n + extra})
    return dataclasses.replace(inp, input_ids=torch.cat([inp.input_ids, zeros]),
                               positions=torch.cat([inp.positions, zeros]), metadata=meta)


class ToyAccelWorker(Worker):
    def available_kv_bytes(self) -> int:
        """The arena (TOYACCEL_MEMORY_GIB, default 1 GiB) minus the weights; an explicit
        kv_cache_space_gib wins."""
        if self.config.cache.kv_cache_space_gib is not None:
            return super().available_kv_bytes()
        arena = int(float(os.environ.get(ARENA_ENV, DEFAULT_ARENA_GIB)) * GiB)
        assert self.model is not None
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return max(0, arena - weights)

    def run_model(self, batch: ScheduledBatch) -> list[SeqOutput]:
        assert self.runner is not None
        inp = pad_to_bucket(self.runner.prepare(batch))
        logits = self.runner.forward(inp, self.kv_caches)  # logit_rows index real rows only
        return self.runner.sample(batch, inp, logits)
