"""The attention part of the plugin contract: metadata and the AttentionImpl template."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pagedllm.contract import layer_fences

ATTENTION_FEATURES = ("sliding_window", "logits_soft_cap")


@dataclass
class AttentionMetadata:
    """Describes one step's tokens to every attention layer (passed as an argument, never global).

    Tokens are laid out prefills first: the first ``num_prefill_tokens`` rows belong to
    ``num_prefills`` sequences whose new tokens are packed back to back (``query_start_loc``);
    the remaining ``num_decode_tokens`` rows are one token per decoding sequence. Sequence ``i``
    of the prefill part already has ``prefill_context_lens[i]`` tokens in the cache (prefix cache
    hits or earlier chunks) and ``prefill_seq_lens[i]`` tokens once this step's are written.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64; slot = block * block_size + offset; -1 = pad
    block_size: int
    # prefill part
    query_start_loc: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    max_prefill_query_len: int
    max_prefill_seq_len: int
    # decode part
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, including the current token
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    max_decode_seq_len: int
    # host-side copies, for implementations that need Python ints
    prefill_query_lens_list: list[int] = field(default_factory=list)
    prefill_seq_lens_list: list[int] = field(default_factory=list)
    prefill_context_lens_list: list[int] = field(default_factory=list)
    decode_seq_lens_list: list[int] = field(default_factory=list)
    # free-form per-backend extras (bucket sizes, flattened block lists, ...)
    extras: dict = field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class AttentionImpl(ABC):
    """Paged attention for one layer shape on one backend.

    The template ``forward`` writes this step's K/V into the cache, then runs ``prefill`` on the
    prefill rows and ``decode`` on the decode rows (``attend``). A plugin implements
    ``kv_cache_shape``, ``write_kv``, ``prefill`` and ``decode``; it may override ``forward`` to
    fuse them, or ``forward_rotary`` to fuse the model's rotary embedding with the cache write.
    """

    name = "base"
    # the optional attention arguments (ATTENTION_FEATURES) this class's own prefill and decode
    # honour. Not inherited: a subclass states its own (``__init_subclass__`` resets it to ()),
    # since one that overrides decode with a kernel may no longer honour what its parent did.
    supported_features: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "supported_features" not in vars(cls):
            cls.supported_features = ()

    @classmethod
    def missing_features(cls, needed: tuple[str, ...] | list[str]) -> list[str]:
        """The entries of ``needed`` this class does not declare in ``supported_features``."""
        return [f for f in needed if f not in cls.supported_features]

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """``sliding_window``: a query at position p attends to keys at positions > p - window
        (None: all); ``logits_soft_cap``: scores become cap * tanh(scores / cap) before the
        softmax (None: off); ``kv_cache_dtype``: "auto" (the model dtype) or a declared
        ``Capabilities.kv_cache_dtypes`` entry such as "fp8". Models pass these keywords only
        when set, so an implementation written for plugin API 1.x still builds plain layers."""
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        asked = [name for name, value in (("sliding_window", sliding_window),
                                          ("logits_soft_cap", logits_soft_cap)) if value is not None]
        missing = self.missing_features(asked)
        if missing:
            raise ValueError(f"the {self.name!r} attention ({type(self).__name__}) does not "
                             f"support {', '.join(missing)}; it supports: "
                             f"{', '.join(self.supported_features) or 'none of ' + str(ATTENTION_FEATURES)}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer or None")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be a positive number or None")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor; dim 1 must index blocks (copy/swap rely on it)."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """Store ``key``/``value`` [num_tokens, num_kv_heads, head_size] at metadata.slot_mapping."""

    @abstractmethod
    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Causal attention of the prefill rows over cached context plus the new tokens.

        ``query`` [num_prefill_tokens, num_heads, head_size]; ``key``/``value`` are the new tokens'
        K/V (already written to the cache). Returns [num_prefill_tokens, num_heads, head_size].
        """

    @abstractmethod
    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """One query per sequence over its cached context. [num_decodes, num_heads, head_size]."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``query`` [T, num_heads*head_size], ``key``/``value`` [T, num_kv_heads*head_size]."""
        t = query.shape[0]
        k = key.view(t, self.num_kv_heads, self.head_size)
        v = value.view(t, self.num_kv_heads, self.head_size)
        self.write_kv(k, v, kv_cache, metadata)
        return self.attend(query, key, value, kv_cache, metadata)

    def forward_rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``forward`` on a qkv projection [T, (num_heads + 2 * num_kv_heads) * head_size] (q heads,
        k heads, v heads) whose q and k still need the rotary op ``rotary`` (x [T, heads,
        head_size], cos/sin [T, head_size] -> rotated x). A plugin may override this to fuse the
        rotary with the cache write (``attend`` does the rest)."""
        t = qkv.shape[0]
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        qk = rotary(qk.reshape(t, -1, self.head_size), cos, sin).reshape(t, -1)
        q, k = qk.split([q_size, kv_size], dim=-1)
        return self.forward(q, k, v, kv_cache, metadata)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The attention of ``forward`` once this step's K/V are in the cache: ``prefill`` on the
        prefill rows, ``decode`` on the decode rows, zeros for padded rows. Same shapes. First
        the waits a layer-wise import registered for this layer's cache (layer_fences.py)."""
        layer_fences.consume(kv_cache)
        t = query.shape[0]
        q = query.view(t, self.num_heads, self.head_size)
        k = key.view(t, self.num_kv_heads, self.head_size)
        v = value.view(t, self.num_kv_heads, self.head_size)
        p = metadata.num_prefill_tokens
        if metadata.num_decode_tokens == 0:
            out = self.prefill(q[:p], kv_cache, metadata, k[:p], v[:p])
        elif p == 0:
            out = self.decode(q[p:p + metadata.num_decode_tokens], kv_cache, metadata)
        else:
            out = torch.cat([self.prefill(q[:p], kv_cache, metadata, k[:p], v[:p]),
                             self.decode(q[p:p + metadata.num_decode_tokens], kv_cache, metadata)])
        if out.shape[0] < t:  # padded rows (static-shape backends) produce zeros
            out = torch.cat([out, out.new_zeros((t - out.shape[0],) + out.shape[1:])])
        return out.reshape(t, self.num_heads * self.head_size)
