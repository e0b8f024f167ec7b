"""The tensor-parallel group a model shard belongs to (passed explicitly to every layer)."""
from __future__ import annotations

from dataclasses import dataclass
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
