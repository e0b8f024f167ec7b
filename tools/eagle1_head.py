"""An EAGLE-1 head for training (tools/train_draft_model.py --eagle-version 1), in vLLM's
checkpoint format: ``fc`` over concat(embedding of token i + 1, the target's final hidden state
at i), one Llama decoder layer without its input norm (``layers.0.*``), output = hidden +
residual fed to the target's LM head (pagedllm/spec_decode/eagle.py runs it)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def target_pass(target: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [B, T, H] after the norm, logits [B, T, V]) of the frozen target."""
    with torch.no_grad():
        hidden = target.model(input_ids=tokens).last_hidden_state
        return hidden.float(), target.lm_head(hidden).float()


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's distribution (mean over positions)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(F.softmax(target_logits, dim=-1) * logp).sum(-1).mean()


class EagleHead(nn.Module):
    """EAGLE-1 for training, parameter names as vLLM's checkpoint: ``fc``, ``layers.0.*``."""

    def __init__(self, target: Any, intermediate_size: int) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)

        t = target.config
        cfg = LlamaConfig(**{**t.to_dict(), "num_hidden_layers": 1,
                             "intermediate_size": intermediate_size})
        cfg._attn_implementation = "sdpa"
        h = t.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds/features [B, T, H] (the token at i + 1, the feature at i) -> [B, T, H]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        out = self.layers[0](x, attention_mask=None, position_ids=pos,
                             position_embeddings=self.rotary(x, pos))
        return out[0] if isinstance(out, tuple) else out

    def export(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()
                if not k.startswith("rotary") and "input_layernorm" not in k}


def eagle_losses(head: EagleHead, target: Any, tokens: torch.Tensor
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Two unrolled steps over [B, T + 1] tokens: step 1 reads the target's features, step 2
    the head's own step-1 predictions (shifted: the prediction for i stands in for feature i).
    Returns (loss, [top-1 agreement with the target per step])."""
    feats, logits = target_pass(target, tokens)  # feature i predicts token i + 1
    embeds = target.model.embed_tokens(tokens[:, 1:]).float()  # token i + 1
    inp, want = feats[:, :-1], feats[:, 1:]  # head position i: (f_i, t_{i+1}) -> f_{i+1}
    want_logits = logits[:, 1:]
    loss, agree = 0.0, []
    for step, weight in enumerate((1.0, 0.5)):
        out = head(embeds, inp).float()
        pred_logits = target.lm_head(out.to(target.lm_head.weight.dtype)).float()
        loss = loss + weight * (F.smooth_l1_loss(out, want) + soft_ce(pred_logits, want_logits))
        agree.append((pred_logits.argmax(-1) == want_logits.argmax(-1)).float().mean().detach())
        if step == 0:
            inp = torch.cat([feats[:, :1], out[:, :-1]], dim=1)
    return loss, agree  # type: ignore[return-value]


