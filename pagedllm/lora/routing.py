"""Where each module of a PEFT adapter lands in this engine's model, and its TP shard there.

An adapter names modules of the Hugging Face model (``model.layers.0.self_attn.q_proj``); this
engine fuses some of them (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), splits HF's
fused ones (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``, GPT-NeoX's interleaved
``query_key_value``), renames and transposes (GPT-2's Conv1D) and shards over tensor-parallel
ranks. The model's own ``load_weights`` knows all of that, so the router asks it: it builds the
model once on the meta device (no memory), replaces every module's ``weight_loader`` with a
recorder, and feeds it an adapter matrix under the module's weight name. What the recorder sees
is the linear that would receive it, the shard id (``"q"``, ``1``, ...) and the matrix after the
model's renaming, splitting and transposing. The TP shard is then cut by the base layer's own
``weight_loader``, so A and B are sharded exactly like their base weight:

- column-parallel linears (qkv, gate_up, up/fc1...): the output dim is sharded, so B [out, r] is
  cut like the weight's rows (through the model's pipeline) and A [r, in] is whole;
- row-parallel linears (o_proj, down_proj...): the input dim is sharded, so A [r, in] is cut like
  the weight's columns and B [out, r] is whole; each rank adds B (A_rank x_rank) to its partial
  sum before the all-reduce, which sums to B (A x).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import PPGroup, TPGroup
from pagedllm.lora.peft import LoRAAdapterError, ModuleLoRA
from pagedllm.models.layers.linear import (LayerContext, LinearBase, MergedColumnParallelLinear,
                                           QKVParallelLinear)
from pagedllm.models.registry import model_class, resolve_architecture
from pagedllm.reference.attention import TorchPagedAttention
from pagedllm.reference.ops import Ops


def linear_slices(module: LinearBase) -> list[tuple[Any, int, int]]:
    """(shard id, first output row, rows) of each matrix a linear stacks, in its local output."""
    out_local = module.weight.shape[0]
    if isinstance(module, QKVParallelLinear):
        q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
    if isinstance(module, MergedColumnParallelLinear):
        rows, offset = [], 0
        for i, size in enumerate(module.local_sizes):
            rows.append((i, offset, size))
            offset += size
        return rows
    return [(None, 0, out_local)]


@dataclass
class LoRAPiece:
    """One adapter matrix pair as one rank's linear ``module`` runs it: slice ``slice_index``
    of the linear's stacked outputs gains ``(b @ (a @ x)) * scaling``."""

    module: str  # path of the linear in the model (named_modules)
    slice_index: int
    a: torch.Tensor  # [r, in_local]
    b: torch.Tensor  # [slice rows (local), r]
    scaling: float


