"""The plugin contract: what a hardware backend implements and what the engine asks of it.

A layer of its own: these modules import only ``pagedllm.config`` (and ``pagedllm.envs``, the
environment table), torch and each other, never the engine, the worker, the models or a backend
(tests/test_layers.py checks it). Implementations
(the built-in backends, out-of-tree plugins, the reference room ``pagedllm.reference``) import
the contract; the engine consults a backend's capabilities as data.

  version.py       PLUGIN_API_VERSION, compatibility of a plugin's stated version, deprecations
  capabilities.py  Capabilities: what a backend declares it can do
  attention.py     AttentionImpl (paged attention template) and AttentionMetadata
  cache_ops.py     CacheOps: block copy and swap (a reference implementation for any layout)
  ops.py           the op table's spec: the ops a backend may replace and their signatures
  quantization.py  quantization method names and the quantized linear's canonical layout
  backend.py       Backend: identity, availability, capabilities, the parts it names
  registry.py      finds backends (built-in and entry points) and resolves ``--device``
  manifest.json    every public member, its signature and the version it appeared in

The old import paths (``pagedllm.backends.interface``, ``.attention``, ``.registry`` and
``pagedllm.backends.PLUGIN_API_VERSION``) re-export these names and keep working.
"""
from pagedllm.contract.version import PLUGIN_API_VERSION

__all__ = ["PLUGIN_API_VERSION"]
