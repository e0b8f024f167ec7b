"""An EAGLE-3 head for training (tools/train_draft_model.py), in vLLM's checkpoint format.

The architecture is what pagedllm/spec_decode/eagle.py runs (and vLLM's Eagle3LlamaForCausalLM):
``fc`` fuses the target's residual stream entering three of its layers [3H -> H]; one decoder
layer (``midlayer``) whose attention reads concat(input_layernorm(embedding of token i + 1),
hidden_norm(hidden at i)) [2H]; a final ``norm``; its own ``lm_head`` over a draft vocabulary
(the most frequent target tokens; ``d2t`` maps a draft id to its target id).

Training-time test (EAGLE-3): ``steps`` unrolled draft steps in one pass. Step 0 reads the
target's fused states at every position, as the head's mirror pass does at inference. Step
s >= 1 reads at position i the head's own step s - 1 output at i - 1, as draft step s + 1 does,
and attends to what that draft step attends to: step-0 keys up to i - s (the context the mirror
wrote) and the step r keys at i - (s - r) for r = 1..s (the earlier draft positions, then its
own). Every step predicts the token two positions on (the target's distribution at i + 1).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default: the residual stream entering layers 2, L // 2 and L - 3."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def draft_vocabulary(train_ids: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent training tokens, ascending ids (int64)."""
    counts = torch.bincount(train_ids.long().flatten().cpu(), minlength=vocab)
    return counts.topk(min(size, vocab)).indices.sort().values


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Eagle3Head(nn.Module):
    def __init__(self, target: Any, intermediate_size: int, draft_ids: torch.Tensor,
                 aux_layers: list[int]) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        t = target.config
        h, eps = t.hidden_size, t.rms_norm_eps
        self.heads = t.num_attention_heads
        self.kv_heads = getattr(t, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(t, "head_dim", None) or h // self.heads
        self.aux_layers = list(aux_layers)
        self.intermediate_size = intermediate_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        mid = self.midlayer = nn.Module()
        mid.input_layernorm = nn.RMSNorm(h, eps=eps)
        mid.hidden_norm = nn.RMSNorm(h, eps=eps)
        attn = mid.self_attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        mid.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        mlp = mid.mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.norm = nn.RMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)
        self.rotary = LlamaRotaryEmbedding(t)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, 2H] -> q [B, H, T, D], k/v [B, H, T, D] (GQA heads repeated)."""
        b, t, _ = x.shape
        a = self.midlayer.self_attn
        q = a.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def forward(self, embeds: torch.Tensor, aux: torch.Tensor, steps: int
                ) -> list[torch.Tensor]:
        """embeds [B, T, H] (token i + 1's embedding), aux [B, T, 3H] (the target's states at
        i) -> each step's logits over the draft vocabulary [B, T, V_draft]."""
        b, t, _ = embeds.shape
        mid = self.midlayer
        pos = torch.arange(t, device=embeds.device)[None].expand(b, -1)
        cos, sin = self.rotary(embeds, pos)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        emb = mid.input_layernorm(embeds)
        hidden = self.fc(aux)
        keys, values, out = [], [], []
        i = torch.arange(t, device=embeds.device)
        scale = 1.0 / math.sqrt(self.head_dim)
        for s in range(steps):
            if s:  # the previous step's output at i - 1 stands in for the hidden state at i
                hidden = torch.cat([hidden[:, :1], prenorm[:, :-1]], dim=1)
            q, k, v = self._qkv(torch.cat([emb, mid.hidden_norm(hidden)], dim=-1), cos, sin)
            keys.append(k)
            values.append(v)
            # step-0 keys up to i - s; step r keys (r = 1..s) at i - (s - r), one each
            scores = [torch.matmul(q, keys[0].transpose(2, 3)) * scale]
            scores[0] = scores[0].masked_fill((i[None, :] > i[:, None] - s), float("-inf"))
            diag = []
            for r in range(1, s + 1):
                shift = s - r
                kr = torch.roll(keys[r], shifts=shift, dims=2)  # kr[i] = keys[r][i - shift]
                d = (q * kr).sum(-1, keepdim=True) * scale  # [B, H, T, 1]
                diag.append(d.masked_fill((i < shift)[None, None, :, None], float("-inf")))
            probs = torch.softmax(torch.cat(scores + diag, dim=-1).float(), dim=-1).to(q.dtype)
            att = torch.matmul(probs[..., :t], values[0])
            for r in range(1, s + 1):
                vr = torch.roll(values[r], shifts=s - r, dims=2)
                att = att + probs[..., t + r - 1:t + r] * vr
            att = att.transpose(1, 2).reshape(b, t, -1)
            h = mid.self_attn.o_proj(att) + hidden
            m = mid.post_attention_layernorm(h)
            h = mid.mlp.down_proj(F.silu(mid.mlp.gate_proj(m)) * mid.mlp.up_proj(m)) + h
            prenorm = h
            out.append(self.lm_head(self.norm(h)))
        return out

    def export(self, vocab: int) -> dict[str, torch.Tensor]:
        """vLLM's names: midlayer.*, fc, norm, lm_head, d2t (draft id -> target id offset),
        t2d (which of the ``vocab`` target ids the draft vocabulary has)."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary")}
        ids = self.draft_ids.cpu()
        state["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
        return state


def eagle3_losses(head: Eagle3Head, target: Any, tokens: torch.Tensor, steps: int
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Training-time-test loss over [B, T + 1] tokens: each step's cross-entropy against the
    target's next-token distribution restricted to the draft vocabulary (weights 0.8^s), and
    each step's top-1 agreement with the target's (full-vocabulary) argmax."""
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.aux_layers], dim=-1)[:, :-1]
        logits = out.logits[:, 1:].float()  # the target's distribution the head predicts
        embeds = target.model.embed_tokens(tokens[:, 1:])
        want = F.softmax(logits[..., head.draft_ids], dim=-1)
        best = logits.argmax(-1)
    preds = head(embeds.to(head.fc.weight.dtype), aux.to(head.fc.weight.dtype), steps)
    loss, agree = 0.0, []
    for s, pred in enumerate(preds):
        valid = torch.arange(pred.shape[1], device=pred.device) >= s
        logp = F.log_softmax(pred.float(), dim=-1)
        ce = -(want * logp).sum(-1)[:, valid].mean()
        loss = loss + (0.8 ** s) * ce
        hit = head.draft_ids[pred.argmax(-1)] == best
        agree.append(hit[:, valid].float().mean().detach())
    return loss, agree  # type: ignore[return-value]
