"""The worker side of speculative decoding: a step with verification chunks, sampled with the
rejection sampler, then the device proposer's drafts for the next step.

``spec_worker_class(Base)`` composes with any backend's Worker class: the target model, its
ops and attention are the backend's; this adds the proposer (its model and KV cache, sized in
the same block budget), applies the step's block copies and swaps to the proposer's cache too,
and runs steps through ``SpecRunner`` (spec_decode/runner.py; a pipeline stage's:
spec_decode/pipeline.py). Decode-only steps (plain and verification) run on the static buffers
the backend's worker leaves in ``spec_graphs`` (spec_decode/graphs.py; the cuda worker captures
them); other steps, and every step without them, run eagerly.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.models.layers.linear import LayerContext
from pagedllm.spec_decode.proposer import DeviceProposer
from pagedllm.spec_decode.runner import SpecRunner
from pagedllm.worker.pending import PendingOutputs

logger = logging.getLogger(__name__)


class SpecWorkerMixin:
    """Speculative decoding on top of a backend's Worker (``spec_worker_class``)."""

    spec_runner: SpecRunner
    proposer: DeviceProposer | None

    def load_model(self) -> None:
        super().load_model()  # type: ignore[misc]
        spec = self.config.speculative_config  # type: ignore[attr-defined]
        ops = self.runner.ops if hasattr(self.runner, "ops") else self._spec_ops()  # type: ignore[attr-defined]
        self.proposer = None
        pp = self.pp  # type: ignore[attr-defined]
        if spec.method != "ngram" and pp.is_last:  # the stage with the logits drafts
            from pagedllm.spec_decode.loading import build_proposer

            ctx = LayerContext(ops=ops, tp=self.tp, dtype=self.dtype,  # type: ignore[attr-defined]
                               device=self.device, attn_cls=self.attn_cls)  # type: ignore[attr-defined]
            self.proposer = build_proposer(spec, self.config, self.model, ctx)  # type: ignore[attr-defined]
        if pp.size > 1:
            from pagedllm.spec_decode.pipeline import SpecStageRunner, stage_aux_states

            aux = (getattr(self.proposer, "aux_states", None) if pp.is_last
                   else stage_aux_states(spec, self.config, self.model))  # type: ignore[attr-defined]
            self.spec_runner = SpecStageRunner(self.runner, ops.rejection_sample,  # type: ignore[attr-defined]
                                               self.proposer, pp, aux)
        else:
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
        return base + (self.proposer.block_bytes(self.cache_dtype.itemsize)  # type: ignore[attr-defined]
                       * self.num_virtual_engines)  # type: ignore[attr-defined]

    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        super().init_cache(num_device_blocks, num_host_blocks)  # type: ignore[misc]
        if self.proposer is not None:
            # one cache per virtual engine, as the target's (pipeline parallel: several)
            shape = self.proposer.kv_layer_shape(num_device_blocks)
            self.ve_proposer_caches = [
                [self.allocate_device_cache(shape)  # type: ignore[attr-defined]
                 for _ in range(self.proposer.num_layers)]
                for _ in range(self.num_virtual_engines)]  # type: ignore[attr-defined]
            self.ve_proposer_host: list[list[torch.Tensor]] = [
                [] for _ in range(self.num_virtual_engines)]  # type: ignore[attr-defined]
            self.proposer.kv_caches = self.ve_proposer_caches[0]
        self.spec_runner.graphs = getattr(self, "spec_graphs", None)

    def release_device_memory(self) -> None:
        if getattr(self, "spec_runner", None) is not None:  # (a failed start may not have one)
            self.spec_runner.graphs = None  # they hold the caches and their memory pool
        super().release_device_memory()  # type: ignore[misc]

    def _proposer_host(self, virtual_engine: int = 0) -> list[torch.Tensor]:
        assert self.proposer is not None
        host = self.ve_proposer_host[virtual_engine]
        if not host and self.num_host_blocks > 0:  # type: ignore[attr-defined]
            shape = self.proposer.kv_layer_shape(self.num_host_blocks)  # type: ignore[attr-defined]
            host.extend(self.allocate_host_cache(shape)  # type: ignore[attr-defined]
                        for _ in range(self.proposer.num_layers))
        self.proposer.host_caches = self.ve_proposer_host[0]
        return host

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        """The step's block moves on the proposer's caches too; the proposer then works on the
        batch's virtual engine's caches (the target's block ids index them)."""
        super()._move_blocks(batch)  # type: ignore[misc]
        if self.proposer is None:
            return
        ve = batch.virtual_engine
        caches = self.proposer.kv_caches = self.ve_proposer_caches[ve]
        ops = self.cache_ops  # type: ignore[attr-defined]
        if batch.blocks_to_swap_out:
            ops.swap_blocks(caches, self._proposer_host(ve),
                            torch.tensor(batch.blocks_to_swap_out, dtype=torch.int64))
        if batch.blocks_to_swap_in:
            ops.swap_blocks(self._proposer_host(ve), caches,
                            torch.tensor(batch.blocks_to_swap_in, dtype=torch.int64))
        if batch.blocks_to_copy:
            ops.copy_blocks(caches, torch.tensor(batch.blocks_to_copy, dtype=torch.int64,
                                                 device=self.device))  # type: ignore[attr-defined]

    def run_stage(self, batch: ScheduledBatch) -> list[SeqOutput] | None:
        return self.spec_runner.execute(  # type: ignore[return-value]
            batch, self.ve_kv_caches[batch.virtual_engine])  # type: ignore[attr-defined]

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
