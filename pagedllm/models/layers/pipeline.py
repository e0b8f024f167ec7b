"""Pipeline-parallel layer placement: which decoder layers a stage owns, and placeholders for the
rest (vLLM's ``make_layers`` / ``PPMissingLayer``).

A stage of ``pp_size`` owns the contiguous layers ``[start, end)`` given by ``get_pp_indices``;
``make_layers`` builds only those and puts a ``PPMissingLayer`` (no parameters, no KV cache) at
every other index, so layer indices (and checkpoint names such as ``layers.7.mlp``) keep their
meaning on every stage. The first stage embeds the tokens, the last applies the final norm and
the LM head; between stages the model's ``forward`` returns (and takes) its intermediate tensors,
a dict of ``[num_tokens, hidden]`` tensors (e.g. ``hidden_states`` and ``residual``).

``PAGEDLLM_PP_LAYER_PARTITION`` (like vLLM's ``VLLM_PP_LAYER_PARTITION``) sets an uneven split:
comma-separated layer counts, one per stage, summing to the number of layers ("3,5").
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PP_LAYER_PARTITION_ENV = "PAGEDLLM_PP_LAYER_PARTITION"


def parse_partition(raw: str, num_layers: int, pp_size: int) -> list[int]:
    """Layer counts per stage from ``PAGEDLLM_PP_LAYER_PARTITION``; raises naming the variable."""
    try:
        counts = [int(part) for part in raw.split(",")]
    except ValueError:
        counts = []
    where = f"{PP_LAYER_PARTITION_ENV}={raw!r}"
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"{where} is invalid: comma-separated layer counts, each >= 1, "
                         f"one per pipeline stage (e.g. '3,5')")
    if len(counts) != pp_size:
        raise ValueError(f"{where} names {len(counts)} stages but pipeline_parallel_size="
                         f"{pp_size}; give one layer count per stage")
    if sum(counts) != num_layers:
        raise ValueError(f"{where} covers {sum(counts)} layers but the model has {num_layers}; "
                         f"the counts must sum to {num_layers}")
    return counts


def partition_layers(num_layers: int, pp_size: int) -> list[int]:
    """Layer counts per stage: the environment's override, else an even split whose remainder
    goes to the stages before the last (which also runs the LM head and the sampler)."""
    raw = os.environ.get(PP_LAYER_PARTITION_ENV, "").strip()
    if pp_size == 1:
        return [num_layers]
    if raw:
        return parse_partition(raw, num_layers, pp_size)
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's "
                         f"{num_layers} layers; every stage needs at least one layer")
    base, extra = divmod(num_layers, pp_size)
    counts = [base] * pp_size
    for i in range(extra):  # 7 layers, 3 stages: [2, 3, 2]; 5 layers, 4 stages: [1, 1, 2, 1]
        counts[(pp_size - 2 - i) % pp_size] += 1
    return counts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage ``pp_rank`` owns."""
    counts = partition_layers(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


class PPMissingLayer(nn.Module):
    """Stands where a layer another stage owns would be: no parameters; never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a layer owned by another pipeline stage was called on this one")


def make_layers(num_layers: int, build: Callable[[int], nn.Module], pp_rank: int = 0,
                pp_size: int = 1) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): ``build(i)`` for the layers this stage owns, placeholders elsewhere."""
    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
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
