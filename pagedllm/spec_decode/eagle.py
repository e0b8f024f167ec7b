"""EAGLE draft heads for Llama-family targets, in the checkpoint formats vLLM loads.

EAGLE-1 (``EagleLlamaForCausalLM``; yuhuili/EAGLE-* checkpoints): ``fc`` [H, 2H] (bias optional:
``fc.bias`` or config ``eagle_fc_bias``) over concat(embed(token), target hidden); then
``num_hidden_layers`` Llama decoder layers (``layers.N.*``), the first without its input norm;
the output is hidden + residual (no final norm) and the target's LM head gives the logits. The
embedding is the target's unless the checkpoint has ``embed_tokens.weight``.

EAGLE-3 (``Eagle3LlamaForCausalLM``; ``midlayer.*`` names): ``fc`` [H, 3 * H_target] fuses the
target's hidden states at three layers (config ``eagle_config.eagle_aux_hidden_state_layer_ids``,
default (2, L // 2, L - 3): the residual stream entering those layers); one decoder layer whose
attention reads concat(input_layernorm(embed), hidden_norm(hidden)) [2H]; a final ``norm``; its
own ``lm_head`` over ``draft_vocab_size`` tokens with ``d2t`` (draft id -> target id offset).

Position i of a head reads the target's hidden state at i and the token at i + 1, and predicts
the hidden state (EAGLE-1) or token (EAGLE-3) at i + 1; its KV cache is paged like the target's,
with the same block tables.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.linear import LayerContext, QKVParallelLinear, ReplicatedLinear
from pagedllm.models.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from pagedllm.models.loader_utils import load_named_weights

STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def eagle_version(path: str, hf_config: Any, names: Iterable[str]) -> int:
    """3 for an EAGLE-3 head (an ``Eagle3`` architecture, ``midlayer.`` tensors or a
    ``draft_vocab_size``), else 1."""
    archs = " ".join(getattr(hf_config, "architectures", None) or [])
    if "eagle3" in archs.lower() or getattr(hf_config, "draft_vocab_size", None):
        return 3
    return 3 if any(n.startswith("midlayer.") for n in names) else 1


def is_eagle_checkpoint(path: str) -> bool:
    """Whether a folder holds an EAGLE head (its config names an Eagle architecture or model
    type), so ``{"model": path}`` without a method resolves to eagle."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    archs = " ".join(config.get("architectures") or []).lower()
    return "eagle" in archs or "eagle" in str(config.get("model_type", "")).lower()


