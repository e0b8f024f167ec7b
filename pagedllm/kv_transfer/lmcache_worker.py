"""The LMCacheConnector's worker side (the scheduler side: lmcache.py): a BlockStore over an
LMCache engine (``lmcache.v1.cache_engine.LMCacheEngine``), which keeps the blocks in its own
storage backends (local CPU memory, local disk, a remote store such as ``fs://`` or ``lm://``),
evicts them by its own policy and shares them with whatever else uses the same backends.

Mapping (one pagedllm block = one LMCache chunk):
- LMCache's ``chunk_size`` is the engine's ``block_size``; a block is stored with
  ``LMCacheEngine.store(hashes=..., offsets=...)`` under a chunk hash made from its content key
  (the key's first 8 bytes: LMCache chunk hashes are 64-bit; the key is already a chain over
  the prefix, the model, the dtypes and the adapter), and looked up with
  ``LMCacheEngine.lookup(hashes=..., offsets=...)``.
- LMCache's memory objects are ``[2, num_layers, chunk_size, H]`` (its KV_2LTD format) of
  uint8, H = block_nbytes // (2 * block_size): a staging row ``[num_layers, block_nbytes]``
  seen as ``[num_layers, 2, block_size, H]`` with its first two axes swapped. The bytes are
  the backend's block layout; only an engine of the same layout reads them (the content key's
  namespace already says so).
- The copies between staging rows and memory objects are a ``GPUConnectorInterface`` of our
  own (LMCache's own connectors copy from vLLM's or SGLang's paged caches with its CUDA ops);
  reads go to the engine's storage manager by key, since ``LMCacheEngine.retrieve`` takes
  tokens only.

Every engine is registered under its ``lmcache_instance_id`` (``LMCacheEngineBuilder``), which
is how the scheduler side in the same process finds it (``open_lookup``) and how two pagedllm
engines of one process share one LMCache engine (they name the same instance id); it is
destroyed when the last of them closes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from pagedllm.kv_transfer.base import Slot
from pagedllm.kv_transfer.worker_side import BlockStore, CacheLayout, KVConnectorWorker

logger = logging.getLogger(__name__)

STORE = "lmcache"
PUT_POLL_S = 0.001
EXIT_WATCHER = "pagedllm-lmcache-exit"
_LOCK = threading.Lock()
_OPEN: dict[str, int] = {}  # instance id -> pagedllm workers holding it


def import_lmcache() -> Any:
    """The ``lmcache`` module; ImportError naming the package when it is missing. Unless the
    user set them, LMCache's usage telemetry is off and its log level is WARNING (its INFO
    logs a line per store)."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        import lmcache
        import lmcache.v1.cache_engine  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "kv_transfer_config.kv_connector='LMCacheConnector' needs the lmcache package, "
            f"which cannot be imported here ({exc}); install it with `pip install lmcache` "
            "(it leaves an installed torch alone)") from exc
    return lmcache


def chunk_hash(key: bytes) -> int:
    """LMCache's 64-bit chunk hash of a 16-byte content key."""
    return int.from_bytes(key[:8], "big")


def lmcache_config(spec: dict[str, Any]) -> Any:
    """The LMCacheEngineConfig: LMCACHE_CONFIG_FILE (or the spec's config file), then LMCACHE_*
    environment variables, then the spec's overrides (``lmcache.<name>`` extra config keys), as
    vLLM's LMCache connector reads it; ``chunk_size`` is the block size."""
    from lmcache.v1.config import load_engine_config_with_overrides

    overrides = dict(spec["overrides"], chunk_size=spec["block_size"],
                     lmcache_instance_id=spec["instance_id"])
    config = load_engine_config_with_overrides(config_file_path=spec["config_file"],
                                               overrides=overrides)
    for name in ("use_layerwise", "enable_blending", "enable_pd"):
        if getattr(config, name, False):
            raise ValueError(f"LMCache config {name}={getattr(config, name)!r} is not supported "
                             "by LMCacheConnector (it moves whole blocks between engines of "
                             f"its own): set {name}=False")
    return config


