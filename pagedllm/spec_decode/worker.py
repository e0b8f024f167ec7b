"""The worker side of speculative decoding: a step with verification chunks, sampled with the
rejection sampler, then the device proposer's drafts for the next step.

``spec_worker_class(Base)`` composes with any backend's Worker class: the target model, its
ops and attention are the backend's; this adds the proposer (its model and KV cache, sized in
the same block budget), applies the step's block copies and swaps to the proposer's cache too,
and runs steps through ``SpecRunner``. The step runs eagerly (no graphs).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from pagedllm.core.batch import ScheduledBatch, ScheduledSeq, SeqOutput
from pagedllm.models.layers.linear import LayerContext
from pagedllm.spec_decode.proposer import DeviceProposer, MirrorSeq
from pagedllm.spec_decode.sampler import VerifyRow, VerifySampler
from pagedllm.worker.host_copy import to_device
from pagedllm.worker.model_runner import ModelRunner, prompt_logprobs
from pagedllm.worker.pending import PendingOutputs
from pagedllm.worker.sampler import SampleRow

logger = logging.getLogger(__name__)


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
        hidden, logits = runner.forward_rows(seqs, rows, kv_caches,
                                             {"verify_prefills": verify_prefills})
        device = logits.device  # where the runner's sampler works (the host, on tpu)
        outputs = [SeqOutput(s.seq_id, []) for s in seqs]
        if plain:
            bitmask = None
            if batch.token_bitmask is not None:
                mask = batch.token_bitmask
                mask = mask.result() if hasattr(mask, "result") else mask
                bitmask = mask[[i for i, _, _ in plain]].to(device, non_blocking=True)
            sel = to_device([r for _, r, _ in plain], device, torch.int64)
            got = runner.sampler(logits[sel], [row for _, _, row in plain], bitmask)
            for (i, _, _), samples in zip(plain, got):
                outputs[i].samples = samples
        if verify:
            sel = to_device([r0 + j for _, r0, v in verify for j in range(len(v.drafts) + 1)],
                            device, torch.int64)
            got = self.verify(logits[sel], [v for _, _, v in verify])
            for (i, _, _), samples in zip(verify, got):
                outputs[i].samples = samples
        for i, r0, n, targets in prompt_rows:
            k = seqs[i].sampling_params.prompt_logprobs or 0
            outputs[i].prompt_logprobs = prompt_logprobs(logits[r0:r0 + n], targets, k)
        if self.proposer is not None:
            self.proposer.forget(batch.finished_seq_ids)
            self._propose(seqs, offsets, outputs, hidden)
        return outputs

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
        drafts = self.proposer.propose(mirror, hidden)
        for i, s in enumerate(seqs):
            if s.seq_id in drafts:
                outputs[i].spec_token_ids = drafts[s.seq_id]


class SpecWorkerMixin:
    """Speculative decoding on top of a backend's Worker (``spec_worker_class``)."""

    spec_runner: SpecRunner
    proposer: DeviceProposer | None

    def load_model(self) -> None:
        super().load_model()  # type: ignore[misc]
        spec = self.config.speculative_config  # type: ignore[attr-defined]
        ops = self.runner.ops if hasattr(self.runner, "ops") else self._spec_ops()  # type: ignore[attr-defined]
        self.proposer = None
        if spec.method != "ngram":
            from pagedllm.spec_decode.loading import build_proposer

            ctx = LayerContext(ops=ops, tp=self.tp, dtype=self.dtype,  # type: ignore[attr-defined]
                               device=self.device, attn_cls=self.attn_cls)  # type: ignore[attr-defined]
            self.proposer = build_proposer(spec, self.config, self.model, ctx)  # type: ignore[attr-defined]
        self.spec_runner = SpecRunner(self.runner, ops.rejection_sample,  # type: ignore[attr-defined]
                                      self.proposer)

    def _spec_ops(self) -> Any:
        """The op table the backend registers (the rejection sampler among its ops)."""
        from pagedllm.reference.ops import Ops

        ops = Ops()
        self.backend.register_ops(ops)  # type: ignore[attr-defined]
        return ops

    def block_bytes(self) -> int:
        base = super().block_bytes()  # type: ignore[misc]
        if self.proposer is None:
            return base
        return base + self.proposer.block_bytes(self.cache_dtype.itemsize)  # type: ignore[attr-defined]

    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        super().init_cache(num_device_blocks, num_host_blocks)  # type: ignore[misc]
        if self.proposer is not None:
            shape = self.proposer.kv_layer_shape(num_device_blocks)
            self.proposer.kv_caches = [self.allocate_device_cache(shape)  # type: ignore[attr-defined]
                                       for _ in range(self.proposer.num_layers)]

    def _proposer_host(self) -> list[torch.Tensor]:
        assert self.proposer is not None
        if not self.proposer.host_caches and self.num_host_blocks > 0:  # type: ignore[attr-defined]
            shape = self.proposer.kv_layer_shape(self.num_host_blocks)  # type: ignore[attr-defined]
            self.proposer.host_caches = [self.allocate_host_cache(shape)  # type: ignore[attr-defined]
                                         for _ in range(self.proposer.num_layers)]
        return self.proposer.host_caches

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        super()._move_blocks(batch)  # type: ignore[misc]
        if self.proposer is None:
            return
        ops, caches = self.cache_ops, self.proposer.kv_caches  # type: ignore[attr-defined]
        if batch.blocks_to_swap_out:
            ops.swap_blocks(caches, self._proposer_host(),
                            torch.tensor(batch.blocks_to_swap_out, dtype=torch.int64))
        if batch.blocks_to_swap_in:
            ops.swap_blocks(self._proposer_host(), caches,
                            torch.tensor(batch.blocks_to_swap_in, dtype=torch.int64))
        if batch.blocks_to_copy:
            ops.copy_blocks(caches, torch.tensor(batch.blocks_to_copy, dtype=torch.int64,
                                                 device=self.device))  # type: ignore[attr-defined]

    def run_model(self, batch: ScheduledBatch) -> list[SeqOutput]:
        return self.spec_runner.execute(batch, self.kv_caches)  # type: ignore[attr-defined]

    def launch_model(self, batch: ScheduledBatch) -> PendingOutputs:
        return PendingOutputs(self.run_model(batch))


_CLASSES: dict[type, type] = {}


def spec_worker_class(base: type) -> type:
    """``base`` (a backend's Worker class) with speculative decoding; one class per base."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Spec{base.__name__}", (SpecWorkerMixin, base), {})
    return _CLASSES[base]


class SpecBackend:
    """A backend whose workers carry speculative decoding (``spec_worker_class`` of its worker
    class); everything else is the backend's own. Picklable, for worker processes."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        if name == "_backend":  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self._backend, name)

    def worker_cls(self) -> type:
        return spec_worker_class(self._backend.worker_cls())
