"""The hpu model runner: each step as padded prefill and decode sub-steps, samples on the host.

A step's prefills and decodes run as separate sub-steps, each padded to its bucket:

* prefill: prompts padded to one length L (bucketed) and the batch to B (bucketed): B*L rows,
  prompt i in rows i*L .. i*L+len-1; pad rows: token 0, position 0, slot -1;
* decode: B (bucketed) rows, one per sequence, with a flat block list padded to a bucketed
  number of blocks (flat_attention.py).

``habana.mark_step`` closes the lazy-mode graph after the model and after the LM head. Logits
of the real rows go to the host, where the engine's sampler runs (data-dependent shapes stay
off the device). Everything here is plain torch; on a CPU device the habana calls do nothing.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.backends.hpu import habana
from pagedllm.backends.hpu.buckets import HpuBuckets
from pagedllm.backends.hpu.flat_attention import flat_blocks
from pagedllm.core.batch import ScheduledBatch, ScheduledSeq, SeqOutput
from pagedllm.worker.model_runner import ModelInput, ModelRunner, build_metadata, select_logit_rows
from pagedllm.worker.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubStep:
    kind: str  # "prefill" or "decode"
    batch: int  # padded sequences
    size: int  # prefill: padded prompt length; decode: padded flat block count


def _pad_rows(rows: list[int], batch: int) -> torch.Tensor:
    """Logit rows padded (with row 0) to ``batch`` or, past it, to a power of two."""
    n = max(batch, 1 << max(0, len(rows) - 1).bit_length())
    out = torch.zeros(n, dtype=torch.int64)
    out[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
    return out


class HpuModelRunner(ModelRunner):
    def __init__(self, model: nn.Module, block_size: int, device: torch.device, seed: int,
                 buckets: HpuBuckets, graph_counters: Counter[str] | None = None) -> None:
        super().__init__(model, block_size, device, seed)
        self.sampler = Sampler(torch.device("cpu"), seed)
        self.buckets = buckets
        self.shapes_run: set[SubStep] = set()
        # when the model runs as an HPU graph (the worker passes its counters): an HPU graph is
        # recorded per input shape on its first run and replayed after, and every input shape is
        # a sub-step's bucket, so a bucket's first run is a capture and each later one a replay
        self.graph_counters = graph_counters

    # --- inputs --------------------------------------------------------------------------
    def prepare_prefill(self, seqs: list[ScheduledSeq]) -> ModelInput:
        q_lens = [s.num_tokens for s in seqs]
        b, length = self.buckets.prefill_shape(len(seqs), max(q_lens))
        packed_to_padded = [i * length + j for i, n in enumerate(q_lens) for j in range(n)]
        input_ids = torch.zeros(b * length, dtype=torch.int64)
        positions = torch.zeros(b * length, dtype=torch.int64)
        slots = torch.full((b * length,), -1, dtype=torch.int64)
        ids, pos, meta = build_metadata(seqs, self.block_size, torch.device("cpu"))
        where = torch.tensor(packed_to_padded, dtype=torch.int64)
        input_ids[where] = torch.tensor(ids, dtype=torch.int64)
        positions[where] = torch.tensor(pos, dtype=torch.int64)
        slots[where] = meta.slot_mapping
        rows, sample_rows, prompt_rows = select_logit_rows(seqs)
        lens = torch.zeros(b, dtype=torch.int64)
        lens[:len(seqs)] = torch.tensor(q_lens, dtype=torch.int64)
        meta.slot_mapping = slots.to(self.device)
        meta.extras = {"hpu": "prefill", "q_lens": lens.to(self.device),
                       "step": SubStep("prefill", b, length)}
        return ModelInput(input_ids=input_ids.to(self.device), positions=positions.to(self.device),
                          metadata=meta,
                          logit_rows=_pad_rows([packed_to_padded[r] for r in rows], b).to(
                              self.device),
                          sample_rows=sample_rows, prompt_rows=prompt_rows,
                          num_real_tokens=len(ids))

    def prepare_decode(self, seqs: list[ScheduledSeq]) -> ModelInput:
        seq_lens = [s.seq_len for s in seqs]
        used = sum(-(-n // self.block_size) for n in seq_lens)
        b, num_blocks = self.buckets.decode_shape(len(seqs), used)
        ids, pos, meta = build_metadata(seqs, self.block_size, torch.device("cpu"),
                                        pad_tokens_to=b)
        flat = flat_blocks(seq_lens, [s.block_table for s in seqs], self.block_size, num_blocks,
                           b)
        rows, sample_rows, prompt_rows = select_logit_rows(seqs)
        meta.slot_mapping = meta.slot_mapping.to(self.device)
        meta.extras = {"hpu": "decode", "flat": flat.to(self.device),
                       "step": SubStep("decode", b, num_blocks)}
        return ModelInput(input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device),
                          positions=torch.tensor(pos, dtype=torch.int64).to(self.device),
                          metadata=meta, logit_rows=_pad_rows(rows, b).to(self.device),
                          sample_rows=sample_rows, prompt_rows=prompt_rows,
                          num_real_tokens=len(seqs))

    # --- execution -----------------------------------------------------------------------
    def forward(self, inp: ModelInput, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits of the real logit rows, [rows, vocab] float32, on the host."""
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, inp.metadata)
        habana.mark_step(self.device)
        logits = self.model.compute_logits(hidden[inp.logit_rows])
        habana.mark_step(self.device)
        step = inp.metadata.extras["step"]
        if self.graph_counters is not None:
            self.graph_counters["graph_replays" if step in self.shapes_run
                                else "graph_captures"] += 1
        self.shapes_run.add(step)
        real = len(inp.sample_rows) + sum(n for _, n, _ in inp.prompt_rows)
        return logits.cpu()[:real]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv_caches: list[torch.Tensor]) -> list[SeqOutput]:
        """Prefill sub-step, then decode sub-step; outputs in the batch's order."""
        seqs = batch.seqs
        n_prefill = sum(1 for s in seqs if s.num_tokens > 1)  # prefills come first
        outputs: list[SeqOutput] = []
        for part, prepare in ((seqs[:n_prefill], self.prepare_prefill),
                              (seqs[n_prefill:], self.prepare_decode)):
            if part:
                sub = ScheduledBatch(seqs=part)
                inp = prepare(part)
                outputs.extend(self.sample(sub, inp, self.forward(inp, kv_caches)))
        return outputs

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[torch.Tensor], max_num_batched_tokens: int,
                max_blocks_per_seq: int) -> tuple[int, float]:
        """Run every prefill and decode bucket once on pad-only inputs (on Gaudi this compiles
        the lazy graphs and records the HPU graphs). Returns (buckets, seconds)."""
        start = time.perf_counter()
        steps = ([SubStep("prefill", b, n)
                  for b, n in self.buckets.prefill_shapes(max_num_batched_tokens)]
                 + [SubStep("decode", b, nb)
                    for b, nb in self.buckets.decode_shapes(max_blocks_per_seq)])
        for step in steps:
            self.forward(self.dummy_input(step), kv_caches)
        return len(steps), time.perf_counter() - start

    def dummy_input(self, step: SubStep) -> ModelInput:
        """A pad-only input of ``step``'s shape (writes only slot 0, before any block is used)."""
        rows = step.batch * step.size if step.kind == "prefill" else step.batch
        _, _, meta = build_metadata([], self.block_size, torch.device("cpu"), pad_tokens_to=rows)
        meta.slot_mapping = meta.slot_mapping.to(self.device)
        if step.kind == "prefill":
            meta.extras = {"hpu": "prefill", "step": step,
                           "q_lens": torch.zeros(step.batch, dtype=torch.int64).to(self.device)}
        else:
            meta.extras = {"hpu": "decode", "step": step,
                           "flat": flat_blocks([], [], self.block_size, step.size,
                                               step.batch).to(self.device)}
        zeros = torch.zeros(rows, dtype=torch.int64).to(self.device)
        return ModelInput(input_ids=zeros, positions=zeros, metadata=meta,
                          logit_rows=_pad_rows([], step.batch).to(self.device))
