"""A pool of reference-counted KV blocks, with an optional content-addressed cache. No torch here."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable


class BlockAllocator:
    """Hands out block ids from a fixed pool of ``num_blocks``.

    Every block is in exactly one of three states:
      - free: ref 0, no content hash; in ``_free``, the most recently freed first, so a new
        block reuses memory that is warm in the caches and already mapped (a lazily mapped
        cpu KV cache would otherwise fault fresh pages in on every run through the pool);
      - cached-idle: ref 0 but registered under a content hash; in ``_evictor`` (LRU order,
        least recently freed first) and reusable by a prefix hit or evictable for a new block;
      - in use: ref >= 1 (registered or not).
    So ``num_free + num_cached_idle + in use == num_blocks`` at all times.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictor: OrderedDict[int, None] = OrderedDict()
        self._hash_of: list[Hashable | None] = [None] * num_blocks
        self._block_of: dict[Hashable, int] = {}
        self.num_evictions = 0
        # called with (block, key) when an idle cached block is evicted, before it is reused:
        # KV offload saves its content to a lower tier (kv_transfer/scheduler_side.py)
        self.on_evict: Callable[[int, Hashable], None] | None = None
        # called with (block, key) when a block is registered under a new key (a KV producer
        # saves the computed block)
        self.on_register: Callable[[int, Hashable], None] | None = None

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached_idle(self) -> int:
        """Blocks with ref 0 that still hold reusable cached content."""
        return len(self._evictor)

    @property
    def num_available(self) -> int:
        """Blocks a new allocation may take (free ones, then evicting idle cached ones)."""
        return len(self._free) + len(self._evictor)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def lookup(self, key: Hashable) -> int | None:
        """The block registered under ``key``, without taking a reference."""
        return self._block_of.get(key) if self.enable_caching else None

    def is_idle_cached(self, block: int) -> bool:
        return block in self._evictor

    # --- actions -------------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block with ref 1; evicts the least recently used idle cached block if needed."""
        if self._free:
            block = self._free.popleft()
        elif self._evictor:
            block, _ = self._evictor.popitem(last=False)
            key = self._hash_of[block]
            del self._block_of[key]
            self._hash_of[block] = None
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block, key)
        else:
            raise RuntimeError("out of KV blocks: the scheduler must check availability first")
        self._ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._ref[block] == 0:
            if block not in self._evictor:
                raise RuntimeError(f"block {block} is free; only cached blocks can be revived")
            del self._evictor[block]
        self._ref[block] += 1

    def free(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise RuntimeError(f"double free of block {block}")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._hash_of[block] is not None:
                self._evictor[block] = None  # most recently used goes last
            else:
                self._free.appendleft(block)

    def unregister(self, block: int) -> None:
        """Forget the content ``block`` was registered under (its KV turned out invalid: a
        failed KV load); an idle one becomes free."""
        key = self._hash_of[block]
        if key is None:
            return
        del self._block_of[key]
        self._hash_of[block] = None
        if block in self._evictor:
            del self._evictor[block]
            self._free.appendleft(block)

    def register(self, block: int, key: Hashable) -> None:
        """Record that ``block`` holds the content ``key`` (a full, computed block)."""
        if not self.enable_caching or self._hash_of[block] is not None:
            return
        if key in self._block_of:
            return  # another block already holds this content; this one stays private
        self._block_of[key] = block
        self._hash_of[block] = key
        if self.on_register is not None:
            self.on_register(block, key)
