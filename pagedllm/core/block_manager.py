"""Maps sequences to KV blocks: allocation, prefix caching, copy-on-write, swapping. No torch here."""
from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedllm.core.block_allocator import BlockAllocator
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.kv_transfer.keys import block_key, root_key

BlockPair = tuple[int, int]  # (src block, dst block)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Device and host block tables for every live sequence.

    A sequence's device table covers its computed tokens plus any tokens scheduled this step:
    token ``i`` lives in block ``table[i // block_size]`` at offset ``i % block_size``. Blocks are
    shared by reference count: between the sequences of one request after a fork (copy-on-write on
    the first write into a shared block) and, with prefix caching, between requests whose prompts
    start with the same full blocks (hash chain over the token ids of each full block).

    With ``sliding_window`` (every attention layer of the model sees only the last ``window``
    positions), blocks that have slid out of the window for every query still to come are freed
    early: the first ``_dropped[seq_id]`` entries of a table are then placeholders that repeat
    the first live block (the attention masks those positions and never reads them as keys, but
    the tables stay valid indices), and only the live tail is freed, swapped, forked or offered
    to the prefix cache (a freed cached block stays cached: other prompts can still hit it).
    """

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0,
                 watermark: float = 0.01, enable_caching: bool = False,
                 sliding_window: int | None = None, key_namespace: str = "") -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.device = BlockAllocator(num_device_blocks, enable_caching)
        self.host = BlockAllocator(num_host_blocks, enable_caching=False)
        self.block_tables: dict[int, list[int]] = {}
        self.host_tables: dict[int, list[int]] = {}
        # seq_id -> content keys of its leading full blocks (computed lazily)
        self._keys: dict[int, list[Hashable]] = {}
        # seq_id -> how many leading blocks have been offered to the cache
        self._registered: dict[int, int] = {}
        self.num_prefix_hit_blocks = 0  # cumulative, for stats and tests
        # sliding window: seq_id -> leading placeholder entries of its table, and the first query
        # position of its last scheduled step (a step may still run while the next is scheduled)
        self._dropped: dict[int, int] = {}
        self._prev_q0: dict[int, int] = {}
        self.num_slid_out_blocks = 0  # cumulative blocks freed early, for stats and tests
        # content keys are rooted in what else changes KV (model, dtypes, layout; kv_transfer/
        # keys.py): KV offload tiers and KV connectors store blocks under the same keys
        self.key_namespace = key_namespace
        self._roots: dict[int, bytes] = {}

    # --- content keys (prefix caching) ---------------------------------------------------
    def _block_keys(self, seq: Sequence, num_blocks: int) -> list[Hashable]:
        """Keys of the first ``num_blocks`` full blocks: a digest of the parent's key and the
        block's token ids (kv_transfer/keys.py); the first block's parent is the root of the
        namespace and the sequence's adapter: the KV of the same tokens differs between
        adapters."""
        keys = self._keys.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            if keys:
                parent = keys[-1]
            else:
                parent = self._roots.get(seq.lora_int_id)
                if parent is None:
                    parent = self._roots[seq.lora_int_id] = root_key(self.key_namespace,
                                                                     seq.lora_int_id)
            keys.append(block_key(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return keys

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks.

        At least the last token is always recomputed (its logits are needed), so a hit never
        covers it: at most ``(len - 1) // block_size`` blocks.
        """
        if not self.enable_caching:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        hits: list[int] = []
        for key in self._block_keys(seq, max_blocks):
            block = self.device.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens of a not-yet-allocated sequence whose KV the prefix cache already holds."""
        if seq.seq_id in self.block_tables:
            return seq.num_computed_tokens
        return len(self._prefix_hits(seq)) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer every full, computed block of ``seq`` to the prefix cache."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        # a step scheduled ahead counts its pending token as computed before it is appended
        n_full = min(min(seq.num_computed_tokens, len(seq)) // self.block_size, len(table))
        # placeholders (slid out of the window) are not the blocks their keys name
        start = max(self._registered.get(seq.seq_id, 0), self._dropped.get(seq.seq_id, 0))
        if n_full <= start:
            return
        keys = self._block_keys(seq, n_full)
        for i in range(start, n_full):
            self.device.register(table[i], keys[i])
        self._registered[seq.seq_id] = n_full

    # --- admission of a sequence with no blocks ------------------------------------------
    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks taken out of the available pool to admit ``seq`` and compute ``num_new_tokens``."""
        hits = self._prefix_hits(seq)
        total = _cdiv(len(hits) * self.block_size + num_new_tokens, self.block_size)
        revived = sum(1 for b in hits if self.device.is_idle_cached(b))
        return total - len(hits) + revived

    def can_allocate(self, seqs: Iterable[tuple[Sequence, int]]) -> bool:
        """Whether every (sequence, new tokens) pair can be admitted, keeping the watermark free."""
        needed = sum(self._new_blocks_needed(seq, n) for seq, n in seqs)
        return self.device.num_available - needed >= self.watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give a sequence with no blocks its prefix hits plus fresh blocks for ``num_new_tokens``.

        Sets ``seq.num_computed_tokens`` to the tokens covered by prefix hits.
        """
        if seq.seq_id in self.block_tables:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        hits = self._prefix_hits(seq)
        for block in hits:
            self.device.incref(block)
        self.num_prefix_hit_blocks += len(hits)
        table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._registered[seq.seq_id] = len(hits)
        self._prev_q0[seq.seq_id] = seq.num_computed_tokens
        self.block_tables[seq.seq_id] = table
        self._grow(table, seq.num_computed_tokens + num_new_tokens)

    def _grow(self, table: list[int], num_tokens: int) -> None:
        for _ in range(_cdiv(num_tokens, self.block_size) - len(table)):
            table.append(self.device.allocate())

    # --- appending to running sequences --------------------------------------------------
    def _append_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        table = self.block_tables[seq.seq_id]
        first = seq.num_computed_tokens // self.block_size  # block the first new token lands in
        cow = 1 if first < len(table) and self.device.ref_count(table[first]) > 1 else 0
        grow = max(0, _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table))
        return grow + cow

    def can_append(self, seqs: Iterable[tuple[Sequence, int]]) -> bool:
        needed = sum(self._append_blocks_needed(seq, n) for seq, n in seqs)
        return needed <= self.device.num_available

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockPair]:
        """Make room for ``num_new_tokens`` more tokens; returns copy-on-write (src, dst) pairs."""
        table = self.block_tables[seq.seq_id]
        copies: list[BlockPair] = []
        first = seq.num_computed_tokens // self.block_size
        if first < len(table) and self.device.ref_count(table[first]) > 1:
            src = table[first]
            dst = self.device.allocate()
            self.device.free(src)
            table[first] = dst
            copies.append((src, dst))
            self._registered[seq.seq_id] = min(self._registered.get(seq.seq_id, 0), first)
        self._grow(table, seq.num_computed_tokens + num_new_tokens)
        self._slide(seq)
        return copies

    def _slide(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` that no query still to come (or still in flight) can see.

        The queries of this step start at q = num_computed_tokens, those of the step before (it
        may still run: Scheduler.schedule_ahead) at the recorded q_prev <= q. A query at p sees
        positions > p - window, so block i (last position (i + 1) * bs - 1) is out of sight of
        every such query iff (i + 1) * bs - 1 <= q_prev - window. At least the last block stays.
        """
        q_prev = self._prev_q0.get(seq.seq_id, 0)
        self._prev_q0[seq.seq_id] = seq.num_computed_tokens
        if self.sliding_window is None:
            return
        table = self.block_tables[seq.seq_id]
        out = min(max(0, (q_prev - self.sliding_window + 1) // self.block_size), len(table) - 1)
        start = self._dropped.get(seq.seq_id, 0)
        if out <= start:
            return
        for i in range(out - 1, start - 1, -1):  # later blocks first (LRU order, as free())
            self.device.free(table[i])
        self.num_slid_out_blocks += out - start
        table[:out] = [table[out]] * out
        self._dropped[seq.seq_id] = out

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.block_tables[parent.seq_id]
        dropped = self._dropped.get(parent.seq_id, 0)
        for block in table[dropped:]:
            self.device.incref(block)
        self.block_tables[child.seq_id] = list(table)
        if dropped:
            self._dropped[child.seq_id] = dropped
        if parent.seq_id in self._prev_q0:
            self._prev_q0[child.seq_id] = self._prev_q0[parent.seq_id]
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))
        self._registered[child.seq_id] = self._registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (device and host); a no-op for a sequence with none."""
        table = self.block_tables.pop(seq.seq_id, None)
        dropped = self._dropped.pop(seq.seq_id, 0)
        self._prev_q0.pop(seq.seq_id, None)
        if table is not None:
            # last blocks first, so the LRU evicts a chain's tail before its head
            for block in reversed(table[dropped:]):
                self.device.free(block)
        host = self.host_tables.pop(seq.seq_id, None)
        if host is not None:
            for block in reversed(host[dropped:]):
                self.host.free(block)
        self._keys.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)

    # --- swapping ------------------------------------------------------------------------
    @staticmethod
    def _unique(tables: Iterable[list[int]]) -> list[int]:
        return list(dict.fromkeys(b for t in tables for b in t))

    def can_swap_out(self, group: SequenceGroup) -> bool:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        blocks = self._unique(self.block_tables[s.seq_id][self._dropped.get(s.seq_id, 0):]
                              for s in seqs)
        return len(blocks) <= self.host.num_available

    def swap_out(self, group: SequenceGroup) -> list[BlockPair]:
        """Move the running sequences of ``group`` to host blocks; returns (device, host) pairs."""
        return self._move(group.get_seqs(SequenceStatus.RUNNING), self.block_tables, self.device,
                          self.host_tables, self.host, self._dropped)

    def can_swap_in(self, group: SequenceGroup) -> bool:
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        blocks = self._unique(self.host_tables[s.seq_id] for s in seqs)
        # one spare block per sequence for the token decoded right after the swap-in
        needed = len(blocks) + len(seqs)
        return self.device.num_available - needed >= self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[BlockPair]:
        """Move the swapped sequences of ``group`` back to device blocks; (host, device) pairs."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        pairs = self._move(seqs, self.host_tables, self.host, self.block_tables, self.device,
                           self._dropped)
        for seq in seqs:
            self._registered[seq.seq_id] = 0  # fresh blocks: offer them to the cache again
        return pairs

    @staticmethod
    def _move(seqs: list[Sequence], src_tables: dict[int, list[int]], src: BlockAllocator,
              dst_tables: dict[int, list[int]], dst: BlockAllocator,
              dropped: dict[int, int]) -> list[BlockPair]:
        """Moves the live blocks; the ``dropped`` leading placeholders are rebuilt on the
        destination side (repeating the first moved block)."""
        mapping: dict[int, int] = {}
        for seq in seqs:
            new_table = []
            skip = dropped.get(seq.seq_id, 0)
            for block in src_tables.pop(seq.seq_id)[skip:]:
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.free(block)
            dst_tables[seq.seq_id] = [new_table[0]] * skip + new_table if skip else new_table
        return list(mapping.items())

    # --- bookkeeping ---------------------------------------------------------------------
    def num_tracked_seqs(self) -> int:
        """Sequences with any state here; 0 once every request has finished."""
        ids = (set(self.block_tables) | set(self.host_tables) | set(self._keys)
               | set(self._registered) | set(self._dropped) | set(self._prev_q0))
        return len(ids)

    def usage(self) -> float:
        """Fraction of device blocks in use (idle cached blocks count as free)."""
        if self.num_device_blocks == 0:
            return 0.0
        return 1.0 - self.device.num_available / self.num_device_blocks
