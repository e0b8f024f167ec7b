"""Where the C++/CUDA kernel sources are and where their JIT builds go; shared by the cuda and cpu
backends (cuda/ops.py builds csrc/, cpu/kernels.py builds csrc/cpu/).

Sources: pagedllm/_csrc in a regular install (setup.py ships csrc/ there as package data),
csrc/ next to the package in a repository checkout or editable install. Builds:
$PAGEDLLM_CACHE_DIR (default ~/.cache/pagedllm/kernels)/<hash>, where the hash covers the torch
version, the build target, the compile flags and every source file's name and bytes, so a change
to any of them builds anew and unchanged inputs load the earlier build.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../pagedllm


def csrc_dir() -> Path | None:
    """Kernel sources: pagedllm/_csrc (non-editable install) or pagedllm/../csrc (repository)."""
    for candidate in (PACKAGE_DIR / "_csrc", PACKAGE_DIR.parent / "csrc"):
        if (candidate / "setup_ext.py").is_file():
            return candidate
    return None


def cache_root() -> Path:
    default = Path.home() / ".cache" / "pagedllm" / "kernels"
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or default)


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