def _gpu_connector_class() -> type:
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class StagingRowsConnector(GPUConnectorInterface):
        """Copies between memory objects ([2, L, chunk, H] uint8) and the staging rows given
        as ``staging`` ([n, L, block_nbytes] uint8); ``slot_mapping[t]`` is token t's
        position in the rows (row = position // chunk)."""

        def __init__(self, num_layers: int, chunk: int, width: int) -> None:
            self.num_layers, self.chunk, self.width = num_layers, chunk, width

        def _row(self, start: int, kwargs: dict) -> torch.Tensor:
            row = kwargs["staging"][int(kwargs["slot_mapping"][start]) // self.chunk]
            # [2, L, chunk, H]: LMCache's axes over the row's [L, 2, chunk, H]
            return row.view(self.num_layers, 2, self.chunk, self.width).transpose(0, 1)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(self._row(start, kwargs))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._row(start, kwargs).copy_(memory_obj.tensor.view(
                2, self.num_layers, self.chunk, self.width))

        def batched_from_gpu(self, memory_objs: list, starts: list[int], ends: list[int],
                             **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs: list, starts: list[int], ends: list[int],
                           **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.width])

    return StagingRowsConnector


def _destroy_at_exit() -> None:
    """Runs in a daemon thread: once the main thread has finished, destroy the LMCache engines
    still open. LMCache's storage manager runs its event loop in a non-daemon thread, which
    would keep an interpreter whose engines were never shut down from exiting."""
    threading.main_thread().join()
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    with _LOCK:
        for instance in list(_OPEN):
            del _OPEN[instance]
            LMCacheEngineBuilder.destroy(instance)


def open_engine(spec: dict[str, Any], layout: CacheLayout) -> Any:
    """The LMCache engine of ``spec["instance_id"]`` for this worker (created, or shared with
    another pagedllm engine of this process that named the same instance id)."""
    import_lmcache()
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.metadata import LMCacheMetadata

    bs = spec["block_size"]
    if layout.block_nbytes % (2 * bs):
        raise ValueError(f"LMCacheConnector needs K/V blocks of whole tokens: block_nbytes="
                         f"{layout.block_nbytes} is not a multiple of 2 * block_size={bs}")
    width = layout.block_nbytes // (2 * bs)
    world = spec["world_size"]
    metadata = LMCacheMetadata(
        model_name=spec["model_name"], world_size=world, local_world_size=world,
        worker_id=layout.rank, local_worker_id=layout.rank, kv_dtype=torch.uint8,
        kv_shape=(layout.num_layers, 2, bs, 1, width), chunk_size=bs, role="worker")
    instance = spec["instance_id"]
    with _LOCK:
        engine = LMCacheEngineBuilder.get_or_create(
            instance, lmcache_config(spec), metadata,
            _gpu_connector_class()(layout.num_layers, bs, width), None, None)
        engine.post_init()
        if not _OPEN and not any(t.name == EXIT_WATCHER for t in threading.enumerate()):
            threading.Thread(target=_destroy_at_exit, name=EXIT_WATCHER, daemon=True).start()
        _OPEN[instance] = _OPEN.get(instance, 0) + 1
    return engine


