"""Rotary position embedding tables, computed the way transformers computes them.

Rope scaling is read from the HF config (``rope_parameters`` in transformers 5, ``rope_scaling``
in 4): ``linear``, ``llama3`` and ``yarn`` change the static table; ``dynamic`` (NTK) and
``longrope`` (Phi-3's su) depend on how long the sequence is in the step that computes a token,
as in transformers' ``dynamic_rope_update``: a token of a sequence whose longest position in this
step is ``L - 1`` uses the frequencies of length ``L`` (dynamic: the base grows once ``L`` passes
``max_position_embeddings``; longrope: the long factors once ``L`` passes
``original_max_position_embeddings``). Keys already in the cache keep their rotation, as in
transformers. Partial rotary (GPT-NeoX ``rotary_pct``, ``partial_rotary_factor``) rotates the
first ``rotary_dim`` channels of each head only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope_theta_and_type(config: Any) -> tuple[float, str, dict]:
    """Works with transformers 4 (rope_theta, rope_scaling) and 5 (rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))), \
            rope_type, params
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0)
    return float(theta), rope_type, scaling


def rotary_dim_of(config: Any, head_size: int) -> int:
    """Channels rotated per head: head_size times the partial rotary factor (GPT-NeoX calls it
    ``rotary_pct``), as transformers rounds it."""
    _, _, params = _rope_theta_and_type(config)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = getattr(config, "rotary_pct", 1.0)
    return int(head_size * float(factor))


def _init_fn(rope_type: str) -> Any:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "su":  # the Phi-3 preview name of longrope
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    return ROPE_INIT_FUNCTIONS[rope_type]


