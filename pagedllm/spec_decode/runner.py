"""Runs one step of a batch that may hold verification chunks: the target's forward, the plain
rows through the sampler and the verification chunks (k + 1 rows each) through the rejection
sampler, then the device proposer mirrors the step and drafts for the next one."""
from __future__ import annotations

import time
from typing import Any

import torch

from pagedllm.core.batch import ScheduledBatch, ScheduledSeq, SeqOutput
from pagedllm.spec_decode.graphs import SpecStepGraphs
from pagedllm.spec_decode.proposer import DeviceProposer, MirrorSeq
from pagedllm.spec_decode.sampler import VerifyRow, VerifySampler
from pagedllm.worker.host_copy import select_rows
from pagedllm.worker.model_runner import ModelRunner, prompt_logprobs
from pagedllm.worker.sampler import SampleRow


def _sample_row(s: ScheduledSeq) -> SampleRow:
    """The plain decode row of ``s`` (for a verification chunk: before its drafts)."""
    return SampleRow(s.sampling_params, s.num_samples, s.seq_index,
                     s.seq_len - s.num_spec_tokens - s.prompt_len, s.history, s.prompt_len)


class SpecRunner:
    """Runs one step of a batch that may hold verification chunks."""

    def __init__(self, runner: ModelRunner, rejection_sample: Any,
                 proposer: DeviceProposer | None) -> None:
        self.runner = runner
        self.verify = VerifySampler(runner.sampler, rejection_sample)
        self.proposer = proposer
        # decode-only steps on static buffers (a backend's captured graphs); None: all eager
        self.graphs: SpecStepGraphs | None = None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv_caches: list[torch.Tensor]) -> list[SeqOutput]:
        runner, seqs = self.runner, batch.seqs
        rows: list[int] = []  # hidden-state rows needing logits
        plain: list[tuple[int, int, SampleRow]] = []  # (batch index, logits row, row)
        verify: list[tuple[int, int, VerifyRow]] = []  # (batch index, first logits row, row)
        offsets: list[int] = []
        offset = 0
        for i, s in enumerate(seqs):
            offsets.append(offset)
            if s.num_samples > 0:
                m = s.num_spec_tokens
                row = _sample_row(s)
                if m:
                    verify.append((i, len(rows), VerifyRow(row, s.token_ids[-m:])))
                    rows.extend(range(offset + s.num_tokens - 1 - m, offset + s.num_tokens))
                else:
                    plain.append((i, len(rows), row))
                    rows.append(offset + s.num_tokens - 1)
            offset += s.num_tokens
        prompt_rows = []
        for i, s in enumerate(seqs):
            if s.prompt_logprob_targets:
                n = len(s.prompt_logprob_targets)
                prompt_rows.append((i, len(rows), n, s.prompt_logprob_targets))
                rows.extend(range(offsets[i], offsets[i] + n))
        if self.proposer is not None and hasattr(self.proposer, "begin_target_forward"):
            self.proposer.begin_target_forward()
        # verification chunks are multi-token chunks, so they lie among the prefills, which
        # come first: their batch indices are their prefill indices
        verify_prefills = frozenset(i for i, s in enumerate(seqs)
                                    if s.num_spec_tokens and s.num_tokens > 1)
        hidden, logits = self.forward_rows(seqs, rows, kv_caches,
                                           {"verify_prefills": verify_prefills})
        device = logits.device  # where the runner's sampler works (the host, on tpu)
        outputs = [SeqOutput(s.seq_id, []) for s in seqs]
        if plain:
            bitmask = None
            if batch.token_bitmask is not None:
                mask = batch.token_bitmask
                mask = mask.result() if hasattr(mask, "result") else mask
                bitmask = mask[[i for i, _, _ in plain]].to(device, non_blocking=True)
            got = runner.sampler(select_rows(logits, [r for _, r, _ in plain]),
                                 [row for _, _, row in plain], bitmask)
            for (i, _, _), samples in zip(plain, got):
                outputs[i].samples = samples
        if verify:
            sel = [r0 + j for _, r0, v in verify for j in range(len(v.drafts) + 1)]
            got = self.verify(select_rows(logits, sel), [v for _, _, v in verify])
            for (i, _, _), samples in zip(verify, got):
                outputs[i].samples = samples
        for i, r0, n, targets in prompt_rows:
            k = seqs[i].sampling_params.prompt_logprobs or 0
            outputs[i].prompt_logprobs = prompt_logprobs(logits[r0:r0 + n], targets, k)
        if self.proposer is not None:
            start = time.perf_counter()
            self.proposer.forget(batch.finished_seq_ids)
            self._propose(seqs, offsets, outputs, hidden)
            if outputs:  # host time: on an asynchronous device, what the launches took
                outputs[0].proposer_s = time.perf_counter() - start
        return outputs

    def forward_rows(self, seqs: list[ScheduledSeq], rows: list[int],
                     kv_caches: list[torch.Tensor], extras: dict
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward: a step with a static shape on ``graphs`` (its caches), else
        ModelRunner.forward_rows; a pipeline stage's runner (spec_decode/pipeline.py) runs its
        layers between the stages' transfers instead."""
        if self.graphs is not None and kv_caches is self.graphs.kv_caches:
            out = self.graphs.forward_rows(seqs, rows)
            if out is not None:
                return out
        return self.runner.forward_rows(seqs, rows, kv_caches, extras)

    def _propose(self, seqs: list[ScheduledSeq], offsets: list[int], outputs: list[SeqOutput],
                 hidden: torch.Tensor) -> None:
        """The proposer mirrors the step's final tokens and drafts for the next one."""
        assert self.proposer is not None
        mirror = []
        for i, s in enumerate(seqs):
            if s.proposer_skip:
                continue
            samples = outputs[i].samples
            final = s.num_tokens - s.num_spec_tokens
            if s.num_spec_tokens:
                final += max(0, len(samples) - 1)  # the accepted drafts
            mirror.append(MirrorSeq(
                seq_id=s.seq_id, block_table=s.block_table, start_pos=s.start_pos,
                tokens=s.token_ids[:final], target_rows=list(range(offsets[i], offsets[i] + final)),
                new_token=samples[-1].token_id if samples and s.num_spec_tokens else
                (samples[0].token_id if samples else None),
                num_drafts=s.num_lookahead if samples else 0))
        if not mirror:  # nothing followed: no pass (an EAGLE-3 head fuses its features first)
            return
        drafts = self.proposer.propose(mirror, hidden)
        for i, s in enumerate(seqs):
            if s.seq_id in drafts:
                outputs[i].spec_token_ids = drafts[s.seq_id]