class LoRARouter:
    """Routes an adapter's modules onto one rank's linears (``tp``, ``pp``: that rank's groups;
    the defaults: the whole model unsharded, as the engine checks adapters)."""

    def __init__(self, hf_config: Any, tp: TPGroup | None = None, pp: PPGroup | None = None,
                 layer_partition: tuple[int, ...] | None = None,
                 max_model_len: int = 0) -> None:
        self.arch = resolve_architecture(hf_config)
        ctx = LayerContext(ops=Ops(), tp=tp or TPGroup(), dtype=torch.float32,
                           device=torch.device("meta"), attn_cls=TorchPagedAttention,
                           pp=pp or PPGroup(), layer_partition=layer_partition)
        max_positions = max_model_len or int(getattr(hf_config, "max_position_embeddings", 0)
                                              or 2048)
        self.model = model_class(self.arch)(hf_config, ctx, max_positions=max_positions)
        self.linears: dict[str, LinearBase] = {}
        self._records: list[tuple[str, nn.Module, Any, torch.Tensor]] = []
        for path, module in self.model.named_modules():
            if isinstance(module, LinearBase):
                self.linears[path] = module
            # an instance attribute shadows the class's loader: record instead of copying
            module.weight_loader = self._recorder(path, module)

    def _recorder(self, path: str, module: nn.Module) -> Any:
        def record(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            self._records.append((path, module, shard_id, loaded))
        return record

    def _feed(self, module_name: str, tensor: torch.Tensor
              ) -> list[tuple[str, nn.Module, Any, torch.Tensor]]:
        """What the model's loader does with ``tensor`` as the weight of ``module_name``."""
        self._records = []
        error: Exception | None = None
        try:
            self.model.load_weights([(f"{module_name}.weight", tensor)])
        except (ValueError, RuntimeError) as exc:  # every other tensor is missing: expected
            error = exc
        records, self._records = self._records, []
        if not records and error is not None and "has no tensors for" not in str(error):
            raise LoRAAdapterError(f"target module {module_name!r} is not a module of this "
                                   f"{self.arch} model ({error})") from None
        return records

    def route(self, lora: ModuleLoRA, fan_in_fan_out: bool) -> list[LoRAPiece]:
        """The pieces of one adapter module on this rank; [] when its layer is another
        pipeline stage's. ``lora.lora_a`` / ``lora_b`` may be meta tensors (shapes only: the
        engine's check). LoRAAdapterError naming the module when it is not a linear of this
        model or its shapes are another base model's."""
        a, b = lora.lora_a, lora.lora_b
        if a is None or b is None:
            a = torch.empty(lora.a_shape, device="meta")
            b = torch.empty(lora.b_shape, device="meta")
        # the checkpoint stores fan_in_fan_out (Conv1D) weights [in, out]: feed the same layout
        records = self._feed(lora.name, b.t() if fan_in_fan_out else b)
        if not records:
            return []  # another stage's layer (or a tied head the model does not load)
        pieces = []
        for path, module, shard, piece in records:
            if not isinstance(module, LinearBase):
                raise LoRAAdapterError(
                    f"target module {lora.name!r} is {type(module).__name__} here, not a linear "
                    f"layer; LoRA runs on the attention and MLP linears (MoE experts excluded)")
            pieces.extend(self._shard(lora, path, module, shard, piece, a, fan_in_fan_out))
        return pieces

    def _shard(self, lora: ModuleLoRA, path: str, module: LinearBase, shard: Any,
               b_piece: torch.Tensor, a: torch.Tensor, fan_in_fan_out: bool) -> list[LoRAPiece]:
        out_local, in_local = module.weight.shape
        rank = a.shape[0]
        loader = type(module).weight_loader
        slices = linear_slices(module)
        index = next((i for i, (sid, _, _) in enumerate(slices) if sid == shard), None)
        if index is None:
            raise LoRAAdapterError(f"target module {lora.name!r}: shard {shard!r} of {path} is "
                                   "not one this engine stacks")
        _, row0, rows = slices[index]
        try:
            if module.splits_input:  # row-parallel: A's columns like the weight's, B whole
                if b_piece.shape[0] != out_local:
                    raise ValueError(f"lora_B has {b_piece.shape[0]} rows, the layer outputs "
                                     f"{out_local}")
                a_records = self._feed(lora.name, a.t() if fan_in_fan_out else a)
                a_full = a_records[0][3]
                if a_full.shape[1] != in_local * module.ctx.tp.size:
                    raise ValueError(f"lora_A takes {a_full.shape[1]} inputs, the layer takes "
                                     f"{in_local * module.ctx.tp.size}")
                a_local = a_full.new_zeros(rank, in_local)
                loader(module, a_local, a_full, None)
                b_local = b_piece
            else:  # column-parallel: B's rows like the weight's, A whole
                if a.shape[1] != in_local:
                    raise ValueError(f"lora_A takes {a.shape[1]} inputs, the layer takes "
                                     f"{in_local}")
                if module.ctx.tp.size == 1 and b_piece.shape[0] != rows:
                    raise ValueError(f"lora_B has {b_piece.shape[0]} rows for {rows} outputs")
                b_all = b_piece.new_zeros(out_local, rank)
                loader(module, b_all, b_piece, shard)
                b_local, a_local = b_all.narrow(0, row0, rows), a
        except (ValueError, RuntimeError, IndexError) as exc:
            raise LoRAAdapterError(
                f"target module {lora.name!r}: lora_A {list(lora.a_shape)} / lora_B "
                f"{list(lora.b_shape)} do not fit this model's {path} (weight "
                f"{list(module.weight.shape)} on this rank): an adapter of another base model? "
                f"({exc})") from None
        return [LoRAPiece(path, index, a_local, b_local, lora.scaling)]
