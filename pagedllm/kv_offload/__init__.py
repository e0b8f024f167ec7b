"""KV offload (issue 45): the prefix cache's blocks below the device, in a host-memory tier
(``kv_offload_size`` GiB) and a disk tier (``kv_offload_disk`` folder, ``kv_offload_disk_size``
GiB). A block evicted from the device cache goes down the tiers under the prefix cache's own
content key (kv_transfer/keys.py: model, dtypes, adapter and the token chain); a prefix hit in a
lower tier is loaded back instead of recomputed, overlapping the step that issues the load.

  config.py   KVOffloadConfig (plain data, any layer may read it)
  tiers.py    one tier's slots: key -> slot, LRU order, pins (no torch)
  manager.py  the offload connector's scheduler side: eviction -> save, demotion, lookups (no torch)
  stores.py   the worker side: the host pool and the disk file a tier's slots live in

The data movement is a KV connector like any other (pagedllm/kv_transfer/): the block manager
sees tiers only through content keys, the worker moves the bytes through the backend's
``CacheOps.export_blocks`` / ``import_blocks`` (``Capabilities.kv_export``). This package's own
__init__ imports nothing.
"""
