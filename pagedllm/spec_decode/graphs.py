"""Static-shape target steps for speculative decoding, replayed from captured graphs.

A step whose sequences are all decoding runs as ``size`` sequences x ``q`` query rows: q = 1
when none carries drafts (plain decode rows), q = k + 1 when some do (verification chunks; a
sequence with fewer drafts, or none, is padded to q rows). Every row runs the attention's
decode path: row j of a sequence is a decode of length ``position + 1`` over the sequence's
block table, and the step's KV is written before attention reads the cache, so each row sees
its context and the rows before it (causal) with the decode kernel's split over the context
(the prefill kernel runs one program per sequence and head: a handful at batch 1). A pad row
writes no KV (slot -1) and comes after its sequence's real rows, which therefore never read
it; a padded sequence (rows past the step's B up to the captured ``size``) has no context. The
forward writes the hidden states, the logits of every row and, for an EAGLE-3 head, the
target's auxiliary states into buffers shared by all graphs; a step gathers its real rows back
into the packed layout ``SpecRunner`` uses.

Without graphs (``graphs`` empty) the same static forward runs eagerly on any backend (the
layout's tests on the cpu); the cuda worker captures one CUDA graph per (size, q, context
bucket) into ``graphs`` (backends/cuda/spec_graphs.py).
"""
from __future__ import annotations

import bisect
import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.core.batch import ScheduledSeq
from pagedllm.worker.host_copy import can_pin

logger = logging.getLogger(__name__)

# verification graphs are captured up to this batch size (the guard turns speculation off well
# below it on every measured machine; larger verification steps run eagerly)
MAX_VERIFY_GRAPH_BATCH = 128


