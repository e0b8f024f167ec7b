"""KV connectors by name: the built-ins and the entry-point group "pagedllm.kv_connectors"
(an installed package maps a name to a ``KVConnector`` subclass, ``"module:Class"``), found as
backends are found. ``kv_transfer_config.kv_connector`` names one."""
from __future__ import annotations

import logging
from importlib.metadata import entry_points

from pagedllm.contract.registry import load_class
from pagedllm.kv_transfer.base import KVConnector

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pagedllm.kv_connectors"
BUILTIN_CONNECTORS = {
    # the KV offload tiers (host memory, disk): kv_offload_size / kv_offload_disk
    "OffloadingConnector": "pagedllm.kv_offload.manager:OffloadingConnector",
    # between engine processes on one host, through files in shared memory or a folder
    "SharedStorageConnector": "pagedllm.kv_transfer.shared_storage:SharedStorageConnector",
    # between two engine processes (one host or two) through torch.distributed: gloo + TCPStore
    "P2pConnector": "pagedllm.kv_transfer.p2p:P2pConnector",
    "PyNcclConnector": "pagedllm.kv_transfer.p2p:P2pConnector",  # vLLM's name for it
    # blocks kept by LMCache (pip install lmcache): its CPU, disk and shared backends
    "LMCacheConnector": "pagedllm.kv_transfer.lmcache:LMCacheConnector",
    "LMCacheConnectorV1": "pagedllm.kv_transfer.lmcache:LMCacheConnector",  # vLLM v1's name
}


def connector_names() -> dict[str, str]:
    """Every known connector name -> where it comes from ("built-in" or the package)."""
    names = dict.fromkeys(BUILTIN_CONNECTORS, "built-in")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.dist.name if ep.dist is not None else ep.value)
    return names


def resolve_connector(name: str) -> type[KVConnector]:
    """The connector class registered under ``name``; ValueError naming the known ones."""
    if name in BUILTIN_CONNECTORS:
        return load_class(BUILTIN_CONNECTORS[name])
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
                raise TypeError(f"KV connector entry point {name!r} ({ep.value}) is not a "
                                "pagedllm.kv_transfer.base.KVConnector subclass")
            return cls
    raise ValueError(f"kv_transfer_config.kv_connector={name!r} is not a known KV connector; "
                     f"known: {', '.join(connector_names())}")
