"""LMCacheConnector (alias LMCacheConnectorV1, vLLM's names): KV blocks kept by LMCache
(https://github.com/LMCache/LMCache, ``pip install lmcache``) in its storage backends: local
CPU memory, local disk, or a store several engines share (``remote_url`` such as
``fs:///shared/folder`` or ``lm://host:port``). The scheduler side is here (no torch, no
lmcache at import); the worker side is lmcache_worker.py.

    LLM(model, kv_transfer_config={"kv_connector": "LMCacheConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.local_cpu": True,
                                      "lmcache.max_local_cpu_size": 5.0,
                                      "lmcache.remote_url": "fs:///mnt/kv"}})

Configuration as vLLM's LMCache connector takes it: the file named by ``LMCACHE_CONFIG_FILE``
(or the extra key ``lmcache_config_file``), then ``LMCACHE_*`` environment variables, then the
extra keys ``lmcache.<name>`` (any LMCache config field). ``chunk_size`` is the engine's
``block_size`` (one block per chunk). ``lmcache.lmcache_instance_id`` names the LMCache engine:
two pagedllm engines of one process that name the same one share it (its CPU and disk
backends); by default each engine has its own.

Roles: a producer ("kv_producer", "kv_both") stores every block its prefix cache gains that
LMCache does not hold yet, once the step that computed it has run, and waits for LMCache's
asynchronous puts before the request's output returns; a consumer ("kv_consumer", "kv_both")
loads the blocks of a prompt LMCache holds instead of computing them. Blocks are looked up by
their content keys; LMCache evicts by its own policy, so a block gone between lookup and load
(or unreadable) is computed instead, counted. The LMCache engine lives in the worker, which
must run in the engine's process (one worker: tensor and pipeline parallel size 1).
"""
from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

from pagedllm.kv_transfer.base import Key, KVStepOps, RemoteStoreConnector, Slot

logger = logging.getLogger(__name__)

STORE = "lmcache"
PREFIX = "lmcache."
EXTRA_KEYS = {"lmcache_config_file": None, "put_timeout_s": 30.0}
# LMCache settings the connector decides itself, or that change what a block is
OWNED = ("chunk_size",)
UNSUPPORTED = ("use_layerwise", "enable_blending", "enable_pd")


def lmcache_settings(config: Any) -> dict[str, Any]:
    """The worker's spec from the engine config: the LMCache overrides (``lmcache.<name>``
    extra keys), the config file, the instance id; ValueError names a bad key and its value."""
    transfer = config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config)
    pre = "kv_transfer_config.kv_connector_extra_config"
    unknown = sorted(k for k in extra if k not in EXTRA_KEYS and not k.startswith(PREFIX))
    if unknown:
        raise ValueError(f"{pre} has unknown key(s) {', '.join(unknown)} for LMCacheConnector; "
                         f"known: {', '.join(EXTRA_KEYS)} and {PREFIX}<name> for any LMCache "
                         "config field (e.g. lmcache.max_local_cpu_size)")
    overrides = {k[len(PREFIX):]: v for k, v in extra.items() if k.startswith(PREFIX)}
    block_size = config.cache.block_size
    for name in OWNED:
        if name in overrides and overrides[name] != block_size:
            raise ValueError(f"{pre}['{PREFIX}{name}']={overrides[name]!r} is invalid: "
                             "LMCacheConnector keeps one block per LMCache chunk, so it is "
                             f"the block size ({block_size}); leave it out")
    for name in UNSUPPORTED:
        if overrides.get(name):
            raise ValueError(f"{pre}['{PREFIX}{name}']={overrides[name]!r} is not supported by "
                             "LMCacheConnector (whole blocks between engines of its own); "
                             "allowed: false")
    timeout = extra.get("put_timeout_s", EXTRA_KEYS["put_timeout_s"])
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{pre}['put_timeout_s']={timeout!r} is invalid: seconds > 0 to wait "
                         "for LMCache's asynchronous puts of a producer's blocks")
    # the scheduler side finds its worker's LMCache engine by this id (same process)
    instance = str(overrides.pop("lmcache_instance_id", None)
                   or f"pagedllm-{os.getpid()}-{id(transfer):x}")
    parallel = config.parallel
    return {"instance_id": instance, "overrides": overrides,
            "config_file": extra.get("lmcache_config_file"),
            "block_size": block_size, "put_timeout_s": float(timeout),
            "model_name": os.path.basename(os.path.normpath(str(config.model.model))),
            "world_size": parallel.tensor_parallel_size * parallel.pipeline_parallel_size}


class LMCacheConnector(RemoteStoreConnector):
    name: ClassVar[str] = "LMCacheConnector"
    worker_class: ClassVar[str] = "pagedllm.kv_transfer.lmcache_worker:LMCacheWorker"

    def __init__(self, config: Any, slots: dict[str, int]) -> None:
        super().__init__(config, slots)
        from pagedllm.kv_transfer.lmcache_worker import open_lookup

        transfer = config.kv_transfer_config
        spec = lmcache_settings(config)
        self.instance = spec["instance_id"]
        self.producer, self.consumer = transfer.is_producer, transfer.is_consumer
        self.lookup = open_lookup(self.instance, spec["block_size"])
        self._pinned: set[Key] = set()

    @classmethod
    def worker_spec(cls, config: Any) -> dict[str, Any]:
        return lmcache_settings(config)

    # --- lookups ------------------------------------------------------------------------
    def locate(self, key: Key) -> tuple[str, Slot] | None:
        if self.consumer and not self.is_broken(key) and self.lookup.contains(key):
            return STORE, key
        return None

    def pin(self, key: Key) -> None:
        self.lookup.pin(key)  # type: ignore[arg-type]
        self._pinned.add(key)

    def unpin(self, key: Key, store: str) -> None:
        self._pinned.discard(key)
        self.lookup.unpin(key)  # type: ignore[arg-type]

    # --- saves --------------------------------------------------------------------------
    def on_computed(self, block: int, key: Key, ops: KVStepOps) -> None:
        # LMCache is asked every time (it may have evicted a block saved before); a save
        # still in flight may be repeated, which LMCache's put skips
        if not self.producer:
            return
        self.forget_broken(key)
        if self.lookup.contains(key):  # type: ignore[arg-type]
            return
        ops.stores.append(("save", STORE, block, key))
        self.counters["saved"] += 1

    # --- bookkeeping --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {STORE: {"instance": self.instance, **self.counters}}

    def check_idle(self) -> list[str]:
        problems = []
        if self._pinned:
            problems.append(f"LMCacheConnector: {len(self._pinned)} keys still pinned")
        pins = self.lookup.num_pins()
        if pins:
            problems.append(f"LMCacheConnector: LMCache holds {pins} lookup pins")
        return problems
