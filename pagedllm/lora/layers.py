"""The adapter slots of each linear and the step's token -> slot map they read.

Every linear of the model gets a ``LoRALayer`` (``LinearBase.lora``): slot buffers allocated
once, at start, for ``max_loras`` adapters of rank ``max_lora_rank`` (fixed shapes: CUDA graphs
capture them, and loading an adapter is a copy into a slot). The linear's forward adds
``ops.lora_expand(y, ops.lora_shrink(x, A), B, scales)`` for the step's mapping (contract/lora.py;
ops: reference/lora.py and the backends' kernels). A LoRALayer is plain data, not an
``nn.Module``: the model's parameters stay exactly the checkpoint's.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.contract.lora import NO_LORA, LoRAMapping
from pagedllm.lora.routing import LoRAPiece, linear_slices


class LoRAState:
    """What every LoRALayer of one worker reads: the current step's mapping.

    ``buffer`` [max_tokens] int32 on the device holds the step's token slots (NO_LORA past the
    step's tokens), rewritten in place each step, so a graph captured over a view of it reads
    each replay's slots. ``graph_safe``: the layers run the ops whenever no mapping matches the
    input (graph capture, padded replays) instead of skipping them.
    """

    def __init__(self, max_tokens: int, device: torch.device, graph_safe: bool) -> None:
        self.buffer = torch.full((max_tokens,), NO_LORA, dtype=torch.int32, device=device)
        self.graph_safe = graph_safe
        self.mapping: LoRAMapping | None = None
        self._filled = 0  # buffer entries [0, _filled) may hold a slot

    def set_step(self, host_slots: list[int]) -> None:
        """The slots of the step's tokens in model-input order (NO_LORA: the base model)."""
        n = len(host_slots)
        if n > self.buffer.shape[0]:
            raise ValueError(f"a step of {n} tokens exceeds the LoRA slot map's "
                             f"{self.buffer.shape[0]} (max_num_batched_tokens)")
        if any(s != NO_LORA for s in host_slots) or self._filled:
            self.buffer[:n].copy_(torch.tensor(host_slots, dtype=torch.int32), non_blocking=True)
            if self._filled > n:
                self.buffer[n:self._filled].fill_(NO_LORA)
            self._filled = n if any(s != NO_LORA for s in host_slots) else 0
        self.mapping = LoRAMapping(self.buffer[:n], host_slots)

    def mapping_for(self, num_tokens: int) -> LoRAMapping | None:
        """The mapping a linear with ``num_tokens`` input rows runs with; None: skip LoRA (no
        token of the step has an adapter, outside graphs)."""
        m = self.mapping
        if m is not None and m.num_tokens == num_tokens:
            return m if m.any_lora else None
        if self.graph_safe:  # graph capture (before the first step): the buffer is the truth
            return LoRAMapping(self.buffer[:num_tokens])
        return None


class LoRALayer:
    """One linear's slots: ``lora_a`` [S, n * R, in_local], ``lora_b`` [S, out_local, R],
    ``scales`` [S, n] float32 (n: the matrices the linear stacks, e.g. q/k/v)."""

    def __init__(self, module: Any, state: LoRAState, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        out_local, in_local = module.weight.shape
        self.ops = module.ctx.ops
        self.state = state
        self.rank = max_rank
        slices = linear_slices(module)
        self.slice_rows = tuple([row0 for _, row0, _ in slices] + [out_local])
        n = len(slices)
        self.lora_a = torch.zeros(max_loras, n * max_rank, in_local, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_local, max_rank, dtype=dtype, device=device)
        self.scales = torch.zeros(max_loras, n, dtype=torch.float32, device=device)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for x) plus each token's adapter delta."""
        x2 = x.reshape(-1, x.shape[-1])
        mapping = self.state.mapping_for(x2.shape[0])
        if mapping is None:
            return y
        y2 = y.view(-1, y.shape[-1])
        h = self.ops.lora_shrink(x2, self.lora_a, mapping)
        self.ops.lora_expand(y2, h, self.lora_b, self.scales, mapping, self.slice_rows)
        return y

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scales[slot].zero_()

    def set_slot(self, slot: int, piece: LoRAPiece) -> None:
        """Write one adapter matrix pair into ``slot`` (zero-padded past its rank)."""
        r, i, rank = piece.a.shape[0], piece.slice_index, self.rank
        lo, hi = self.slice_rows[i], self.slice_rows[i + 1]
        self.lora_a[slot, i * rank:i * rank + r].copy_(piece.a, non_blocking=True)
        self.lora_b[slot, lo:hi, :r].copy_(piece.b, non_blocking=True)
        self.scales[slot, i] = piece.scaling
