"""The model runner's step metadata: positions and KV slots of every scheduled token."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.core.batch import ScheduledSeq
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import build_metadata


def _seq(rng: random.Random, seq_id: int, start: int, num_tokens: int,
         block_size: int) -> ScheduledSeq:
    blocks = -(-(start + num_tokens) // block_size)
    table = rng.sample(range(1000), blocks)  # scattered physical blocks
    return ScheduledSeq(seq_id=seq_id, token_ids=[rng.randrange(500) for _ in range(num_tokens)],
                        start_pos=start, block_table=table, sampling_params=SamplingParams(),
                        num_samples=1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_positions_and_slots_of_chunks_and_decodes(block_size: int) -> None:
    rng = random.Random(block_size)
    chunks = [_seq(rng, i, rng.randrange(0, 40), rng.randrange(2, 50), block_size)
              for i in range(6)]
    chunks.append(_seq(rng, 6, 3 * block_size, 2 * block_size, block_size))  # block-aligned
    decodes = [_seq(rng, 10 + i, rng.randrange(0, 60), 1, block_size) for i in range(5)]
    seqs = chunks + decodes
    ids, positions, meta = build_metadata(seqs, block_size, torch.device("cpu"), pad_tokens_to=400)
    want_pos = [p for s in seqs for p in range(s.start_pos, s.seq_len)]
    want_slots = [s.block_table[p // block_size] * block_size + p % block_size
                  for s in seqs for p in range(s.start_pos, s.seq_len)]
    pad = 400 - len(want_pos)
    assert ids == [t for s in seqs for t in s.token_ids] + [0] * pad
    assert positions == want_pos + [0] * pad
    assert meta.slot_mapping.tolist() == want_slots + [-1] * pad
    assert meta.num_prefills == len(chunks) and meta.num_decode_tokens == len(decodes)
    assert meta.query_start_loc.tolist()[-1] == sum(s.num_tokens for s in chunks)
