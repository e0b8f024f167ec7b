"""Where the C++/CUDA kernel sources are and where their JIT builds go; shared by the cuda and cpu
backends (cuda/ops.py builds csrc/, cpu/kernels.py builds csrc/cpu/).

Sources: pagedllm/_csrc in a regular install (setup.py ships csrc/ there as package data),
csrc/ next to the package in a repository checkout or editable install. Builds:
$PAGEDLLM_CACHE_DIR (default ~/.cache/pagedllm/kernels)/<hash>, where the hash covers the torch
version, the build target, the compile flags and every source file's name and bytes, so a change
to any of them builds anew and unchanged inputs load the earlier build: ``jit_load`` loads a
library found there as it is, without asking ninja, whose timestamp check would rebuild
everything for sources that were copied (fresh mtimes, same bytes), e.g. onto a new machine
together with the cache.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from pagedllm import envs

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../pagedllm


def csrc_dir() -> Path | None:
    """Kernel sources: pagedllm/_csrc (non-editable install) or pagedllm/../csrc (repository)."""
    for candidate in (PACKAGE_DIR / "_csrc", PACKAGE_DIR.parent / "csrc"):
        if (candidate / "setup_ext.py").is_file():
            return candidate
    return None


def cache_root() -> Path:
    default = Path.home() / ".cache" / "pagedllm" / "kernels"
    return Path(envs.PAGEDLLM_CACHE_DIR or default)


def build_directory(files: Sequence[str], target: str, flags: dict[str, list[str]]) -> Path:
    """The (created) build directory of `files` compiled for `target` with `flags`."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__}|{target}|{sorted(flags.items())}".encode())
    for name in files:
        digest.update(Path(name).name.encode())
        digest.update(Path(name).read_bytes())
    path = cache_root() / digest.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def jit_load(name: str, sources: Sequence[str], build_dir: Path, is_python_module: bool = True,
             *, build_time: str = "", **build_kwargs: Any) -> ModuleType | None:
    """The library ``name`` from ``build_dir`` (a ``build_directory``): loaded as it is when an
    earlier build left it there, else built with torch.utils.cpp_extension.load(**build_kwargs),
    logged as a build taking ``build_time`` (only then). Returns the module (is_python_module) or
    None (a library of torch ops, now registered)."""
    library = build_dir / f"{name}.so"
    if library.is_file():
        try:
            return _load_library(name, library, is_python_module)
        except (ImportError, OSError) as exc:  # e.g. a build killed while linking
            logger.warning("rebuilding %s: the library in %s does not load (%s)", name, build_dir,
                           exc)
    from torch.utils.cpp_extension import load

    logger.info("building %s in %s (once; later runs load it from there%s)", name, build_dir,
                f"; takes {build_time}" if build_time else "")
    return load(name=name, sources=list(sources), build_directory=str(build_dir),
                is_python_module=is_python_module, **build_kwargs)


def _load_library(name: str, library: Path, is_python_module: bool) -> ModuleType | None:
    if not is_python_module:
        import torch

        torch.ops.load_library(str(library))
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
