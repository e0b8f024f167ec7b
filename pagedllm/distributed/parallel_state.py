"""The tensor-parallel group a model shard belongs to and the pipeline stage it runs (passed
explicitly to every layer)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TPGroup:
    """Rank ``rank`` of ``size`` tensor-parallel ranks; collectives through torch.distributed."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (result on every rank)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, total: int, what: str) -> int:
        """Per-rank size of a dimension that must divide evenly."""
        if total % self.size != 0:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size


@dataclass
class PPGroup:
    """Stage ``rank`` of ``size`` pipeline stages. A stage's TP rank ``t`` sends its (replicated)
    activations to TP rank ``t`` of the next stage: global ranks ``next_rank`` / ``prev_rank``
    of the default process group."""

    rank: int = 0
    size: int = 1
    prev_rank: int = -1  # global rank this process receives from (-1 on the first stage)
    next_rank: int = -1  # global rank this process sends to (-1 on the last stage)
    _sends: list = field(default_factory=list, repr=False)  # (work, tensors) still in flight

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        """Post the sends of ``tensors`` (in key order) to the next stage without waiting for the
        receiver, so this stage can start its next batch; earlier finished sends are reaped."""
        import torch.distributed as dist

        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        for key in sorted(tensors):
            t = tensors[key].contiguous()
            self._sends.append((dist.isend(t, dst=self.next_rank), t))

    def recv(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fill ``buffers`` (in key order) from the previous stage; blocks until they arrive."""
        import torch.distributed as dist

        for key in sorted(buffers):
            dist.recv(buffers[key], src=self.prev_rank)
        return buffers
