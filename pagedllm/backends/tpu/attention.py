"""Paged attention for XLA devices, with static shapes.

Cache layout, per layer: ``[1, num_blocks, block_size, 2 * num_kv_heads, head_size]``. The inner
four dims are the pages layout of torch_xla's ragged paged-attention kernel (K and V interleaved
on the head axis: K of kv head h at index 2h, V at 2h + 1); the unit dim in front keeps blocks on
dim 1, as the contract requires (block copy relies on it).

One call serves a whole step: ``forward`` writes the step's K/V with ``index_copy_`` (pad rows,
slot -1, are sent out of range, which XLA's scatter drops) and runs attention for every row at
once, prefill chunks, decodes and pad rows alike, so nothing in the traced graph depends on how
many prefills or decodes the step has: only on the padded sizes.

Two attention paths:

* on a TPU with JAX installed (torch_xla[pallas]),
  ``torch_xla.experimental.custom_kernel.ragged_paged_attention`` (the Pallas kernel,
  per-sequence inputs, reads only each sequence's pages);
* elsewhere (XLA on the host CPU, and plain torch tensors in tests), ``gather_attention``: each
  row gathers its sequence's pages through its own block-table row and masks keys past its
  position. Its shapes depend only on (rows, block-table width). torch_xla's own non-kernel
  reference (``use_kernel=False``) loops over sequences with data-dependent slices, which is
  fine as an oracle in tests but recompiles every step, so it is not used for serving.
"""
from __future__ import annotations

import importlib.util

import torch

from pagedllm import envs
from pagedllm.backends.tpu.layout import SeqRows, ragged_layout, token_layout
from pagedllm.contract.attention import AttentionImpl, AttentionMetadata

KERNEL_ENV = "PAGEDLLM_TPU_KERNEL"  # "0" forces the gather path on a TPU (debugging)


