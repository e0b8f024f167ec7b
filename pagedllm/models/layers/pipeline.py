"""Pipeline-parallel layer placement: which decoder layers a stage owns, and placeholders for the
rest (vLLM's ``make_layers`` / ``PPMissingLayer``).

A stage of ``pp_size`` owns the contiguous layers ``[start, end)`` given by ``get_pp_indices``;
``make_layers`` builds only those and puts a ``PPMissingLayer`` (no parameters, no KV cache) at
every other index, so layer indices (and checkpoint names such as ``layers.7.mlp``) keep their
meaning on every stage. The first stage embeds the tokens, the last applies the final norm and
the LM head; between stages the model's ``forward`` returns (and takes) its intermediate tensors,
a dict of ``[num_tokens, hidden]`` tensors (e.g. ``hidden_states`` and ``residual``).

The engine argument ``pp_layer_partition`` (vLLM's ``VLLM_PP_LAYER_PARTITION``) sets an uneven
split: layer counts, one per stage, summing to the number of layers ("3,5").
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def check_partition(counts: Sequence[int], num_layers: int, pp_size: int) -> None:
    """Refuse layer counts that do not split ``num_layers`` into ``pp_size`` stages, naming the
    engine argument (engine/config_validation.py runs this before any worker starts)."""
    where = f"pp_layer_partition={list(counts)!r}"
    if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"{where} is invalid: layer counts, each an integer >= 1, one per "
                         f"pipeline stage (e.g. 3,5)")
    if len(counts) != pp_size:
        raise ValueError(f"{where} is invalid: it names {len(counts)} stages but "
                         f"pipeline_parallel_size={pp_size}; give one layer count per stage")
    if sum(counts) != num_layers:
        raise ValueError(f"{where} is invalid: it covers {sum(counts)} layers but the model has "
                         f"{num_layers}; the counts must sum to {num_layers}")


def partition_layers(num_layers: int, pp_size: int,
                     partition: Sequence[int] | None = None) -> list[int]:
    """Layer counts per stage: ``partition`` (checked) where given, else an even split whose
    remainder goes to the stages before the last (which also runs the LM head and the sampler)."""
    if partition:
        check_partition(partition, num_layers, pp_size)
        return list(partition)
    if pp_size == 1:
        return [num_layers]
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's "
                         f"{num_layers} layers; every stage needs at least one layer")
    base, extra = divmod(num_layers, pp_size)
    counts = [base] * pp_size
    for i in range(extra):  # 7 layers, 3 stages: [2, 3, 2]; 5 layers, 4 stages: [1, 1, 2, 1]
        counts[(pp_size - 2 - i) % pp_size] += 1
    return counts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int,
                   partition: Sequence[int] | None = None) -> tuple[int, int]:
    """[start, end) of the layers stage ``pp_rank`` owns (``partition``: see partition_layers)."""
    counts = partition_layers(num_layers, pp_size, partition)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


class PPMissingLayer(nn.Module):
    """Stands where a layer another stage owns would be: no parameters; never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a layer owned by another pipeline stage was called on this one")


def make_layers(num_layers: int, build: Callable[[int], nn.Module], pp_rank: int = 0,
                pp_size: int = 1, partition: Sequence[int] | None = None
                ) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): ``build(i)`` for the layers this stage owns, placeholders elsewhere
    (``partition``: the stages' layer counts, LayerContext.layer_partition; None: even)."""
    start, end = get_pp_indices(num_layers, pp_rank, pp_size, partition)
    layers = nn.ModuleList([build(i) if start <= i < end else PPMissingLayer()
                            for i in range(num_layers)])
    return start, end, layers


def empty_intermediate(keys: tuple[str, ...], num_tokens: int, hidden_size: int,
                       dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Receive buffers for a stage's inputs: each ``[num_tokens, hidden_size]``."""
    return {k: torch.empty(num_tokens, hidden_size, dtype=dtype, device=device) for k in keys}


def is_pp_missing(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` ("layers.7.mlp.down_proj.weight") lies in a part of ``model``
    that another stage owns (a PPMissingLayer, or an attribute this stage set to None). Names
    that do not resolve are left for the weight loader to judge."""
    obj: Any = model
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
        if obj is None or isinstance(obj, PPMissingLayer):
            return True
    return False
