"""Old import path of the plugin contract (plugin API 1.0-2.0): re-exports ``pagedllm.contract``.

New code imports from ``pagedllm.contract.backend``, ``.capabilities``, ``.cache_ops``,
``.attention`` and ``.registry``; this module keeps plugins written against it running.
"""
from pagedllm.contract.attention import AttentionImpl, AttentionMetadata
from pagedllm.contract.backend import Backend
from pagedllm.contract.cache_ops import CacheOps, as_bytes
from pagedllm.contract.capabilities import Capabilities
from pagedllm.contract.registry import BackendInfo

__all__ = ["AttentionImpl", "AttentionMetadata", "Backend", "BackendInfo", "CacheOps",
           "Capabilities", "as_bytes"]
