"""Turns a ScheduledBatch into tensors, runs the model, and samples."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.core.batch import PENDING_TOKEN, ScheduledBatch, ScheduledSeq, SeqOutput
from pagedllm.distributed.parallel_state import PPGroup
from pagedllm.worker.host_copy import to_device
from pagedllm.worker.logits_controls import ApplyTokenBitmask
from pagedllm.worker.pending import PendingOutputs
from pagedllm.worker.sampler import GreedyLogprobs, Sampler, SampleRow

BUSY_HISTORY = 100_000  # steps of a stage's timeline kept


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    # rows of the hidden states whose logits are needed: sampling rows, then prompt-logprob rows
    logit_rows: torch.Tensor
    sample_rows: list[tuple[int, SampleRow]] = field(default_factory=list)  # (batch index, row)
    prompt_rows: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (idx, n, targets)
    num_real_tokens: int = 0


def _pad_table(tables: list[list[int]], width: int | None = None) -> list[list[int]]:
    width = width if width is not None else max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]


def build_metadata(seqs: list[ScheduledSeq], block_size: int, device: torch.device,
                   pad_tokens_to: int = 0) -> tuple[list[int], list[int], AttentionMetadata]:
    """Token ids, positions and attention metadata for ``seqs`` (multi-token chunks first)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in seqs:
        input_ids.extend(s.token_ids)
        table = s.block_table
        for p in range(s.start_pos, s.seq_len):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    prefills = [s for s in seqs if s.num_tokens > 1]
    decodes = seqs[len(prefills):]
    if any(s.num_tokens != 1 for s in decodes):
        raise ValueError("batch order: multi-token chunks must precede single-token ones")
    pad = max(0, pad_tokens_to - len(input_ids))
    input_ids += [0] * pad
    positions += [0] * pad
    slots += [-1] * pad

    def t(x: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return to_device(x, device, dtype)

    q_lens = [s.num_tokens for s in prefills]
    q_start = [0]
    for n in q_lens:
        q_start.append(q_start[-1] + n)
    p_seq = [s.seq_len for s in prefills]
    p_ctx = [s.start_pos for s in prefills]
    d_seq = [s.seq_len for s in decodes]
    meta = AttentionMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=q_start[-1],
        num_decode_tokens=len(decodes),
        slot_mapping=t(slots, torch.int64),
        block_size=block_size,
        query_start_loc=t(q_start),
        prefill_seq_lens=t(p_seq),
        prefill_context_lens=t(p_ctx),
        prefill_block_tables=t(_pad_table([s.block_table for s in prefills])),
        max_prefill_query_len=max(q_lens, default=0),
        max_prefill_seq_len=max(p_seq, default=0),
        decode_seq_lens=t(d_seq),
        decode_block_tables=t(_pad_table([s.block_table for s in decodes])),
        max_decode_seq_len=max(d_seq, default=0),
        prefill_query_lens_list=q_lens,
        prefill_seq_lens_list=p_seq,
        prefill_context_lens_list=p_ctx,
        decode_seq_lens_list=d_seq,
    )
    return input_ids, positions, meta