def eagle3_aux_layer_ids(config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers (of all ``num_target_layers``) whose input residual stream an EAGLE-3
    head with config ``config`` reads: ``eagle_aux_hidden_state_layer_ids``, else (2, L // 2,
    L - 3); () when its ``use_aux_hidden_state`` is off."""
    eagle = getattr(config, "eagle_config", None) or {}
    if not eagle.get("use_aux_hidden_state", True):
        return ()
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(eagle["eagle_aux_hidden_state_layer_ids"])
    n = num_target_layers
    return (min(2, n - 1), n // 2, max(n - 3, 0))


class AuxHiddenStates:
    """EAGLE-3's inputs from the target: the residual stream entering target layers
    ``layer_ids`` (indices among all its layers), each [num_tokens, H_target].

    The stream entering layer i is layer i - 1's output hidden + residual (layer 0's input is
    the embedding); forward hooks capture it on the layers this pipeline stage owns. With
    pipeline stages the states made on earlier stages arrive with the intermediate tensors
    (under ``key(i)``) and each stage passes on what it has, so the last stage holds them all.
    """

    def __init__(self, target: nn.Module, layer_ids: Iterable[int]) -> None:
        self.layer_ids = tuple(layer_ids)
        layers = target.layers
        start = getattr(target, "start_layer", 0)
        end = getattr(target, "end_layer", len(layers))
        self.states: dict[int, torch.Tensor] = {}
        self.received: list[int] = []  # made on earlier stages
        self.made_here: list[int] = []
        self._hooks: list[Any] = []
        for i in sorted(set(self.layer_ids)):
            if not 0 <= i < len(layers):
                raise ValueError(f"the EAGLE-3 head reads target layer {i}, but the target has "
                                 f"{len(layers)} layers (eagle_aux_hidden_state_layer_ids)")
            maker = max(i - 1, 0)  # the layer that makes it (0: its input, the embedding)
            if maker < start:
                self.received.append(i)
            elif maker < end:
                self.made_here.append(i)
                self._hooks.append(self._hook(layers, i))

    @staticmethod
    def key(i: int) -> str:
        """The name of layer ``i``'s state among a stage's intermediate tensors."""
        return f"eagle_aux_{i}"

    def _hook(self, layers: Any, i: int) -> Any:
        if i == 0:
            def pre(module: nn.Module, args: tuple) -> None:
                self.states[0] = args[2]  # (positions, cos_sin, hidden, residual, ...)
            return layers[0].register_forward_pre_hook(pre)

        def post(module: nn.Module, args: tuple, out: tuple) -> None:
            hidden, residual = out
            self.states[i] = hidden + residual
        return layers[i - 1].register_forward_hook(post)

    def begin(self, intermediate: dict[str, torch.Tensor] | None = None) -> None:
        """Before the target's forward: drop the last step's states; take the earlier stages'
        from ``intermediate`` (the tensors this stage received)."""
        self.states = ({i: intermediate[self.key(i)] for i in self.received}
                       if intermediate is not None else {})

    def buffers(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Receive buffers for the earlier stages' states, each shaped as ``like``."""
        return {self.key(i): torch.empty_like(like) for i in self.received}

    def outgoing(self) -> dict[str, torch.Tensor]:
        """What this stage passes on: every state made here or before."""
        return {self.key(i): self.states[i] for i in self.received + self.made_here}

    def features(self) -> torch.Tensor:
        """[T, len(layer_ids) * H_target] the states side by side, in the head's order."""
        return torch.cat([self.states[i] for i in self.layer_ids], dim=-1)


class _NoNorm(nn.Module):
    """EAGLE-1's first layer has no input norm: (x [+ residual]) passes through as both."""

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return x, x


class _HeadBase(nn.Module):
    """What both heads share: shape facts, rotary, the paged decoder layers' caches."""

    version = 1

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.hidden_size = int(config.hidden_size)
        self.head_size = int(getattr(config, "head_dim", None)
                             or config.hidden_size // config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None)
                                or config.num_attention_heads)
        self.rotary = RotaryEmbedding(config, self.head_size, max_positions, ctx.dtype,
                                      ctx.device)

    @property
    def num_layers(self) -> int:
        return len(self.layers)  # type: ignore[attr-defined]


class Eagle1Head(_HeadBase):
    """EAGLE-1: ``forward`` -> (hidden for the LM head, hidden fed to the next draft step)."""

    version = 1

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int,
                 fc_bias: bool = False, own_embedding: bool = False) -> None:
        super().__init__(config, ctx, max_positions)
        h = self.hidden_size
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, h, ctx) if own_embedding
                             else None)
        self.fc = ReplicatedLinear(2 * h, h, fc_bias, ctx)
        layers = []
        for i in range(int(config.num_hidden_layers)):
            layer = LlamaDecoderLayer(config, ctx, self.rotary,
                                      LlamaForCausalLM.attention_biases(config), None,
                                      layer_idx=i)
            if i == 0:
                layer.input_layernorm = _NoNorm()
            layers.append(layer)
        self.layers = nn.ModuleList(layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                embed: nn.Module, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [T, H]: the target's final hidden state at each position (or this head's
        output at the previous position); ``embed`` the target's embedding."""
        emb = (self.embed_tokens or embed)(input_ids)
        h = self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))
        cos_sin = self.rotary(positions, metadata)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(positions, cos_sin, h, residual, cache, metadata)
        out = h + residual
        return out, out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name in ("fusion_fc.weight", "fusion_fc.bias"):  # the speculators format
                name = name.replace("fusion_fc", "fc")
            if name.startswith("embed_tokens.") and self.embed_tokens is None:
                return None
            if name.startswith("lm_head.") or "rotary_emb" in name:
                return None  # the target's LM head is used
            return name

        return load_named_weights(self, weights, rename, STACKED)