class SpecStepGraphs:
    """The target's forward for decode-only speculative steps, on static buffers.

    ``sizes``: batch sizes with plain-decode (q = 1) graphs; ``verify_sizes``: with
    verification (q = k + 1) graphs; ``context_lens``: context buckets of both (the decode
    kernel's launch follows the bucket). ``aux``: an EAGLE-3 head's ``AuxHiddenStates`` (its
    hooks fire while capturing; a replay restores its states from the shared buffers)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, k: int, sizes: list[int], verify_sizes: list[int],
                 device: torch.device, context_lens: list[int] | None = None,
                 aux: Any = None) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        self.model, self.kv_caches, self.aux = model, kv_caches, aux
        self.block_size, self.max_model_len, self.q = block_size, max_model_len, k + 1
        self.sizes, self.verify_sizes = sorted(sizes), sorted(verify_sizes)
        self.context_lens = sorted(context_lens or [max_model_len])
        self.device = device
        # (size, q, context bucket) -> a captured graph (anything with ``replay()``); empty:
        # every step runs ``forward_static`` eagerly
        self.graphs: dict[tuple[int, int, int], Any] = {}
        self.steps: Counter[int] = Counter()  # static steps run, by q
        max_b = max(self.sizes[-1:] + self.verify_sizes[-1:])
        self.max_rows = max(self.sizes[-1:] + [b * self.q for b in self.verify_sizes[-1:]])
        self.width = -(-max_model_len // block_size)
        m = self.max_rows
        # int64 rows: ids | positions | slots | gather (real rows in the packed order) | logit
        # rows (the caller's rows); int32: seq lens | block tables [max_b, width] (row-major:
        # a step of B sequences copies the first B * width entries)
        self._rows64 = torch.zeros(5 * m, dtype=torch.int64, device=device)
        self._seq32 = torch.zeros(max_b + max_b * self.width, dtype=torch.int32, device=device)
        self.input_ids, self.positions = self._rows64[:m], self._rows64[m:2 * m]
        self.slots, self.gather = self._rows64[2 * m:3 * m], self._rows64[3 * m:4 * m]
        self.logit_rows = self._rows64[4 * m:]
        self.seq_lens = self._seq32[:max_b]
        self.block_tables = self._seq32[max_b:].view(max_b, self.width)
        # verification rows: each row's length and its sequence's table (filled in the graph)
        rows = max([b * self.q for b in self.verify_sizes[-1:]], default=0)
        self.row_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.row_tables = torch.zeros((rows, self.width), dtype=torch.int32, device=device)
        self._no_prefills = torch.zeros(1, dtype=torch.int32, device=device)  # query_start_loc
        pin = device.type != "cpu" and can_pin()
        self._host64 = torch.zeros(5 * m, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros_like(self._seq32, device="cpu", pin_memory=pin)
        self.hidden: torch.Tensor | None = None  # [max_rows, H]
        self.logits: torch.Tensor | None = None  # [max_rows, vocab]
        self.aux_out: dict[int, torch.Tensor] = {}
        # this step's real rows are the leading static rows, in order (no gather needed)
        self._gather_is_leading = self._rows_are_leading = False

    # --- which steps ---------------------------------------------------------------------------
    def query_len(self, seqs: list[ScheduledSeq]) -> int | None:
        """q for a step of ``seqs`` that has a static shape here, else None (it runs eagerly):
        every sequence decoding (one token, or one plus its drafts), sampling, no prompt
        logprobs, and a captured size that holds the batch."""
        if not seqs or any(s.num_samples < 1 or s.prompt_logprob_targets for s in seqs):
            return None
        if all(s.num_tokens == 1 and not s.num_spec_tokens for s in seqs):
            fits = (len(seqs) <= self.sizes[-1]
                    and max(s.seq_len for s in seqs) <= self.context_lens[-1])
            return 1 if fits else None
        if (self.verify_sizes and len(seqs) <= self.verify_sizes[-1]
                and all(s.num_tokens == s.num_spec_tokens + 1 <= self.q for s in seqs)):
            return self.q
        return None

    # --- one step ------------------------------------------------------------------------------
    def forward_rows(self, seqs: list[ScheduledSeq], rows: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden [sum num_tokens, H] packed, logits [len(rows), vocab]) as
        ``ModelRunner.forward_rows`` returns them, or None when this step has no static shape.
        Valid for work queued before the next step (stream order)."""
        q = self.query_len(seqs)
        if q is None:
            return None
        sizes = self.sizes if q == 1 else self.verify_sizes
        size = sizes[bisect.bisect_left(sizes, len(seqs))]
        # the longest row: a sequence's last, or its last pad row
        longest = min(max(s.seq_len if q == 1 else s.start_pos + q for s in seqs),
                      self.max_model_len)
        bucket = self.context_lens[bisect.bisect_left(self.context_lens, longest)]
        if self.graphs and (size, q, bucket) not in self.graphs:
            return None  # its capture failed (logged): eager
        real = self._fill(seqs, rows, size, q)
        if self.graphs:
            self.graphs[size, q, bucket].replay()
        else:
            self.forward_static(size, q, bucket)
        self.steps[q] += 1
        assert self.hidden is not None and self.logits is not None
        if self.aux is not None:
            self.aux.states = {i: (t[:real] if self._gather_is_leading
                                   else t.index_select(0, self.gather[:real]))
                               for i, t in self.aux_out.items()}
        hidden = (self.hidden[:real] if self._gather_is_leading
                  else self.hidden.index_select(0, self.gather[:real]))
        logits = (self.logits[:len(rows)] if self._rows_are_leading
                  else self.logits.index_select(0, self.logit_rows[:len(rows)]))
        return hidden, logits

    def _fill(self, seqs: list[ScheduledSeq], rows: list[int], size: int, q: int) -> int:
        """Writes the step into the static buffers (one host-to-device copy per dtype, plus
        the block tables' rows); returns the number of real rows."""
        m, bs, last = self.max_rows, self.block_size, self.max_model_len - 1
        ids, pos, slots, gather = [0] * (size * q), [0] * (size * q), [-1] * (size * q), []
        seq_lens = [1] * size
        for i, s in enumerate(seqs):
            table, base = s.block_table, i * q
            for j, (t, p) in enumerate(zip(s.token_ids, range(s.start_pos, s.seq_len))):
                ids[base + j], pos[base + j] = t, p
                slots[base + j] = table[p // bs] * bs + p % bs
                gather.append(base + j)
            for j in range(s.num_tokens, q):  # pad rows: after the real ones, no KV written
                pos[base + j] = min(s.seq_len + j - s.num_tokens, last)
            seq_lens[i] = s.seq_len
        h64, n = self._host64, size * q
        for part, values in enumerate((ids, pos, slots)):
            h64[part * m:part * m + n] = torch.tensor(values, dtype=torch.int64)
        h64[3 * m:3 * m + len(gather)] = torch.tensor(gather, dtype=torch.int64)
        logit_rows = [gather[r] for r in rows]
        h64[4 * m:4 * m + len(rows)] = torch.tensor(logit_rows, dtype=torch.int64)
        # the common steps (every sequence with all k drafts, or plain decodes) need no gather
        self._gather_is_leading = gather == list(range(len(gather)))
        self._rows_are_leading = logit_rows == list(range(len(logit_rows)))
        h32, max_b = self._host32, self.seq_lens.shape[0]
        h32[:size] = torch.tensor(seq_lens, dtype=torch.int32)
        tables = h32[max_b:].view(max_b, self.width)
        tables[:size].zero_()
        for i, s in enumerate(seqs):  # blocks past the model length (lookahead) are never read
            table = s.block_table[:self.width]
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        # the host buffers are reused next step: the runner reads this step's samples on the
        # host before it builds the next one, so these copies have run by then
        self._rows64.copy_(h64, non_blocking=True)
        self._seq32[:max_b + size * self.width].copy_(h32[:max_b + size * self.width],
                                                      non_blocking=True)
        return len(gather)

    # --- the static forward and its capture ---------------------------------------------------
    def _metadata(self, size: int, q: int, bucket: int) -> AttentionMetadata:
        """Every row a decode (the per-step lengths on the device only: host copies would be
        frozen into a graph). Verification rows take their sequence's table and a length of
        their position + 1, made here (captured with the forward)."""
        n = size * q
        if q == 1:
            lens, tables = self.seq_lens[:size], self.block_tables[:size]
        else:
            lens, tables = self.row_lens[:n], self.row_tables[:n]
            tables.view(size, q, self.width).copy_(
                self.block_tables[:size, None, :].expand(size, q, self.width))
            lens.copy_(self.positions[:n] + 1)
        empty = self.seq_lens[:0]
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=n,
            slot_mapping=self.slots[:n], block_size=self.block_size,
            query_start_loc=self._no_prefills,
            prefill_seq_lens=empty, prefill_context_lens=empty,
            prefill_block_tables=self.block_tables[:0], max_prefill_query_len=0,
            max_prefill_seq_len=0, decode_seq_lens=lens, decode_block_tables=tables,
            max_decode_seq_len=bucket, extras={"graph_max_seq_len": bucket})

    def forward_static(self, size: int, q: int, bucket: int) -> None:
        """The forward of a (size, q, bucket) step over the static buffers into the shared
        outputs: what a graph captures."""
        n = size * q
        if self.aux is not None:
            self.aux.begin()
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv_caches,
                            self._metadata(size, q, bucket))
        if self.hidden is None:  # the first (largest) forward sizes the shared outputs
            self.hidden = torch.empty((self.max_rows, hidden.shape[-1]), dtype=hidden.dtype,
                                      device=hidden.device)
        self.hidden[:n].copy_(hidden)
        if self.logits is None:
            first = self.model.compute_logits(hidden[:1])
            self.logits = torch.empty((self.max_rows, first.shape[-1]), dtype=first.dtype,
                                      device=first.device)
        self.model.compute_logits(hidden, self.logits[:n])
        if self.aux is not None:
            for i, state in self.aux.states.items():
                if i not in self.aux_out:
                    self.aux_out[i] = torch.empty((self.max_rows, state.shape[-1]),
                                                  dtype=state.dtype, device=state.device)
                self.aux_out[i][:n].copy_(state)

    def keys(self) -> list[tuple[int, int, int]]:
        """Every (size, q, bucket), largest first (smaller graphs reuse the largest's pool)."""
        keys = [(b, 1, c) for b in self.sizes for c in self.context_lens]
        keys += [(b, self.q, c) for b in self.verify_sizes for c in self.context_lens]
        return sorted(keys, key=lambda key: (key[0] * key[1], key[2]), reverse=True)
