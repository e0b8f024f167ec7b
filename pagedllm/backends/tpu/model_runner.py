"""The tpu model runner: pads each step to its bucket, runs it as two XLA programs, samples on
the host.

Program 1 is the KV writes of every layer and the layers themselves, keyed by (tokens, width);
program 2 is the LM head over the padded logit rows, keyed by (tokens, rows); each ends with
``torch_xla.sync()`` (the step boundary). Inputs are padded on the host (``prepare``) to the
step's ``StepShape``, so the traced graphs, and therefore the compiled programs, depend only on
the bucket. Logits come back to the host and the engine's sampler runs there: sampling has
data-dependent shapes (top-k/top-p, penalties, seeds) that would otherwise recompile.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedllm.backends.tpu.attention import XlaPagedAttention
from pagedllm.backends.tpu.buckets import BucketGrid, StepShape, next_power_of_two
from pagedllm.backends.tpu.layout import SeqRows
from pagedllm.core.batch import ScheduledBatch, ScheduledSeq
from pagedllm.worker.model_runner import ModelInput, ModelRunner, build_metadata, select_logit_rows
from pagedllm.worker.sampler import Sampler

logger = logging.getLogger(__name__)


class TpuModelRunner(ModelRunner):
    def __init__(self, model: nn.Module, block_size: int, device: torch.device, seed: int,
                 grid: BucketGrid, max_num_seqs: int) -> None:
        super().__init__(model, block_size, device, seed)
        self.sampler = Sampler(torch.device("cpu"), seed)
        self.grid = grid
        # the ragged kernel's per-sequence inputs have one fixed size (it skips pad sequences)
        self.kernel_seqs = next_power_of_two(max_num_seqs)
        self.shapes_run: set[StepShape] = set()

    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        seqs = batch.seqs
        rows, sample_rows, prompt_rows = select_logit_rows(seqs)
        seq_rows = SeqRows([s.num_tokens for s in seqs], [s.seq_len for s in seqs],
                           [s.block_table for s in seqs])
        shape = self.grid.shape_for(seq_rows.num_tokens, len(rows),
                                    seq_rows.blocks_needed(self.block_size))
        inp = self.padded_input(seqs, seq_rows, rows, shape)
        inp.sample_rows, inp.prompt_rows = sample_rows, prompt_rows
        return inp

    def padded_input(self, seqs: list, seq_rows: SeqRows, rows: list[int],
                     shape: StepShape) -> ModelInput:
        """Host lists -> device tensors of exactly ``shape`` (pad rows: token 0, position 0,
        slot -1, block-table row of zeros; pad logit rows read hidden row 0)."""
        cpu = torch.device("cpu")
        input_ids, positions, meta = build_metadata(seqs, self.block_size, cpu,
                                                    pad_tokens_to=shape.tokens)
        dev = self.device
        meta.slot_mapping = meta.slot_mapping.to(dev)
        meta.extras = {**XlaPagedAttention.static_inputs(seq_rows, shape.tokens, self.block_size,
                                                         dev, shape.width, self.kernel_seqs),
                       "bucket": shape}
        logit_rows = torch.zeros(shape.rows, dtype=torch.int64)
        logit_rows[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
        return ModelInput(input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev),
                          positions=torch.tensor(positions, dtype=torch.int64).to(dev),
                          metadata=meta, logit_rows=logit_rows.to(dev),
                          num_real_tokens=seq_rows.num_tokens)

    def run_model_program(self, inp: ModelInput, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Program 1, keyed by (tokens, width): the KV writes and the layers. Returns the final
        hidden states [tokens, hidden], left on the device.

        The caches are donated: XLA updates them in place instead of writing a copy of every
        layer's cache each step (the program's outputs alias its inputs).
        """
        import torch_xla

        for cache in kv_caches:
            torch_xla._XLAC._set_buffer_donation(cache, True)
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, inp.metadata)
        torch_xla.sync()
        return hidden

    def run_head_program(self, hidden: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """Program 2, keyed by (tokens, rows): the LM head over the selected rows. Logits
        [rows, vocab] float32 on the device."""
        import torch_xla

        logits = self.model.compute_logits(hidden[logit_rows])
        torch_xla.sync()
        return logits

    def forward(self, inp: ModelInput, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits of the real logit rows, [rows, vocab] float32, on the host."""
        real = len(inp.sample_rows) + sum(n for _, n, _ in inp.prompt_rows)
        return self._run_programs(inp, kv_caches, real)[1]

    def forward_rows(self, seqs: list[ScheduledSeq], rows: list[int],
                     kv_caches: list[torch.Tensor], extras: dict | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step with the caller's logit rows (speculative decoding: k + 1 rows per verified
        sequence), padded like any other: its rows take a row bucket (the grid's row buckets
        cover max_num_seqs * (1 + k) rows when speculating), its tokens and block-table width
        their buckets. (hidden [bucket tokens, hidden] on the device, logits [len(rows),
        vocab] float32 on the host, where the sampler and the rejection sampler run.)"""
        seq_rows = SeqRows([s.num_tokens for s in seqs], [s.seq_len for s in seqs],
                           [s.block_table for s in seqs])
        shape = self.grid.shape_for(seq_rows.num_tokens, len(rows),
                                    seq_rows.blocks_needed(self.block_size))
        inp = self.padded_input(seqs, seq_rows, rows, shape)
        # host-side values only (read while tracing): the traced graph stays the bucket's
        inp.metadata.extras.update(extras or {})
        return self._run_programs(inp, kv_caches, len(rows))

    def _run_programs(self, inp: ModelInput, kv_caches: list[torch.Tensor], real: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.run_model_program(inp, kv_caches)
        logits = self.run_head_program(hidden, inp.logit_rows)
        self.shapes_run.add(inp.metadata.extras["bucket"])
        # slice on the host: an XLA slice would be one more program
        return hidden, logits.cpu()[:real]

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[torch.Tensor]) -> float:
        """Compile (and run once) every program of the grid on pad-only inputs, which write
        nothing to the cache. Returns the seconds it took."""
        start = time.perf_counter()
        grid = self.grid
        rows_of: dict[int, list[int]] = {}
        for tokens, rows in grid.head_shapes():
            rows_of.setdefault(tokens, []).append(rows)
        for tokens in grid.token_buckets:
            hidden = None
            for width in grid.width_buckets:
                inp = self.padded_input([], SeqRows([], [], []), [],
                                        StepShape(tokens, grid.row_buckets[0], width))
                hidden = self.run_model_program(inp, kv_caches)
            for rows in rows_of.get(tokens, []):
                self.run_head_program(hidden, torch.zeros(rows, dtype=torch.int64).to(self.device))
            logger.debug("warm-up: %d-token programs compiled", tokens)
        return time.perf_counter() - start
