"""The engine's LoRA settings (vLLM's ``LoRAConfig`` names). No torch here."""
from __future__ import annotations

from dataclasses import dataclass

LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")
MAX_LORA_RANK_LIMIT = 512


def _check(cond: bool, name: str, value: object, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class LoRAConfig:
    """``max_loras`` adapters run in one step (device slots of ``max_lora_rank`` each, allocated
    at start); ``max_cpu_loras`` adapters stay loaded in host memory (an LRU; None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # dtype of the adapter slots: "auto" is the model dtype; a backend may widen it
    # (check_and_update_config: the cpu backend computes half-precision LoRA in float32)
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(_is_int(self.max_loras) and self.max_loras >= 1, "max_loras", self.max_loras,
               "must be an integer >= 1")
        _check(_is_int(self.max_lora_rank) and 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT,
               "max_lora_rank", self.max_lora_rank,
               f"must be an integer in [1, {MAX_LORA_RANK_LIMIT}]")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check(_is_int(self.max_cpu_loras) and self.max_cpu_loras >= self.max_loras,
               "max_cpu_loras", self.max_cpu_loras,
               f"must be an integer >= max_loras ({self.max_loras})")
        _check(self.lora_dtype in LORA_DTYPES, "lora_dtype", self.lora_dtype,
               f"allowed values are {', '.join(LORA_DTYPES)}")
