"""LoRA adapters on the server (vLLM's names): ``--lora-modules name=path`` at start, the OpenAI
``model`` field naming an adapter, ``/v1/models`` listing each with its base as ``parent``, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time, refused unless
``--allow-runtime-lora-updating`` (or PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING) turned them on.

Every adapter gets a fresh ``lora_int_id`` (an id names one adapter for the engine's life), is
checked against the model by the engine when loaded (a bad one is a 400 naming the problem; the
server keeps serving) and only then answers to its name.
"""
from __future__ import annotations

import itertools
import logging
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncEngineBase
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.lora_modules import LoRAModulePath
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

RUNTIME_FLAG = "--allow-runtime-lora-updating (or PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingLoRA:
    def __init__(self, engine: AsyncEngineBase, base_model_name: str, enabled: bool,
                 allow_runtime_updating: bool,
                 static_modules: list[LoRAModulePath] | None = None) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.enabled = enabled
        self.allow_runtime_updating = allow_runtime_updating
        self.static_modules = list(static_modules or [])
        self.adapters: dict[str, LoRARequest] = {}  # served name -> request
        self._ids = itertools.count(1)

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter the OpenAI ``model`` field names, else None (the base model)."""
        return self.adapters.get(model) if model is not None else None

    def model_cards(self, card: Any) -> list[dict[str, Any]]:
        """/v1/models entries: each adapter, its base model as ``parent``."""
        out = []
        for name, req in self.adapters.items():
            entry = card(name)
            entry.update(root=req.lora_path, parent=req.base_model_name or self.base_model_name)
            out.append(entry)
        return out

    async def load_static(self) -> None:
        """--lora-modules, once the engine loop runs; a bad one stops the start-up."""
        for module in self.static_modules:
            await self._load(module.name, module.path, module.base_model_name)
            logger.info("LoRA adapter %r loaded from %s", module.name, module.path)

    async def _load(self, name: str, path: str, base_model_name: str | None = None) -> None:
        if not self.enabled:
            raise bad_request("LoRA adapters need the server started with --enable-lora",
                              "lora_name")
        if name in self.adapters:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        request = LoRARequest(name, next(self._ids), path, base_model_name)
        try:
            await self.engine.add_lora(request)
        except ValueError as exc:
            raise bad_request(f"LoRA adapter {name!r} cannot be loaded: {exc}",
                              "lora_path") from exc
        self.adapters[name] = request

    def _check_runtime(self) -> None:
        if not self.allow_runtime_updating:
            raise OpenAIError(HTTPStatus.NOT_FOUND,
                              f"runtime LoRA updating is off: start the server with "
                              f"{RUNTIME_FLAG}", code="not_found")

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        self._check_runtime()
        if not req.lora_name or not req.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        await self._load(req.lora_name, req.lora_path)
        logger.info("LoRA adapter %r loaded from %s", req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        self._check_runtime()
        request = self.adapters.get(req.lora_name)
        if request is None or (req.lora_int_id is not None
                               and req.lora_int_id != request.lora_int_id):
            raise OpenAIError(HTTPStatus.NOT_FOUND,
                              f"The lora adapter '{req.lora_name}' cannot be found.",
                              param="lora_name", code="not_found")
        del self.adapters[req.lora_name]  # new requests no longer find it; running ones finish
        await self.engine.remove_lora(request.lora_int_id)
        logger.info("LoRA adapter %r unloaded", req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
