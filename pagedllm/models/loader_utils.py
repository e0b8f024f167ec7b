"""Routing checkpoint tensors to parameters (stacked q/k/v and gate/up, tensor-parallel shards)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    owners = {}
    seen: set[int] = set()  # a tied parameter (LM head = embedding) is loaded once, by its owner
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = (module, param)
    return owners


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       rename: Callable[[str], str | None],
                       stacked: list[tuple[str, str, object]]) -> set[str]:
    """Copy checkpoint tensors into ``model``; returns the parameter names that were filled.

    ``rename`` maps a checkpoint name to a parameter name (None skips it); ``stacked`` lists
    (param fragment, checkpoint fragment, shard id) for matrices we store concatenated.
    Raises if a tensor matches no parameter or a parameter is left unfilled.
    """
    owners = _owners(model)
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        shard = None
        for param_frag, ckpt_frag, shard_id in stacked:
            if f".{ckpt_frag}." in name:
                name, shard = name.replace(f".{ckpt_frag}.", f".{param_frag}."), shard_id
                break
        if name not in owners:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no parameter of "
                             f"{type(model).__name__} (looked for {name!r})")
        module, param = owners[name]
        loader = getattr(module, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{ckpt_name}: shape {tuple(tensor.shape)} != parameter "
                                     f"shape {tuple(param.shape)}")
                param.copy_(tensor)
        loaded.add(name)
    missing = set(owners) - loaded
    if missing:
        raise ValueError(f"the checkpoint has no tensors for: {', '.join(sorted(missing)[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return loaded


def split_fused(weights: Iterable[tuple[str, torch.Tensor]],
                fused: dict[str, list[tuple[str, int]]]
                ) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoints that store q/k/v (or gate/up) as one tensor (Phi-3's ``qkv_proj``,
    ``gate_up_proj``): ``fused`` maps such a name fragment to [(fragment, rows), ...] and each
    matching tensor is split along dim 0 into those parts, renamed, so the usual stacked loading
    (and its tensor-parallel sharding) applies. Other tensors pass through."""
    for name, tensor in weights:
        frag = next((f for f in fused if f".{f}." in name), None)
        if frag is None:
            yield name, tensor
            continue
        parts = fused[frag]
        total = sum(rows for _, rows in parts)
        if tensor.shape[0] != total:
            raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {total} "
                             f"({' + '.join(f'{p}={r}' for p, r in parts)})")
        for (part, _), piece in zip(parts, tensor.split([r for _, r in parts], dim=0)):
            yield name.replace(f".{frag}.", f".{part}."), piece