def gather_attention(query: torch.Tensor, pages: torch.Tensor, token_tables: torch.Tensor,
                     token_pos: torch.Tensor, scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Causal paged attention, one block-table row per query row.

    query [T, H, D]; pages [num_blocks, block_size, 2*kvH, D] (K/V interleaved); token_tables
    [T, W] block ids; token_pos [T] the row's absolute position (it sees keys 0..pos, and with
    ``sliding_window`` only those > pos - window). ``soft_cap``: scaled scores s become
    cap * tanh(s / cap). Returns [T, H, D] in query's dtype; accumulates in float32. Query head
    h reads kv head h // (H/kvH).
    """
    t, num_heads, head_size = query.shape
    kv_heads = pages.shape[2] // 2
    group = num_heads // kv_heads
    kv = pages[token_tables.long()]  # [T, W, bs, 2*kvH, D]
    kv = kv.reshape(t, -1, kv_heads, 2, head_size)  # [T, L, kvH, (K, V), D]
    k, v = kv[..., 0, :].float(), kv[..., 1, :].float()  # [T, L, kvH, D]
    q = query.float().reshape(t, kv_heads, group, head_size) * scale
    scores = torch.einsum("tkgd,tlkd->tkgl", q, k)  # [T, kvH, G, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos = torch.arange(k.shape[1], device=query.device)[None, :]
    pos = token_pos.long()[:, None]
    visible = k_pos <= pos  # [T, L]; the key at pos itself is always visible: no empty rows
    if sliding_window is not None:
        visible = visible & (k_pos > pos - sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("tkgl,tlkd->tkgd", scores.softmax(dim=-1), v)
    return out.reshape(t, num_heads, head_size).to(query.dtype)


def on_tpu(device: torch.device) -> bool:
    """Whether ``device`` is an XLA device backed by a TPU where the Pallas kernel can run
    (it is traced through JAX: torch_xla[pallas] must be installed)."""
    if device.type != "xla" or not envs.PAGEDLLM_TPU_KERNEL:
        return False
    import torch_xla.runtime as xr

    return xr.device_type() == "TPU" and importlib.util.find_spec("jax") is not None


class XlaPagedAttention(AttentionImpl):
    name = "xla"
    # gather_attention and the Pallas kernel both take them
    supported_features = ("sliding_window", "logits_soft_cap")

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (1, num_blocks, block_size, 2 * num_kv_heads, head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping
        n = key.shape[0]
        if slots.shape[0] != n:
            raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {n} tokens")
        kv = torch.stack([key, value], dim=2).reshape(n, 2 * self.num_kv_heads, self.head_size)
        flat = kv_cache.view(-1, 2 * self.num_kv_heads, self.head_size)  # [blocks*bs, 2kvH, D]
        if kv_cache.device.type == "xla":
            # static shapes: pad rows (slot -1) go out of range, and XLA's scatter drops them
            slots = torch.where(slots < 0, torch.full_like(slots, flat.shape[0]), slots)
        else:
            real = slots >= 0
            slots, kv = slots[real], kv[real]
        flat.index_copy_(0, slots, kv.to(flat.dtype))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """All rows in one call; ``query`` [T, H*D], ``key``/``value`` [T, kvH*D]."""
        t = query.shape[0]
        q = query.view(t, self.num_heads, self.head_size)
        k = key.view(t, self.num_kv_heads, self.head_size)
        v = value.view(t, self.num_kv_heads, self.head_size)
        self.write_kv(k, v, kv_cache, metadata)
        extras = metadata.extras
        if "token_tables" not in extras:  # metadata from build_metadata, not the tpu worker
            extras = self.static_inputs(SeqRows.from_metadata(metadata), t,
                                        kv_cache.shape[2], q.device)
        return self._attend(q, kv_cache[0], extras).reshape(t, self.num_heads * self.head_size)

    def _attend(self, q: torch.Tensor, pages: torch.Tensor,
                extras: dict[str, torch.Tensor]) -> torch.Tensor:
        if "kv_lens" in extras:  # static_inputs adds the kernel's inputs on a TPU only
            from torch_xla.experimental.custom_kernel import ragged_paged_attention

            return ragged_paged_attention(q, pages, extras["kv_lens"], extras["page_indices"],
                                          extras["cu_q_lens"], extras["num_seqs"],
                                          sm_scale=self.scale, sliding_window=self.sliding_window,
                                          soft_cap=self.logits_soft_cap, use_kernel=True)
        return gather_attention(q, pages, extras["token_tables"], extras["token_pos"],
                                self.scale, self.sliding_window, self.logits_soft_cap)

    @staticmethod
    def static_inputs(rows: SeqRows, num_rows: int, block_size: int, device: torch.device,
                      width: int | None = None, num_seqs: int | None = None
                      ) -> dict[str, torch.Tensor]:
        """The device tensors ``forward`` reads from ``metadata.extras`` (see layout.py)."""
        width = width or rows.blocks_needed(block_size)
        tables, pos = token_layout(rows, num_rows, width, block_size)
        extras = {"token_tables": tables.to(device), "token_pos": pos.to(device)}
        if on_tpu(device):
            ragged = ragged_layout(rows, num_seqs or len(rows.q_lens), width, block_size)
            extras.update({k: t.to(device) for k, t in ragged.items()})
        return extras

    # the template's split entry points, for callers that use them directly
    def _attend_part(self, query: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata, part: slice) -> torch.Tensor:
        rows = SeqRows.from_metadata(metadata)
        rows = SeqRows(rows.q_lens[part], rows.seq_lens[part], rows.tables[part])
        extras = self.static_inputs(rows, query.shape[0], kv_cache.shape[2], query.device)
        return self._attend(query, kv_cache[0], extras)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self._attend_part(query, kv_cache, metadata, slice(0, metadata.num_prefills))

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        return self._attend_part(query, kv_cache, metadata, slice(metadata.num_prefills, None))
