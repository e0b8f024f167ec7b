"""KVOffloadConfig: the sizes of the KV offload tiers (engine arguments ``kv_offload_size``,
``kv_offload_disk``, ``kv_offload_disk_size``). Plain data; no torch here."""
from __future__ import annotations

import os
from dataclasses import dataclass

# the disk tier's size when a folder is given without one
DEFAULT_DISK_GIB = 4.0


@dataclass
class KVOffloadConfig:
    """Host-memory tier of ``size_gib`` GiB (0: none) above an optional disk tier of
    ``disk_size_gib`` GiB in the folder ``disk_path``."""

    size_gib: float = 0.0
    disk_path: str | None = None
    disk_size_gib: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size_gib, (int, float)) or self.size_gib < 0:
            raise ValueError(f"kv_offload_size={self.size_gib!r} is invalid: must be a number "
                             "of GiB >= 0 (0: no host-memory tier)")
        if self.disk_size_gib is not None and (not isinstance(self.disk_size_gib, (int, float))
                                               or self.disk_size_gib <= 0):
            raise ValueError(f"kv_offload_disk_size={self.disk_size_gib!r} is invalid: must be "
                             "a number of GiB > 0")
        if self.disk_path is None:
            if self.disk_size_gib is not None:
                raise ValueError(f"kv_offload_disk_size={self.disk_size_gib!r} needs "
                                 "kv_offload_disk, the folder the disk tier lives in")
            return
        path = os.path.expanduser(str(self.disk_path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"kv_offload_disk={self.disk_path!r} is invalid: it is a file; "
                             "give a folder (created if missing)")
        self.disk_path = path
        if self.disk_size_gib is None:
            self.disk_size_gib = DEFAULT_DISK_GIB

    @property
    def enabled(self) -> bool:
        return self.size_gib > 0 or self.disk_path is not None

    @classmethod
    def from_args(cls, size_gib: float | None, disk_path: str | None,
                  disk_size_gib: float | None) -> KVOffloadConfig | None:
        """The config of the engine arguments, None when they ask for no tier."""
        config = cls(float(size_gib or 0.0), disk_path, disk_size_gib)
        return config if config.enabled else None