def select_logit_rows(seqs: list[ScheduledSeq]) -> tuple[list[int], list[tuple[int, SampleRow]],
                                                        list[tuple[int, int, list[int]]]]:
    """(hidden-state rows needing logits, sample rows, prompt-logprob rows) for ``seqs``:
    each sampling sequence's last row first, then every prompt-logprob row."""
    rows: list[int] = []
    sample_rows: list[tuple[int, SampleRow]] = []
    prompt_rows: list[tuple[int, int, list[int]]] = []
    offset = 0
    for i, s in enumerate(seqs):
        if s.num_samples > 0:
            rows.append(offset + s.num_tokens - 1)
            sample_rows.append((i, SampleRow(s.sampling_params, s.num_samples, s.seq_index,
                                             s.seq_len - s.prompt_len, s.history,
                                             s.prompt_len)))
        offset += s.num_tokens
    offset = 0
    for i, s in enumerate(seqs):
        if s.prompt_logprob_targets:
            n = len(s.prompt_logprob_targets)
            rows.extend(range(offset, offset + n))
            prompt_rows.append((i, n, s.prompt_logprob_targets))
        offset += s.num_tokens
    return rows, sample_rows, prompt_rows


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device, seed: int,
                 greedy_logprobs: GreedyLogprobs | None = None,
                 apply_token_bitmask: ApplyTokenBitmask | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed, greedy_logprobs, apply_token_bitmask)
        # the last sampled step's draws [num_draws] on the device, and seq_id -> its draw
        self._last_draws: tuple[torch.Tensor, dict[int, int]] | None = None
        # a pipeline stage's recent steps as (start, end) on the host's monotonic clock, the
        # wait for the previous stage left out (benchmarks/pp_timeline.py reads them)
        self.busy: deque[tuple[float, float]] = deque(maxlen=BUSY_HISTORY)

    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        input_ids, positions, meta = build_metadata(batch.seqs, self.block_size, self.device)
        rows, sample_rows, prompt_rows = select_logit_rows(batch.seqs)
        return ModelInput(
            input_ids=self._input_ids(batch, input_ids),
            positions=to_device(positions, self.device, torch.int64),
            metadata=meta,
            logit_rows=to_device(rows, self.device, torch.int64),
            sample_rows=sample_rows,
            prompt_rows=prompt_rows,
            num_real_tokens=len(input_ids),
        )

    def _input_ids(self, batch: ScheduledBatch, input_ids: list[int]) -> torch.Tensor:
        """[num_tokens] int64 on the device; PENDING_TOKEN entries (a decode's input that the
        previous step sampled) are taken from that step's device-side draws."""
        ids = to_device(input_ids, self.device, torch.int64)
        if PENDING_TOKEN not in input_ids:
            return ids
        if self._last_draws is None:
            raise RuntimeError("a scheduled token is pending but no step was sampled before it")
        draws, row_of = self._last_draws
        try:
            rows = [row_of[s.seq_id] if s.token_ids[0] == PENDING_TOKEN else 0 for s in batch.seqs
                    for _ in range(s.num_tokens)]
        except KeyError as exc:
            raise RuntimeError(f"sequence {exc} has a pending token that the previous step did "
                               f"not sample") from None
        from_draws = draws[to_device(rows, self.device, torch.int64)]
        return torch.where(ids == PENDING_TOKEN, from_draws, ids)

    def forward(self, inp: ModelInput, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] float32."""
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, inp.metadata)
        return self.model.compute_logits(hidden[inp.logit_rows])

    def forward_rows(self, seqs: list[ScheduledSeq], rows: list[int],
                     kv_caches: list[torch.Tensor], extras: dict | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs ``seqs`` (multi-token chunks first) with logits for the caller's hidden-state
        ``rows`` (speculative decoding verifies k + 1 rows of a sequence); ``extras`` join the
        attention metadata's. Returns (hidden states [>= num tokens, hidden] on the device,
        logits [len(rows), vocab] float32 on ``self.sampler``'s device). A static-shape
        runner overrides this to pad the step to its buckets (rows past the real tokens are
        padding)."""
        ids, positions, meta = build_metadata(seqs, self.block_size, self.device)
        meta.extras.update(extras or {})
        hidden = self.model(to_device(ids, self.device, torch.int64),
                            to_device(positions, self.device, torch.int64), kv_caches, meta)
        return hidden, self.model.compute_logits(hidden[to_device(rows, self.device, torch.int64)])

    def sample(self, batch: ScheduledBatch, inp: ModelInput, logits: torch.Tensor) -> list[SeqOutput]:
        return self.sample_async(batch, inp, logits).result()

    def sample_async(self, batch: ScheduledBatch, inp: ModelInput,
                     logits: torch.Tensor) -> PendingOutputs:
        """Queues sampling; remembers the device-side draws for a next step's pending inputs."""
        outputs = [SeqOutput(s.seq_id, []) for s in batch.seqs]
        n_sample = len(inp.sample_rows)
        pending = None
        if n_sample:
            bitmask = None
            if batch.token_bitmask is not None:  # guided rows: the sampled sequences' rows
                rows = [i for i, _ in inp.sample_rows]
                bitmask = batch.token_bitmask[rows].to(self.device, non_blocking=True)
            pending = self.sampler.sample_async(logits[:n_sample], [r for _, r in inp.sample_rows],
                                                bitmask)
            row_of: dict[int, int] = {}
            draw = 0
            for i, r in inp.sample_rows:  # a sequence's first draw continues it
                row_of[batch.seqs[i].seq_id] = draw
                draw += r.num_samples
            self._last_draws = (pending.tokens, row_of)
        row = n_sample
        for i, n, targets in inp.prompt_rows:
            k = batch.seqs[i].sampling_params.prompt_logprobs or 0
            outputs[i].prompt_logprobs = prompt_logprobs(logits[row:row + n], targets, k)
            row += n
        return PendingOutputs(outputs, [i for i, _ in inp.sample_rows], pending)

    @torch.inference_mode()
    def execute_stage(self, batch: ScheduledBatch, kv_caches: list[torch.Tensor],
                      pp: PPGroup) -> list[SeqOutput] | None:
        """One pipeline stage's share of the step: receive the previous stage's activations
        (unless first), run this stage's layers, then send them on, or (last stage) compute the
        logits and sample. ``kv_caches`` are this stage's layers' caches."""
        start = time.monotonic()
        inp = self.prepare(batch)
        intermediate = None
        if not pp.is_first:
            dtype = next(self.model.parameters()).dtype
            buffers = self.model.make_empty_intermediate_tensors(inp.num_real_tokens, dtype,
                                                                 self.device)
            idle = time.monotonic()
            intermediate = pp.recv(buffers)
            start += time.monotonic() - idle  # waiting for the previous stage is not work
        out = self.model(inp.input_ids, inp.positions, kv_caches, inp.metadata, intermediate)
        if not pp.is_last:
            pp.send(out)
            self.busy.append((start, time.monotonic()))
            return None
        outputs = self.sample(batch, inp, self.model.compute_logits(out[inp.logit_rows]))
        self.busy.append((start, time.monotonic()))
        return outputs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv_caches: list[torch.Tensor]) -> list[SeqOutput]:
        return self.execute_async(batch, kv_caches).result()

    @torch.inference_mode()
    def execute_async(self, batch: ScheduledBatch, kv_caches: list[torch.Tensor]) -> PendingOutputs:
        inp = self.prepare(batch)
        logits = self.forward(inp, kv_caches)
        return self.sample_async(batch, inp, logits)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """{token: logprob} per position: the actual next prompt token plus the top k."""
    lp = torch.log_softmax(logits, dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
    top = lp.topk(k, dim=-1) if k > 0 else None
    result = []
    for j, t in enumerate(targets):
        entry = {t: chosen[j]}
        if top is not None:
            for tok, v in zip(top.indices[j].tolist(), top.values[j].tolist()):
                entry.setdefault(tok, v)
        result.append(entry)
    return result
