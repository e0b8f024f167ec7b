"""Writing EAGLE heads in the checkpoint formats vLLM loads (spec_decode/eagle.py reads them):
for tools/train_draft_model.py and for tests (random heads over a tiny target)."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

EAGLE1_ARCH = "EagleLlamaForCausalLM"
EAGLE3_ARCH = "Eagle3LlamaForCausalLM"


def eagle_config(target: Any, version: int = 1, num_layers: int = 1,
                 intermediate_size: int | None = None, draft_vocab_size: int | None = None,
                 aux_layer_ids: list[int] | None = None) -> dict[str, Any]:
    """config.json of a head for ``target`` (a transformers Llama-family config): the target's
    attention shape and vocabulary, ``num_layers`` decoder layers (EAGLE-3: one)."""
    heads = int(target.num_attention_heads)
    cfg: dict[str, Any] = {
        "architectures": [EAGLE3_ARCH if version == 3 else EAGLE1_ARCH],
        "model_type": "llama",
        "hidden_size": int(target.hidden_size),
        "intermediate_size": int(intermediate_size or target.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(target, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(target, "head_dim", None) or target.hidden_size // heads),
        "num_hidden_layers": 1 if version == 3 else num_layers,
        "vocab_size": int(target.vocab_size),
        "rms_norm_eps": float(getattr(target, "rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(target.max_position_embeddings),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    rope = getattr(target, "rope_parameters", None) or getattr(target, "rope_scaling", None)
    theta = getattr(target, "rope_theta", None)
    if isinstance(rope, dict):
        cfg["rope_theta"] = float(rope.get("rope_theta", theta or 10000.0))
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    elif theta is not None:
        cfg["rope_theta"] = float(theta)
    if version == 3:
        cfg["draft_vocab_size"] = int(draft_vocab_size or target.vocab_size)
        eagle: dict[str, Any] = {"use_aux_hidden_state": True}
        if aux_layer_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
        cfg["eagle_config"] = eagle
    return cfg


def random_eagle_state(cfg: dict[str, Any], version: int = 1, std: float = 0.05,
                       seed: int = 0, fc_bias: bool = False,
                       target_hidden_size: int | None = None) -> dict[str, torch.Tensor]:
    """Random float32 weights of a head with config ``cfg`` (tests)."""
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d, q, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    def layer(prefix: str, attn_in: int, input_norm: bool) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.self_attn.q_proj.weight": rand(q * d, attn_in),
               f"{prefix}.self_attn.k_proj.weight": rand(kv * d, attn_in),
               f"{prefix}.self_attn.v_proj.weight": rand(kv * d, attn_in),
               f"{prefix}.self_attn.o_proj.weight": rand(h, q * d),
               f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
               f"{prefix}.mlp.up_proj.weight": rand(inter, h),
               f"{prefix}.mlp.down_proj.weight": rand(h, inter),
               f"{prefix}.post_attention_layernorm.weight": 1 + rand(h)}
        if input_norm:
            out[f"{prefix}.input_layernorm.weight"] = 1 + rand(h)
        return out

    if version == 3:
        th = target_hidden_size or h
        vocab, draft_vocab = cfg["vocab_size"], cfg["draft_vocab_size"]
        state = layer("midlayer", 2 * h, True)
        state["midlayer.hidden_norm.weight"] = 1 + rand(h)
        state["fc.weight"] = rand(h, 3 * th)
        state["norm.weight"] = 1 + rand(h)
        state["lm_head.weight"] = rand(draft_vocab, h) * 20
        if draft_vocab != vocab:  # every other target token in the draft vocabulary
            ids = torch.arange(draft_vocab) * (vocab // draft_vocab)
            state["d2t"] = ids - torch.arange(draft_vocab)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[ids] = True
            state["t2d"] = t2d
        return state
    state = {"fc.weight": rand(h, 2 * h)}
    if fc_bias:
        state["fc.bias"] = rand(h)
    for i in range(cfg["num_hidden_layers"]):
        state.update(layer(f"layers.{i}", h, i > 0))
    return state


def save_eagle(path: str, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> str:
    """Write ``config.json`` and ``model.safetensors`` (world-readable) to ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "model.safetensors"):
        os.chmod(os.path.join(path, name), 0o644)
    return path
