"""Old import path of the backend registry: re-exports ``pagedllm.contract.registry`` (where new
code imports from)."""
from pagedllm.contract.backend import Backend
from pagedllm.contract.registry import (AUTO_ORDER, BUILTIN_BACKENDS, ENTRY_POINT_GROUP,
                                        BackendInfo, _builtin_present, _check_plugin, _describe,
                                        _plugin_filter, discover, is_backend_class, load_class,
                                        resolve_backend)
from pagedllm.contract.version import PLUGIN_API_VERSION, api_incompatibility
from pagedllm.contract.version import parse_version as _version

_load = load_class

__all__ = ["AUTO_ORDER", "BUILTIN_BACKENDS", "ENTRY_POINT_GROUP", "PLUGIN_API_VERSION", "Backend",
           "BackendInfo", "api_incompatibility", "discover", "is_backend_class", "load_class",
           "resolve_backend"]