class _Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read [2H] (embedding and hidden state side by side)."""

    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding,
                 head_size: int, num_kv_heads: int) -> None:
        super().__init__()
        from pagedllm.models.layers.attention import Attention
        from pagedllm.models.layers.linear import RowParallelLinear

        h = int(config.hidden_size)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(2 * h, head_size, config.num_attention_heads,
                                          num_kv_heads, bias, ctx)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_size, h, bias, ctx)
        self.ctx = ctx
        self.attn = Attention(self.qkv_proj.num_heads, head_size, self.qkv_proj.num_kv_heads,
                              head_size ** -0.5, ctx)

    def forward(self, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        out = self.attn.forward_rotary(qkv, cos_sin, self.ctx.ops.rotary, kv_cache, metadata)
        return self.o_proj(out)


class Eagle3Head(_HeadBase):
    """EAGLE-3: ``forward`` -> (normed hidden for its LM head, pre-norm hidden fed back)."""

    version = 3

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int,
                 target_hidden_size: int, own_embedding: bool = False) -> None:
        super().__init__(config, ctx, max_positions)
        from pagedllm.models.llama import LlamaMLP

        h, eps = self.hidden_size, config.rms_norm_eps
        eagle = getattr(config, "eagle_config", None) or {}
        self.use_aux = bool(eagle.get("use_aux_hidden_state", True))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, h, ctx) if own_embedding
                             else None)
        target_h = int(getattr(config, "target_hidden_size", None) or target_hidden_size)
        self.fc = ReplicatedLinear(3 * target_h, h, False, ctx) if self.use_aux else None
        self.layers = nn.ModuleList([nn.Module()])
        layer = self.layers[0]
        layer.input_layernorm = RMSNorm(h, eps, ctx)
        layer.hidden_norm = RMSNorm(h, eps, ctx)
        layer.self_attn = _Eagle3Attention(config, ctx, self.rotary, self.head_size,
                                           self.num_kv_heads)
        layer.post_attention_layernorm = RMSNorm(h, eps, ctx)
        layer.mlp = LlamaMLP(config, ctx)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.norm = RMSNorm(h, eps, ctx)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None)
                                    or config.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, ctx)
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64,
                                            device=ctx.device), requires_grad=False)
        self.has_d2t = False

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input residual stream the head reads."""
        return eagle3_aux_layer_ids(self.config, num_target_layers)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_target] target states -> [T, H] (the first draft step's hidden input)."""
        if self.fc is None:
            return aux_hidden
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                embed: nn.Module, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[0]
        emb, _ = layer.input_layernorm((self.embed_tokens or embed)(input_ids))
        hidden = hidden.to(emb.dtype)
        if self.norm_before_residual:
            h, _ = layer.hidden_norm(hidden)
            residual = h
        else:
            residual = hidden
            h, _ = layer.hidden_norm(hidden)
        cos_sin = self.rotary(positions, metadata)
        h = layer.self_attn(positions, cos_sin, torch.cat([emb, h], dim=-1), kv_caches[0],
                            metadata)
        h, residual = layer.post_attention_layernorm(h, residual)
        h = layer.mlp(h)
        normed, prenorm = self.norm(h, residual)
        return normed, prenorm

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T] greedy draft tokens as target ids: the draft vocabulary's argmax mapped by ``d2t``
        (increasing, so a tie resolves to the lowest target id, as an argmax over the target
        vocabulary would)."""
        ids = self.lm_head.compute_logits(hidden).argmax(dim=-1)
        if not self.has_d2t:
            return ids
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d" or "rotary_emb" in name:
                return None
            if name.startswith("embed_tokens.") and self.embed_tokens is None:
                return None
            return name

        loaded = load_named_weights(self, _allow_missing_d2t(weights, self), rename, STACKED)
        self.has_d2t = bool(self.d2t.any())
        return loaded


def _allow_missing_d2t(weights: Iterable[tuple[str, torch.Tensor]],
                       head: Eagle3Head) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoints without ``d2t`` (same vocabulary as the target) get zero offsets."""
    seen = False
    for name, tensor in weights:
        seen = seen or name == "d2t"
        yield name, tensor
    if not seen:
        yield "d2t", torch.zeros(head.draft_vocab_size, dtype=torch.int64)
