"""Per-token and per-sequence attention inputs of a step, built on the host in plain torch.

The XLA attention never slices by data-dependent lengths: every token carries its own
block-table row and absolute position, so one gather + mask serves prefill rows, decode rows and
pad rows alike (``token_layout``). torch_xla's ragged paged-attention kernel instead takes
per-sequence lengths and tables (``ragged_layout``). Both are computed here from host lists and
moved to the device in one transfer per tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.contract.attention import AttentionMetadata


@dataclass
class SeqRows:
    """The sequences of a step in token order: seq i owns ``q_lens[i]`` consecutive rows, the
    last of which sits at position ``seq_lens[i] - 1``."""

    q_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]

    @classmethod
    def from_metadata(cls, metadata: AttentionMetadata, tables: list[list[int]] | None = None
                      ) -> SeqRows:
        """From the engine's metadata (prefills first, then one row per decode)."""
        if tables is None:
            tables = (metadata.prefill_block_tables.cpu().tolist()
                      + metadata.decode_block_tables.cpu().tolist())
        q_lens = metadata.prefill_query_lens_list + [1] * metadata.num_decode_tokens
        seq_lens = metadata.prefill_seq_lens_list + metadata.decode_seq_lens_list
        return cls(q_lens, seq_lens, tables)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def blocks_needed(self, block_size: int) -> int:
        """Block-table columns the longest sequence uses (at least 1)."""
        return max([1] + [-(-n // block_size) for n in self.seq_lens])


def token_layout(rows: SeqRows, num_rows: int, width: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_tables [num_rows, width] int32, token_pos [num_rows] int32).

    Row r of seq i gets seq i's block table (cut or padded with block 0 to ``width``) and its
    absolute position; a token at position p attends to keys 0..p. Pad rows (past the real
    tokens) get table row 0s and position 0: they read one stale key and their output is
    discarded. Needs ``width * block_size >= max(seq_lens)``.
    """
    if width < rows.blocks_needed(block_size):
        raise ValueError(f"block-table width {width} cannot hold a sequence of "
                         f"{max(rows.seq_lens)} tokens with block_size={block_size}")
    if rows.num_tokens > num_rows:
        raise ValueError(f"{rows.num_tokens} tokens do not fit in {num_rows} rows")
    tables = torch.zeros((num_rows, width), dtype=torch.int32)
    pos = torch.zeros(num_rows, dtype=torch.int32)
    at = 0
    for q_len, seq_len, table in zip(rows.q_lens, rows.seq_lens, rows.tables):
        n_blocks = -(-seq_len // block_size)
        tables[at:at + q_len, :n_blocks] = torch.tensor(table[:n_blocks], dtype=torch.int32)
        pos[at:at + q_len] = torch.arange(seq_len - q_len, seq_len, dtype=torch.int32)
        at += q_len
    return tables, pos


def ragged_layout(rows: SeqRows, num_seqs: int, width: int, block_size: int
                  ) -> dict[str, torch.Tensor]:
    """The per-sequence inputs of ``ragged_paged_attention``, padded to ``num_seqs`` sequences:
    kv_lens [num_seqs], page_indices [num_seqs, width], cu_q_lens [num_seqs + 1] (all int32)
    and num_seqs [1]. Pad sequences have no queries and no keys."""
    n = len(rows.q_lens)
    if n > num_seqs:
        raise ValueError(f"{n} sequences do not fit in {num_seqs} kernel slots")
    kv_lens = torch.zeros(num_seqs, dtype=torch.int32)
    kv_lens[:n] = torch.tensor(rows.seq_lens, dtype=torch.int32)
    pages = torch.zeros((num_seqs, width), dtype=torch.int32)
    for i, (seq_len, table) in enumerate(zip(rows.seq_lens, rows.tables)):
        n_blocks = -(-seq_len // block_size)
        pages[i, :n_blocks] = torch.tensor(table[:n_blocks], dtype=torch.int32)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:n + 1] = torch.tensor(rows.q_lens, dtype=torch.int32).cumsum(0)
    cu[n + 1:] = cu[n]
    return {"kv_lens": kv_lens, "page_indices": pages, "cu_q_lens": cu,
            "num_seqs": torch.tensor([n], dtype=torch.int32)}
