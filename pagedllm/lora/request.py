"""A request's adapter, with vLLM's names (``vllm.lora.request.LoRARequest``). No torch here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with.

    ``lora_int_id`` (>= 1) names one adapter for the engine's life: the KV prefix cache and the
    device slots are keyed by it, so an id may not be reused for another name or path (the
    engine refuses that). ``lora_path`` is a local PEFT folder (adapter_config.json +
    adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: must be a non-empty "
                             "string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: must be an integer "
                             ">= 1 (0 means no adapter)")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path={self.lora_path!r} is invalid: must be a string (a "
                             "local folder)")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
