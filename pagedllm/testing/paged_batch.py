"""Random paged-attention batches and their float64 reference results.

A ``PagedBatch`` is one engine step: some sequences prefill (possibly over context already in the
cache: prefix-cache hits or earlier chunks), the rest decode one token. Blocks are handed out
from a shuffled pool, so block tables are neither contiguous nor sorted, and table rows are
padded with block 0, which belongs to some other sequence (as the engine's tables are). The
metadata is built by the engine's own ``build_metadata``, so the suite feeds a backend exactly
what the model runner would.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.contract.attention import AttentionImpl, AttentionMetadata
from pagedllm.core.batch import ScheduledSeq
from pagedllm.sampling_params import SamplingParams
from pagedllm.testing.coverage import note
from pagedllm.worker.model_runner import build_metadata


@dataclass(frozen=True)
class SeqSpec:
    context_len: int  # tokens already in the cache before this step
    query_len: int  # tokens computed this step (1 for a decode)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class PagedBatch:
    specs: list[SeqSpec]  # multi-token (prefill) entries first, then decodes
    block_size: int
    num_blocks: int
    block_tables: list[list[int]]
    # this step's tokens, rows in batch order: query [T, H, D], key/value [T, kvH, D]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    # per sequence, the K/V already cached: [context_len, kvH, D]
    context_keys: list[torch.Tensor] = field(default_factory=list)
    context_values: list[torch.Tensor] = field(default_factory=list)
    first_block: int = 0  # blocks [first_block, num_blocks) were drawn (the rest stay unused)

    @staticmethod
    def random(specs: list[SeqSpec], *, num_heads: int, num_kv_heads: int, head_size: int,
               block_size: int, dtype: torch.dtype, device: torch.device,
               generator: torch.Generator, spare_blocks: int = 3,
               magnitudes: tuple[float, float, float] = (1.0, 1.0, 1.0),
               pool_blocks: int | None = None) -> PagedBatch:
        """Fresh random inputs (rounded to ``dtype``) laid out in a shuffled block pool.

        ``magnitudes`` multiply the standard-normal Q, K and V (dtype-edge inputs: scores that
        need a max-subtracted softmax, values beyond a narrower type's range). ``pool_blocks``:
        the blocks come from the top of a pool that large (ids near ``pool_blocks - 1``) instead
        of a pool just big enough."""
        needed = [-(-s.seq_len // block_size) for s in specs]
        used = sum(needed) + spare_blocks
        num_blocks = max(used, pool_blocks or 0)
        pool = (torch.randperm(used, generator=generator) + (num_blocks - used)).tolist()
        tables, at = [], 0
        for n in needed:
            tables.append(pool[at:at + n])
            at += n

        def rand(mag: float, *shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=generator) * mag).to(dtype).to(device)

        qm, km, vm = magnitudes
        t = sum(s.query_len for s in specs)
        return PagedBatch(
            specs=specs, block_size=block_size, num_blocks=num_blocks, block_tables=tables,
            query=rand(qm, t, num_heads, head_size), key=rand(km, t, num_kv_heads, head_size),
            value=rand(vm, t, num_kv_heads, head_size),
            context_keys=[rand(km, s.context_len, num_kv_heads, head_size) for s in specs],
            context_values=[rand(vm, s.context_len, num_kv_heads, head_size) for s in specs],
            first_block=num_blocks - used)

    def touched_blocks(self) -> list[int]:
        """Every block a step may read: the drawn ones (tables and spares) and block 0 (the
        tables' padding)."""
        return sorted({0, *range(self.first_block, self.num_blocks)})

    def reordered(self, order: list[int]) -> PagedBatch:
        """The same sequences (inputs, block tables) in another batch order. ``order`` lists old
        sequence indices; multi-token entries must still come first (the metadata's layout)."""
        rows, at = [], 0
        for s in self.specs:
            rows.append(slice(at, at + s.query_len))
            at += s.query_len
        pick = lambda t: torch.cat([t[rows[i]] for i in order])  # noqa: E731
        return PagedBatch(
            specs=[self.specs[i] for i in order], block_size=self.block_size,
            num_blocks=self.num_blocks, block_tables=[self.block_tables[i] for i in order],
            query=pick(self.query), key=pick(self.key), value=pick(self.value),
            context_keys=[self.context_keys[i] for i in order],
            context_values=[self.context_values[i] for i in order], first_block=self.first_block)

    # --- metadata ------------------------------------------------------------------------
    def _scheduled(self, seq_id: int, start: int, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq_id=seq_id, token_ids=[0] * n, start_pos=start,
                            block_table=self.block_tables[seq_id],
                            sampling_params=SamplingParams(), num_samples=1)

    def step_metadata(self, device: torch.device, pad_tokens_to: int = 0) -> AttentionMetadata:
        """The metadata the model runner builds for this step (pad rows get slot -1)."""
        seqs = [self._scheduled(i, s.context_len, s.query_len) for i, s in enumerate(self.specs)]
        return build_metadata(seqs, self.block_size, device, pad_tokens_to=pad_tokens_to)[2]

    def write_context(self, impl: AttentionImpl, kv_cache: torch.Tensor,
                      device: torch.device) -> None:
        """Store every sequence's cached context with the backend's own ``write_kv``."""
        for i, s in enumerate(self.specs):
            if s.context_len == 0:
                continue
            meta = build_metadata([self._scheduled(i, 0, s.context_len)], self.block_size,
                                  device)[2]
            impl.write_kv(self.context_keys[i], self.context_values[i], kv_cache, meta)

    def run(self, impl: AttentionImpl, kv_cache: torch.Tensor, device: torch.device,
            pad_tokens_to: int = 0) -> torch.Tensor:
        """The backend's ``forward`` for this step; [T (+ pad rows), num_heads, head_size]."""
        meta = self.step_metadata(device, pad_tokens_to)
        t = meta.slot_mapping.shape[0]
        q, k, v = self.query, self.key, self.value
        if t > q.shape[0]:  # pad rows carry arbitrary values, as a padded model input does
            extra = t - q.shape[0]
            q = torch.cat([q, q[:1].expand(extra, -1, -1)])
            k = torch.cat([k, k[:1].expand(extra, -1, -1)])
            v = torch.cat([v, v[:1].expand(extra, -1, -1)])
        note_step(self, impl, kv_cache, pad_rows=t - self.query.shape[0])
        out = impl.forward(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), kv_cache, meta)
        if tuple(out.shape) != (t, impl.num_heads * impl.head_size):
            raise AssertionError(f"forward returned shape {tuple(out.shape)}, expected "
                                 f"{(t, impl.num_heads * impl.head_size)}")
        return out.view(t, impl.num_heads, impl.head_size)

    # --- reference -----------------------------------------------------------------------
    def reference(self, scale: float, *, sliding_window: int | None = None,
                  soft_cap: float | None = None) -> torch.Tensor:
        """float64 causal attention of each query over its sequence; [T, H, D] on the CPU."""
        outs, row = [], 0
        for i, s in enumerate(self.specs):
            rows = slice(row, row + s.query_len)
            k = torch.cat([self.context_keys[i].cpu(), self.key[rows].cpu()]).double()
            v = torch.cat([self.context_values[i].cpu(), self.value[rows].cpu()]).double()
            outs.append(reference_attention(self.query[rows].cpu().double(), k, v,
                                            s.context_len, scale, sliding_window=sliding_window,
                                            soft_cap=soft_cap))
            row += s.query_len
        return torch.cat(outs)


def note_step(batch: PagedBatch, impl: AttentionImpl, kv_cache: torch.Tensor,
                pad_rows: int = 0) -> None:
    """What one attention step exercised, for the report's shape coverage."""
    bs = batch.block_size
    prefills = [s for s in batch.specs if s.query_len > 1]
    note(kv_heads=impl.num_kv_heads, group=impl.num_heads // impl.num_kv_heads,
         head_size=impl.head_size, block_size=bs, seqs=len(batch.specs),
         decodes=len(batch.specs) - len(prefills), max_query=max(s.query_len for s in batch.specs),
         max_seq_len=max(s.seq_len for s in batch.specs),
         chunk_offsets=len({s.context_len % bs for s in prefills if s.context_len}),
         max_block_id=max(b for t in batch.block_tables for b in t), pool_blocks=batch.num_blocks,
         pad_rows=pad_rows, kv_cache=str(kv_cache.dtype).removeprefix("torch."),
         sliding_window=impl.sliding_window, soft_cap=impl.logits_soft_cap)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                        scale: float, *, sliding_window: int | None = None,
                        soft_cap: float | None = None) -> torch.Tensor:
    """q [n, H, D] at positions start..start+n-1; k/v [start+n, kvH, D]; causal; query head h
    reads KV head h // (H // kvH). Returns [n, H, D] in q's dtype.

    ``sliding_window``: a query at position p sees keys at positions > p - window (and <= p).
    ``soft_cap``: the scaled scores s become cap * tanh(s / cap) before the softmax.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    first = 0  # keys before it are outside every query's window
    if sliding_window is not None:
        first = max(0, start - sliding_window + 1)
        k, v = k[first:], v[first:]
    qg = q.reshape(n, kv_heads, heads // kv_heads, d)  # a KV head's query heads together
    scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale  # [kvH, G, n, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = start + torch.arange(n)[:, None]
    k_pos = first + torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden = hidden | (k_pos <= q_pos - sliding_window)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hgqk,khd->qhgd", probs, v).reshape(n, heads, d)
