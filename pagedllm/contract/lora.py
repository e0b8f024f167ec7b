"""What the LoRA ops receive (plugin API 2.2): which adapter slot each token of a step runs with.

Adapters live in slots preallocated at start (``max_loras`` of rank ``max_lora_rank`` per
linear), so a step's tensors have fixed shapes and CUDA graphs capture them; a token's slot
index selects its A and B (punica's batched-GEMV layout: one launch for every adapter of the
batch, -1 for tokens running the base model alone). The ops' spec: contract/ops.py
(``lora_shrink``, ``lora_expand``); their reference: reference/lora.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NO_LORA = -1  # a token's slot when it runs without an adapter


@dataclass
class LoRAMapping:
    """One step's token -> slot map.

    ``token_slots`` [T] int32 on the device (T: the step's tokens, padding included; a padded
    token's slot is NO_LORA). ``host_slots`` is the same list on the host where the step was
    built there (None during graph capture: kernels then read ``token_slots`` only).
    """

    token_slots: torch.Tensor
    host_slots: list[int] | None = None

    def __post_init__(self) -> None:
        self._groups: list[tuple[int, slice | torch.Tensor]] | None = None  # groups(), cached

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, rows) for each slot some token uses, in slot order: rows is a slice where that
        slot's tokens are contiguous, else an int64 index tensor on ``token_slots``' device.
        Computed once per mapping, from ``host_slots`` (or from ``token_slots``, syncing)."""
        if self._groups is None:
            slots = (self.host_slots if self.host_slots is not None
                     else self.token_slots.tolist())
            rows: dict[int, list[int]] = {}
            for t, s in enumerate(slots):
                if s != NO_LORA:
                    rows.setdefault(s, []).append(t)
            groups: list[tuple[int, slice | torch.Tensor]] = []
            for s in sorted(rows):
                idx = rows[s]
                if idx[-1] - idx[0] + 1 == len(idx):
                    groups.append((s, slice(idx[0], idx[-1] + 1)))
                else:
                    groups.append((s, torch.tensor(idx, dtype=torch.int64,
                                                   device=self.token_slots.device)))
            self._groups = groups
        return self._groups

    @property
    def any_lora(self) -> bool:
        """Whether some token runs with an adapter."""
        return bool(self.groups())
