"""Linear layers that shard over a tensor-parallel group, with loaders for HF checkpoint weights.

Column-parallel layers split the output dim (each rank computes a slice); row-parallel layers
split the input dim and all-reduce the partial sums. With one rank both are plain linears.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import PPGroup, TPGroup
from pagedllm.reference.ops import Ops


@dataclass
class LayerContext:
    """What every layer needs besides its sizes; built once per model by the worker."""

    ops: Ops
    tp: TPGroup
    dtype: torch.dtype
    device: torch.device
    attn_cls: type
    pp: PPGroup = field(default_factory=PPGroup)  # the pipeline stage this model shard runs
    # the stages' layer counts (ParallelConfig.pp_layer_partition); None: an even split
    layer_partition: tuple[int, ...] | None = None
    # the checkpoint's quantization (models/layers/quantization QuantizationConfig) or None
    quant: Any = None
    # the model runs a handful of rows per call (a speculative proposer's draft passes): a
    # backend may keep a copy of its linears laid out for that (cpu: backends/cpu/few_rows.py)
    few_rows: bool = False


class LinearBase(nn.Module):
    """y = x W^T (+ b); W is this rank's [out_local, in_local] shard.

    Under a quantized checkpoint (``ctx.quant``) W holds codes and ``self.quant`` the scales
    (models/layers/quantization/base.py), and ``ops.quant_linear`` multiplies.
    """

    splits_input = False  # row-parallel: the input dim is sharded
    # the LoRA adapters' slots of this linear (pagedllm/lora/layers.py LoRALayer) with
    # enable_lora=True: each token's adapter delta is added to the output (row-parallel: to
    # this rank's partial sum, before the all-reduce)
    lora: Any = None

    def __init__(self, in_local: int, out_local: int, bias: bool, ctx: LayerContext) -> None:
        super().__init__()
        self.ctx = ctx
        method = ctx.quant
        quantized_now = method is not None and not method.quantize_at_load
        self.weight = nn.Parameter(torch.empty(out_local, in_local, device=ctx.device,
                                               dtype=method.weight_dtype if quantized_now
                                               else ctx.dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_local, dtype=ctx.dtype, device=ctx.device),
                                  requires_grad=False) if bias else None)
        self.quant = None
        if method is not None:
            from pagedllm.models.layers.quantization.base import QuantParams

            self.quant = QuantParams(self, in_local, out_local, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = (self.ctx.ops.quant_linear(x, self) if self.quant is not None
             else self.ctx.ops.linear(x, self))
        return y if self.lora is None else self.lora.apply(x, y)

    def _copy(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"parameter of shape {tuple(param.shape)}")
        param.data.copy_(loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: LayerContext) -> None:
        super().__init__(in_features, out_features, bias, ctx)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        self._copy(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Splits the output dim; ``gather_output`` all-gathers the slices."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: LayerContext,
                 gather_output: bool = False) -> None:
        super().__init__(in_features, ctx.tp.shard(out_features, "output size"), bias, ctx)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return self.ctx.tp.all_gather(y) if self.gather_output else y

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        n = param.shape[0]
        self._copy(param, loaded.narrow(0, self.ctx.tp.rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along the output dim (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 ctx: LayerContext) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ctx)
        self.local_sizes = [ctx.tp.shard(s, "output size") for s in output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        idx = int(shard_id)  # type: ignore[arg-type]
        size = self.local_sizes[idx]
        offset = sum(self.local_sizes[:idx])
        self._copy(param.narrow(0, offset, size), loaded.narrow(0, self.ctx.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix, sharded by heads.

    With fewer KV heads than ranks, each KV head is replicated over ``size / num_kv_heads`` ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool, ctx: LayerContext) -> None:
        tp = ctx.tp
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads != 0:
                raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of "
                                 f"num_key_value_heads={num_kv_heads} when it is larger")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.head_size = head_size
        out_local = (self.num_heads + 2 * self.num_kv_heads) * head_size
        LinearBase.__init__(self, hidden_size, out_local, bias, ctx)
        self.gather_output = False

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        d = self.head_size
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            dst, src_start, size = param.narrow(0, 0, q_size), self.ctx.tp.rank * q_size, q_size
        elif shard_id == "k":
            dst, src_start, size = param.narrow(0, q_size, kv_size), self.kv_head_start * d, kv_size
        elif shard_id == "v":
            dst = param.narrow(0, q_size + kv_size, kv_size)
            src_start, size = self.kv_head_start * d, kv_size
        else:
            raise ValueError(f"shard_id={shard_id!r} must be 'q', 'k' or 'v'")
        self._copy(dst, loaded.narrow(0, src_start, size))


class RowParallelLinear(LinearBase):
    """Splits the input dim; the partial products are all-reduced, then the bias is added."""

    splits_input = True

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: LayerContext) -> None:
        super().__init__(ctx.tp.shard(in_features, "input size"), out_features, False, ctx)
        self.out_bias = (nn.Parameter(torch.empty(out_features, dtype=ctx.dtype, device=ctx.device),
                                      requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.tp.all_reduce(self._matmul(x))
        return y + self.out_bias if self.out_bias is not None else y

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is not split
            self._copy(param, loaded)
            return
        n = param.shape[1]
        self._copy(param, loaded.narrow(1, self.ctx.tp.rank * n, n))
