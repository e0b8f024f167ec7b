"""A worker's adapters: an LRU of host copies (``max_cpu_loras``) and the device slots
(``max_loras``), filled before each step with the adapters its sequences run.

Each rank loads its own shard of an adapter from disk (routing.py cuts it like the base
weights), so no adapter tensor crosses the executor; a sequence's ``LoRARequest`` reaches the
workers once, with the sequence (core/batch.py NewSeq). The scheduler never puts more distinct
adapters in a step than there are slots (core/scheduler.py), so a step always finds room: a
slot is taken from the adapter used longest ago that this step does not run (with a step still
in flight on the device, the copy is queued behind it on the same stream).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from pagedllm.contract.lora import NO_LORA
from pagedllm.core.batch import ScheduledBatch
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LoRALayer, LoRAState
from pagedllm.lora.peft import read_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.routing import LoRAPiece, LoRARouter
from pagedllm.models.layers.linear import LinearBase

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LoRAWorkerManager:
    def __init__(self, model: nn.Module, config: Any, tp: Any, pp: Any, device: torch.device,
                 model_dtype: torch.dtype, graph_safe: bool) -> None:
        lora: LoRAConfig = config.lora_config
        self.config = lora
        self.dtype = model_dtype if lora.lora_dtype == "auto" else _DTYPES[lora.lora_dtype]
        self.router = LoRARouter(config.model.hf_config, tp, pp,
                                 config.parallel.pp_layer_partition, config.model.max_model_len)
        sched = config.scheduler
        self.state = LoRAState(max(sched.max_num_batched_tokens, sched.max_num_seqs), device,
                               graph_safe)
        self.layers: dict[str, LoRALayer] = {}
        for path, module in model.named_modules():
            if isinstance(module, LinearBase):
                module.lora = LoRALayer(module, self.state, lora.max_loras, lora.max_lora_rank,
                                        self.dtype, device)
                self.layers[path] = module.lora
        # lora_int_id -> (request, this rank's pieces), least recently used first
        self.host: OrderedDict[int, tuple[LoRARequest, list[LoRAPiece]]] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.free_slots = list(range(lora.max_loras))
        self.num_loads = 0  # adapters read from disk, for tests and logs
        self.num_slot_fills = 0

    # --- the host LRU --------------------------------------------------------------------
    def add_lora(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter into the host cache (evicting the least recently used
        beyond max_cpu_loras); False when it was already there."""
        if request.lora_int_id in self.host:
            self.host.move_to_end(request.lora_int_id)
            return False
        adapter = read_adapter(request.lora_path, self.config.max_lora_rank)
        pieces = [p for m in adapter.modules.values()
                  for p in self.router.route(m, adapter.fan_in_fan_out)]
        unknown = {p.module for p in pieces} - set(self.layers)
        if unknown:  # the router's model and the loaded one differ: a bug, not a bad adapter
            raise RuntimeError(f"adapter {request.lora_name!r} routes to {sorted(unknown)}, "
                               "which this model has no LoRA slots for")
        self.host[request.lora_int_id] = (request, pieces)
        self.num_loads += 1
        while len(self.host) > self.config.max_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.debug("LoRA %d left the host cache", evicted)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy and slot); False when it was not loaded."""
        found = self.host.pop(lora_int_id, None) is not None
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            found = True
        return found

    def list_loras(self) -> list[int]:
        return list(self.host)

    # --- slots ---------------------------------------------------------------------------
    def _slot(self, request: LoRARequest, keep: set[int]) -> int:
        lora_id = request.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if lora_id not in self.host:
            self.add_lora(request)
        self.host.move_to_end(lora_id)
        if not self.free_slots:
            victim = next((i for i in self.slot_of if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"a step runs more adapters than max_loras="
                                   f"{self.config.max_loras} slots (the scheduler must not)")
            self.free_slots.append(self.slot_of.pop(victim))
        slot = self.free_slots.pop(0)
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for piece in self.host[lora_id][1]:
            self.layers[piece.module].set_slot(slot, piece)
        self.slot_of[lora_id] = slot
        self.num_slot_fills += 1
        return slot

    def prepare(self, batch: ScheduledBatch) -> None:
        """Fill slots with the step's adapters and set the token -> slot map (model-input
        order: each sequence's tokens in batch order)."""
        requests = {s.lora_request.lora_int_id: s.lora_request for s in batch.seqs
                    if s.lora_request is not None}
        slot_of = {i: self._slot(r, set(requests)) for i, r in requests.items()}
        host_slots: list[int] = []
        for s in batch.seqs:
            slot = slot_of[s.lora_request.lora_int_id] if s.lora_request is not None else NO_LORA
            host_slots.extend([slot] * s.num_tokens)
        self.state.set_step(host_slots)
