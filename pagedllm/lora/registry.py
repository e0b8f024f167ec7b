"""The engine's side of LoRA: which adapters exist, each checked against the model before a
request runs it.

A request's adapter is checked once per ``lora_int_id``: the folder is read (config and tensor
shapes only, no weights), each module is routed onto this model's linears (routing.py, on a
meta-device copy of the model), and the first problem is raised as a ValueError naming the field
or module; so a bad adapter fails its request (or the server's load call) and never reaches a
worker. An id names one adapter for the engine's life: it keys the workers' slots and the
prefix cache, so reusing it for another name or path is refused.
"""
from __future__ import annotations

from typing import Any

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft import LoRAAdapterError, read_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.routing import LoRARouter


class LoRARegistry:
    def __init__(self, config: Any) -> None:
        self.config: LoRAConfig = config.lora_config
        self._hf_config = config.model.hf_config
        self._max_model_len = config.model.max_model_len
        self._router: LoRARouter | None = None
        self.known: dict[int, LoRARequest] = {}  # every id checked so far
        self.registered: dict[int, LoRARequest] = {}  # add_lora'd: listed, kept loaded

    @property
    def router(self) -> LoRARouter:
        if self._router is None:
            self._router = LoRARouter(self._hf_config, max_model_len=self._max_model_len)
        return self._router

    def check(self, request: Any) -> LoRARequest:
        """``request`` if it is a LoRARequest whose adapter this model runs; else ValueError
        (LoRAAdapterError for the adapter's own problems) naming what is wrong."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request={request!r} is invalid: must be a "
                             "pagedllm.lora.request.LoRARequest or None")
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"lora_int_id={request.lora_int_id} already names adapter "
                    f"{known.lora_name!r} ({known.lora_path}); an id names one adapter for the "
                    f"engine's life, use another id for {request.lora_name!r}")
            return request
        adapter = read_adapter(request.lora_path, self.config.max_lora_rank, load=False)
        router = self.router
        for module in adapter.modules.values():
            if not router.route(module, adapter.fan_in_fan_out):
                raise LoRAAdapterError(f"target module {module.name!r} of {request.lora_path} "
                                       f"is not a linear layer of this {router.arch} model")
        self.known[request.lora_int_id] = request
        return request

    def add(self, request: LoRARequest) -> None:
        self.registered[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> bool:
        return self.registered.pop(lora_int_id, None) is not None
