"""Finds backends (built-in and entry-point plugins) and resolves ``--device``.

It sits below ``backend.py`` in the contract (the base class's config check asks it which
backends declare a quantization method), so it knows a backend class by the qualified name of
its base, ``BACKEND_BASE``, rather than by importing it.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from pagedllm import envs
from pagedllm.contract.version import PLUGIN_API_VERSION, api_incompatibility

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pagedllm.backends"

# name -> "module:Class"; imported only when the backend is looked at
BUILTIN_BACKENDS: dict[str, str] = {
    "cuda": "pagedllm.backends.cuda.backend:CudaBackend",
    "rocm": "pagedllm.backends.rocm.backend:RocmBackend",
    "tpu": "pagedllm.backends.tpu.backend:TpuBackend",
    "xpu": "pagedllm.backends.xpu.backend:XpuBackend",
    "hpu": "pagedllm.backends.hpu.backend:HpuBackend",
    "cpu": "pagedllm.backends.cpu.backend:CpuBackend",
}
# --device auto tries these first, then out-of-tree plugins, then cpu
AUTO_ORDER = ("cuda", "rocm", "tpu", "xpu", "hpu")
BACKEND_BASE = "pagedllm.contract.backend.Backend"


@dataclass
class BackendInfo:
    """A registry row: the class, where it came from, and whether it loaded."""

    name: str
    source: str
    cls: type | None = None  # a Backend subclass (is_backend_class)
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def availability(self) -> tuple[bool, str]:
        if self.cls is None:
            if self.error and self.error.startswith("refused"):
                return False, self.error
            return False, f"failed to load: {self.error}"
        try:
            return self.cls.availability()
        except Exception as exc:  # a plugin bug must not break the table
            return False, f"availability() raised {type(exc).__name__}: {exc}"


def load_class(spec: str | type) -> type:
    """A class given as itself or as a "module:Class" string (imported now)."""
    if isinstance(spec, type):
        return spec
    module, sep, name = str(spec).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{spec!r} is not a class or a 'module:Class' string")
    return getattr(importlib.import_module(module), name)



def _builtin_present(target: str) -> bool:
    module = target.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _plugin_filter() -> set[str] | None:
    raw = envs.PAGEDLLM_BACKENDS
    return {n.strip() for n in raw.split(",") if n.strip()} if raw else None


def is_backend_class(cls: object) -> bool:
    """Whether ``cls`` is a subclass of the contract's ``Backend`` (``BACKEND_BASE``)."""
    return isinstance(cls, type) and any(f"{base.__module__}.{base.__qualname__}" == BACKEND_BASE
                                         for base in cls.__mro__)


def _check_plugin(ep_name: str, cls: object, value: str) -> None:
    """An entry point must name a Backend subclass whose ``name`` is the entry point's name."""
    if not is_backend_class(cls):
        raise TypeError(f"{value} is not a pagedllm Backend subclass")
    name = getattr(cls, "name", None)
    if name != ep_name:
        raise ValueError(f"entry point {ep_name!r} loads {cls.__name__} whose Backend.name is "
                         f"{name!r}; the two must be equal (fix the entry point or the class)")


def discover() -> dict[str, BackendInfo]:
    """All known backends by name. Plugins that fail to import are listed with their error.

    Two plugins (or a plugin and a built-in) claiming one name is an error naming both sources.
    ``PAGEDLLM_BACKENDS=a,b`` limits which out-of-tree plugins are loaded.
    """
    infos: dict[str, BackendInfo] = {}
    for name, target in BUILTIN_BACKENDS.items():
        if not _builtin_present(target):
            continue
        try:
            infos[name] = BackendInfo(name, "built-in", load_class(target),
                                      extra={"plugin_api_version": PLUGIN_API_VERSION})
        except Exception as exc:
            infos[name] = BackendInfo(name, "built-in", error=f"{type(exc).__name__}: {exc}")
    allowed = _plugin_filter()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        package = ep.dist.name if ep.dist is not None else ep.value
        if ep.name in infos:
            raise RuntimeError(f"backend name {ep.name!r} is claimed by two packages: "
                               f"{infos[ep.name].source!r} and {package!r}; uninstall one or "
                               f"limit plugins with PAGEDLLM_BACKENDS")
        try:
            cls = ep.load()
            _check_plugin(ep.name, cls, ep.value)
            refused = api_incompatibility(cls.plugin_api_version)
            if refused is not None:
                logger.warning("backend plugin %r from %s: %s", ep.name, package, refused)
                infos[ep.name] = BackendInfo(ep.name, package, error=refused,
                                             extra={"plugin_api_version": cls.plugin_api_version})
                continue
            cls.source = package
            infos[ep.name] = BackendInfo(ep.name, package, cls,
                                         extra={"plugin_api_version": cls.plugin_api_version})
        except Exception as exc:
            logger.warning("backend plugin %r from %s failed to load: %s", ep.name, package, exc)
            infos[ep.name] = BackendInfo(ep.name, package, error=f"{type(exc).__name__}: {exc}")
    return infos


def _describe(infos: dict[str, BackendInfo]) -> str:
    rows = []
    for info in infos.values():
        ok, reason = info.availability()
        rows.append(f"  {info.name}: {'available' if ok else 'unavailable: ' + reason}")
    return "\n".join(rows)


def resolve_backend(device: str = "auto") -> Any:
    """An instance of the backend for ``device`` ("auto" picks the first available one)."""
    infos = discover()
    device = (device or "auto").lower()
    if device == "auto":
        builtin_rest = [n for n in infos if n not in AUTO_ORDER and n != "cpu"]
        for name in (*AUTO_ORDER, *builtin_rest, "cpu"):
            info = infos.get(name)
            if info is not None and info.cls is not None and info.availability()[0]:
                return info.cls()
        raise RuntimeError("no backend is available here:\n" + _describe(infos))
    info = infos.get(device)
    if info is None:
        raise ValueError(f"device={device!r} is not a known backend; known: "
                         f"{', '.join(['auto', *infos])}")
    ok, reason = info.availability()
    if not ok or info.cls is None:
        available = [n for n, i in infos.items() if i.availability()[0]]
        raise RuntimeError(f"device={device!r} is not available: {reason}. "
                           f"Available here: {', '.join(available) or 'none'}")
    return info.cls()
