"""Speculative decoding across pipeline stages (pipeline_parallel_size > 1).

A verification batch crosses the stages like any other: every stage runs its layers over the
step's tokens (a verified sequence's last token and its drafts, k + 1 query tokens) and sends
the activations on; the last stage, which holds the logits, samples with the rejection sampler
and runs the proposer (draft model or EAGLE head, loaded there only), and its samples and drafts
go back to the engine as a plain pipelined step's do.

An EAGLE-1 head reads the target's final hidden states, which the last stage has; an EAGLE-3
head reads the residual stream entering some target layers, which earlier stages may make: each
stage captures those its layers make (AuxHiddenStates) and sends them on beside its
intermediate tensors, so the last stage holds them all. The head's token embedding is the
target's, which only the first stage holds unless the LM head is tied to it: the last stage
loads a copy (loading.target_embedding).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.core.batch import ScheduledBatch, ScheduledSeq, SeqOutput
from pagedllm.distributed.parallel_state import PPGroup
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.eagle import AuxHiddenStates
from pagedllm.spec_decode.proposer import DeviceProposer
from pagedllm.spec_decode.runner import SpecRunner
from pagedllm.worker.host_copy import to_device
from pagedllm.worker.model_runner import ModelRunner, build_metadata


def stage_aux_states(spec: SpeculativeConfig, config: EngineConfig,
                     target: nn.Module) -> AuxHiddenStates | None:
    """The EAGLE-3 states a stage before the last captures and passes on (None: none)."""
    from pagedllm.spec_decode.loading import aux_layer_ids

    ids = aux_layer_ids(spec, config)
    return AuxHiddenStates(target, ids) if ids else None


class SpecStageRunner(SpecRunner):
    """One pipeline stage's share of a step that may hold verification chunks: receive the
    previous stage's activations (unless first), run this stage's layers, then send them on
    (with the EAGLE-3 states made so far), or, on the last stage, sample, verify and propose
    (SpecRunner). ``aux``: the EAGLE-3 states this stage keeps (the head's own on the last)."""

    def __init__(self, runner: ModelRunner, rejection_sample: Any,
                 proposer: DeviceProposer | None, pp: PPGroup,
                 aux: AuxHiddenStates | None) -> None:
        super().__init__(runner, rejection_sample, proposer)
        self.pp = pp
        self.aux = aux
        self._waited = 0.0  # seconds the last step waited for the previous stage

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv_caches: list[torch.Tensor]
                ) -> list[SeqOutput] | None:
        start = time.monotonic()
        if self.pp.is_last:
            outputs = super().execute(batch, kv_caches)  # its forward: forward_rows below
        else:
            verify = frozenset(i for i, s in enumerate(batch.seqs)
                               if s.num_spec_tokens and s.num_tokens > 1)
            out = self._run_layers(batch.seqs, kv_caches, {"verify_prefills": verify})
            if self.aux is not None:
                out = {**out, **self.aux.outgoing()}
            self.pp.send(out)
            outputs = None
        self.runner.busy.append((start + self._waited, time.monotonic()))
        return outputs

    def forward_rows(self, seqs: list[ScheduledSeq], rows: list[int],
                     kv_caches: list[torch.Tensor], extras: dict
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's forward: (final hidden states, logits of ``rows``)."""
        hidden = self._run_layers(seqs, kv_caches, extras)
        rows_t = to_device(rows, self.runner.device, torch.int64)
        return hidden, self.runner.model.compute_logits(hidden[rows_t])

    def _run_layers(self, seqs: list[ScheduledSeq], kv_caches: list[torch.Tensor],
                    extras: dict) -> Any:
        """This stage's layers over the step's tokens, after the previous stage's activations
        arrive: its intermediate tensors, or (last stage) the final hidden states."""
        runner = self.runner
        device, model = runner.device, runner.model
        ids, positions, meta = build_metadata(seqs, runner.block_size, device)
        meta.extras.update(extras)
        intermediate = None
        self._waited = 0.0
        if not self.pp.is_first:
            dtype = next(model.parameters()).dtype
            buffers = model.make_empty_intermediate_tensors(len(ids), dtype, device)
            if self.aux is not None:
                buffers.update(self.aux.buffers(buffers["hidden_states"]))
            idle = time.monotonic()
            intermediate = self.pp.recv(buffers)
            self._waited = time.monotonic() - idle  # waiting for the previous stage is not work
        if self.aux is not None:
            self.aux.begin(intermediate)
        return model(to_device(ids, device, torch.int64), to_device(positions, device, torch.int64),
                     kv_caches, meta, intermediate)