def inv_freq_and_scaling(config: Any, head_size: int,
                         seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, factor on cos/sin) for sequences of length
    ``seq_len`` (None: the config's static choice)."""
    theta, rope_type, _ = _rope_theta_and_type(config)
    if rope_type == "default":
        dim = rotary_dim_of(config, head_size)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    inv_freq, scaling = _init_fn(rope_type)(config, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.float(), float(scaling)


def _table(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), 2 * len(inv_freq)] in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # elementwise, as transformers does
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def step_seq_lens(positions: torch.Tensor, metadata: AttentionMetadata | None) -> torch.Tensor:
    """[T] int64: for each token, the length of its sequence once this step's tokens are in
    (rows past the metadata's tokens, e.g. bucket padding, get their own position + 1). The
    prefill sequences listed in ``metadata.extras["verify_prefills"]`` (speculative decoding's
    verification chunks: tokens decoding would run one at a time) take their own position + 1
    too, so length-switched rotaries (longrope, dynamic) treat each as its decode step would."""
    lens = positions.to(torch.int64) + 1
    if metadata is None:
        return lens
    parts = []
    if metadata.num_prefills:
        seq, query = metadata.prefill_seq_lens_list, metadata.prefill_query_lens_list
        if len(seq) != metadata.num_prefills or len(query) != metadata.num_prefills:
            seq = metadata.prefill_seq_lens.tolist()  # no host copies: read the tensors
            starts = metadata.query_start_loc.tolist()
            query = [b - a for a, b in zip(starts, starts[1:])]
        verify = getattr(metadata, "extras", {}).get("verify_prefills")
        if verify:
            seq = [0 if i in verify else n for i, n in enumerate(seq)]
        parts.append(torch.tensor(seq, dtype=torch.int64).repeat_interleave(torch.tensor(query)))
    if metadata.num_decode_tokens:
        dec = metadata.decode_seq_lens_list
        if len(dec) != metadata.num_decode_tokens:
            dec = metadata.decode_seq_lens.tolist()
        parts.append(torch.tensor(dec, dtype=torch.int64))
    if parts:
        known = torch.cat(parts).to(positions.device)
        lens[: known.shape[0]] = torch.maximum(known, lens[: known.shape[0]])
    return lens


class RotaryEmbedding(nn.Module):
    """cos/sin [T, rotary_dim] in the model dtype for the tokens of one step."""

    def __init__(self, config: Any, head_size: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.head_size = head_size
        self.rotary_dim = rotary_dim_of(config, head_size)
        _, rope_type, params = _rope_theta_and_type(config)
        self.rope_type = "longrope" if rope_type == "su" else rope_type
        self.dtype, self.device = dtype, device
        t = torch.arange(max_positions, dtype=torch.int64)
        cos, sin = _table(*inv_freq_and_scaling(config, head_size), t)
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)
        # the length past which dynamic / longrope switch frequencies
        self.switch_len: int | None = None
        if self.rope_type == "longrope":
            self.switch_len = int(params.get("original_max_position_embeddings")
                                  or getattr(config, "original_max_position_embeddings"))
            long_cos, long_sin = _table(*inv_freq_and_scaling(config, head_size,
                                                              self.switch_len + 1), t)
            self.register_buffer("long_cos", long_cos.to(dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer("long_sin", long_sin.to(dtype=dtype, device=device),
                                 persistent=False)
        elif self.rope_type == "dynamic":
            self.switch_len = int(config.max_position_embeddings)  # as transformers' dynamic
            self._dynamic: dict[int, torch.Tensor] = {}  # seq len -> inv_freq

    def forward(self, positions: torch.Tensor, metadata: AttentionMetadata | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions], self.sin[positions]
        if self.switch_len is None or positions.numel() == 0:
            return cos, sin
        lens = step_seq_lens(positions, metadata)
        longer = lens > self.switch_len  # [T]
        if not bool(longer.any()):
            return cos, sin
        if self.rope_type == "longrope":
            sel = longer[:, None]
            return (torch.where(sel, self.long_cos[positions], cos),
                    torch.where(sel, self.long_sin[positions], sin))
        # dynamic NTK: the base of each token's step length (few distinct lengths per step)
        cos, sin = cos.clone(), sin.clone()
        for length in torch.unique(lens[longer]).tolist():
            if length not in self._dynamic:
                self._dynamic[length] = inv_freq_and_scaling(self.config, self.head_size,
                                                             int(length))[0]
            rows = (lens == length).nonzero().squeeze(1)
            c, s = _table(self._dynamic[length], 1.0, positions[rows].cpu())
            cos[rows] = c.to(cos.dtype).to(cos.device)
            sin[rows] = s.to(sin.dtype).to(sin.device)
        return cos, sin


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_op: Any,
               num_heads: int, num_kv_heads: int, head_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv [T, (num_heads + 2 * num_kv_heads) * head_size] into q, k, v and rotate the first
    ``cos.shape[-1]`` channels of every q and k head (partial rotary; the rest pass through).
    Returns q [T, num_heads * head_size], k and v [T, num_kv_heads * head_size]."""
    t, rot = qkv.shape[0], cos.shape[-1]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
    qk = qk.reshape(t, num_heads + num_kv_heads, head_size)
    qk = torch.cat([rotary_op(qk[..., :rot], cos, sin), qk[..., rot:]], dim=-1).reshape(t, -1)
    q, k = qk.split([q_size, kv_size], dim=-1)
    return q, k, v


def rope_scaled_max_len(config: Any, limit: int) -> int:
    """The model length a rope-scaled config supports, as vLLM derives it: ``limit``
    (max_position_embeddings) times the scaling factor for linear, dynamic and yarn scaling (yarn
    from ``original_max_position_embeddings``); llama3 and longrope configs already state their
    long length, so ``limit`` stays."""
    _, rope_type, params = _rope_theta_and_type(config)
    factor = params.get("factor") if isinstance(params, dict) else None
    if rope_type not in ("linear", "dynamic", "yarn") or not factor:
        return limit
    if rope_type == "yarn":
        limit = int(params.get("original_max_position_embeddings") or limit)
    return int(limit * float(factor))
