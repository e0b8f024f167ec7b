"""Watching what an engine's backend actually did, for the observed-claim checks (issue 41,
item 3): every attention call's metadata and implementation settings, every swap and its bits,
every quantized-linear call. Plain context managers, so the mutation harness can use them
outside pytest too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionCall:
    """One attention layer call: the step's layout and the implementation's settings."""

    prefill_query_lens: list[int]
    prefill_context_lens: list[int]
    decodes: int
    sliding_window: int | None
    logits_soft_cap: float | None
    kv_cache_dtype: str
    cache_dtype: torch.dtype
    cls: str


@dataclass
class Observed:
    attention: list[AttentionCall] = field(default_factory=list)
    swaps: list[tuple[str, int]] = field(default_factory=list)  # (direction, pairs moved)
    swap_mismatches: list[str] = field(default_factory=list)
    quant_calls: int = 0

    def prefill_tokens(self, since: int = 0) -> int:
        """Prefill tokens computed by the first attention layer's calls after call ``since``
        (every layer sees the same step; layer calls are told apart by order, so this counts
        the calls of distinct metadata objects)."""
        return sum(sum(c.prefill_query_lens) for c in self.attention[since:])


def _record(obs: Observed, impl: Any, kv_cache: torch.Tensor, metadata: Any,
            seen: dict[int, Any]) -> None:
    key = id(metadata)
    if key in seen:  # the same step in another layer (or forward called by forward_rotary)
        return
    seen[key] = metadata  # kept alive while watching, so its id is not reused
    obs.attention.append(AttentionCall(
        list(metadata.prefill_query_lens_list), list(metadata.prefill_context_lens_list),
        metadata.num_decode_tokens, getattr(impl, "sliding_window", None),
        getattr(impl, "logits_soft_cap", None), getattr(impl, "kv_cache_dtype", "auto"),
        kv_cache.dtype, type(impl).__name__))


@contextlib.contextmanager
def watching(llm: Any) -> Iterator[Observed]:
    """Records, while open, the attention calls of ``llm``'s in-process worker (its attention
    class's ``forward`` and ``forward_rotary``), its cache ops' swaps (checking each moved block
    bit for bit) and its op table's ``quant_linear`` calls."""
    worker = getattr(llm.llm_engine.executor, "worker", None)
    if worker is None:
        raise AssertionError("the observed-claim checks need the in-process executor "
                             "(tensor_parallel_size=1), whose worker they watch")
    obs = Observed()
    seen: dict[int, Any] = {}
    cls = worker.attn_cls
    saved = {name: cls.__dict__.get(name) for name in ("forward", "forward_rotary")}
    fwd, rot = cls.forward, cls.forward_rotary

    def forward(self: Any, query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any) -> Any:
        _record(obs, self, kv_cache, metadata, seen)
        return fwd(self, query, key, value, kv_cache, metadata)

    def forward_rotary(self: Any, qkv: Any, cos: Any, sin: Any, rotary: Any, kv_cache: Any,
                       metadata: Any) -> Any:
        _record(obs, self, kv_cache, metadata, seen)
        return rot(self, qkv, cos, sin, rotary, kv_cache, metadata)

    ops = worker.cache_ops
    swap, own_swap = ops.swap_blocks, ops.__dict__.get("swap_blocks")

    def swap_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], pairs: torch.Tensor) -> None:
        swap(src, dst, pairs)
        device_caches = list(worker.kv_caches) + [c for ve in worker.ve_kv_caches for c in ve]
        direction = "out" if any(src[0] is c for c in device_caches) else "in"
        obs.swaps.append((direction, int(pairs.shape[0])))
        for layer, (s, d) in enumerate(zip(src, dst)):
            for a, b in pairs.tolist():
                if not torch.equal(_bits(s[:, a]), _bits(d[:, b])):
                    obs.swap_mismatches.append(f"layer {layer}: block {a} -> {b}")

    ops_table = _op_table(worker)
    quant = ops_table.quant_linear if ops_table is not None else None

    def quant_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
        obs.quant_calls += 1
        return quant(x, layer)

    cls.forward, cls.forward_rotary = forward, forward_rotary
    ops.swap_blocks = swap_blocks
    if ops_table is not None:
        ops_table.quant_linear = quant_linear
    try:
        yield obs
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        if own_swap is None:
            del ops.swap_blocks
        else:
            ops.swap_blocks = own_swap
        if ops_table is not None:
            ops_table.quant_linear = quant


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().contiguous().view(torch.uint8)


def _op_table(worker: Any) -> Any:
    """The op table the worker's model layers share (``LayerContext.ops``)."""
    model = getattr(worker, "model", None)
    for module in model.modules() if model is not None else ():
        ops = getattr(getattr(module, "ctx", None), "ops", None)
        if ops is not None:
            return ops
    return None