def close_engine(instance: str) -> None:
    """One pagedllm worker lets go of ``instance``; the last one destroys it."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    with _LOCK:
        if instance not in _OPEN:  # destroyed at exit already
            return
        _OPEN[instance] -= 1
        if _OPEN[instance]:
            return
        del _OPEN[instance]
        LMCacheEngineBuilder.destroy(instance)


class LMCacheStore(BlockStore):
    """Blocks by content key in an LMCache engine (slots are keys; LMCache sizes and evicts)."""

    def __init__(self, spec: dict[str, Any], layout: CacheLayout) -> None:
        self.name = STORE
        self.num_slots = 0  # keyed by content; LMCache's backends hold what they hold
        self.instance = spec["instance_id"]
        self.block_size = spec["block_size"]
        self.timeout_s = float(spec["put_timeout_s"])
        self.engine = open_engine(spec, layout)
        self._closed = False

    def _chunks(self, keys: list[Any]) -> tuple[list[int], list[int], list[int]]:
        n, bs = len(keys), self.block_size
        return [chunk_hash(k) for k in keys], [bs] * n, list(range(n * bs))

    def write(self, slots: list[Slot], rows: torch.Tensor) -> None:
        hashes, offsets, positions = self._chunks(slots)
        self.engine.store(hashes=hashes, offsets=offsets, slot_mapping=positions, staging=rows)
        self._wait_puts(hashes, offsets)

    def _wait_puts(self, hashes: list[int], offsets: list[int]) -> None:
        """Until LMCache's asynchronous puts of these chunks (disk, remote) have landed, so a
        consumer that looks for them once the request's output is out finds them."""
        keys = [k for _, _, k in self.engine.token_database.process_tokens(
            hashes=hashes, offsets=offsets)]
        backends = list(self.engine.storage_manager.storage_backends.values())
        deadline = time.monotonic() + self.timeout_s
        while any(b.exists_in_put_tasks(k) for b in backends for k in keys):
            if time.monotonic() > deadline:
                logger.warning("LMCache puts of %d blocks still pending after %.1f s",
                               len(keys), self.timeout_s)
                return
            time.sleep(PUT_POLL_S)

    def read(self, slots: list[Slot], out: torch.Tensor) -> None:
        hashes, offsets, positions = self._chunks(slots)
        keys = [k for _, _, k in self.engine.token_database.process_tokens(
            hashes=hashes, offsets=offsets)]
        bs = self.block_size
        manager = self.engine.storage_manager
        # location -> [(key, start, end)]: the prefix of ``keys`` each backend holds
        mapping = manager.get_block_mapping([(k, i * bs, (i + 1) * bs)
                                             for i, k in enumerate(keys)])
        got: list[tuple[int, Any]] = []
        try:
            for location, chunks in mapping.items():
                objs = manager.batched_get([k for k, _, _ in chunks], location=location)
                got += [(start, obj) for (_, start, _), obj in zip(chunks, objs)
                        if obj is not None]
            found = [obj for _, obj in got]
            self.engine.gpu_connector.batched_to_gpu(
                found, [s for s, _ in got], [s + bs for s, _ in got],
                staging=out, slot_mapping=positions)
        finally:
            for _, obj in got:
                obj.ref_count_down()
        if len(got) < len(keys):
            raise ValueError(f"LMCache holds {len(got)} of the {len(keys)} blocks asked for "
                             "(evicted since the lookup, or unreadable)")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            close_engine(self.instance)


class LMCacheWorker(KVConnectorWorker):
    def __init__(self, config: Any, spec: dict[str, Any], layout: CacheLayout) -> None:
        super().__init__(config, spec, layout)
        self.stores[STORE] = LMCacheStore(spec, layout)


class LMCacheLookup:
    """The scheduler side's view of its worker's LMCache engine (the same process): whether a
    block is held, and LMCache's lookup pins (a pinned chunk is not evicted)."""

    def __init__(self, instance: str, block_size: int) -> None:
        import_lmcache()
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        self.engine = LMCacheEngineBuilder.get(instance)
        if self.engine is None:
            raise ValueError(
                f"LMCacheConnector found no LMCache engine {instance!r} in the engine's "
                "process: its worker runs in another process (tensor_parallel_size or "
                "pipeline_parallel_size > 1; distributed_executor_backend 'mp' or 'ray'; or "
                "a cpu worker run apart because torch was imported before pagedllm with "
                "neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT set: import pagedllm first or set "
                "one). LMCacheConnector runs with one worker in the engine's process")
        self.offsets = [block_size]

    def contains(self, key: bytes) -> bool:
        return self.engine.lookup(hashes=[chunk_hash(key)], offsets=self.offsets) > 0

    def pin(self, key: bytes) -> None:
        self.engine.lookup(hashes=[chunk_hash(key)], offsets=self.offsets,
                           lookup_id=key.hex(), pin=True)

    def unpin(self, key: bytes) -> None:
        self.engine.lookup_unpin(key.hex())

    def num_pins(self) -> int:
        return sum(1 for pins in self.engine.lookup_pins.values() if pins)


def open_lookup(instance: str, block_size: int) -> LMCacheLookup:
    return LMCacheLookup(instance, block_size)
