"""Hardware backends: the built-in plugins (cpu/, cuda/, rocm/, tpu/, xpu/, hpu/).

The plugin contract they implement is ``pagedllm.contract``. ``interface.py``, ``attention.py``,
``registry.py`` and ``PLUGIN_API_VERSION`` here are its old import paths, kept for plugins
written against them (docs/porting.md, "Compatibility promise").
"""
from pagedllm.contract.version import PLUGIN_API_VERSION

__all__ = ["PLUGIN_API_VERSION"]
