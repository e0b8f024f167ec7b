"""Memory as a check sees it (issue 41, item 2): host RSS, the device allocator's live bytes, and
the tensors Python still holds, snapshotted around repeated work.

A leak that keeps tensors reachable from Python (a list of staging buffers, every step's logits)
shows in ``live_tensors`` exactly, whatever its size; one in native code shows in the host RSS
(or the device allocator's count on devices that have one: ``torch.<device>.memory_allocated``).
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

MiB = 1 << 20


def host_rss() -> int:
    """Resident bytes of this process now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_allocated(device: torch.device) -> int | None:
    """Live bytes of the device's allocator (cuda, xpu, ...), None where it has none."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    fn = getattr(module, "memory_allocated", None)
    if not callable(fn):
        return None
    try:
        return int(fn(device))
    except (RuntimeError, TypeError, ValueError):
        return None


def live_tensors() -> tuple[int, int]:
    """(count, bytes) of the tensors reachable from Python after a full collection; bytes count
    each storage once."""
    gc.collect()
    count, seen, nbytes = 0, set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        count += 1
        try:
            storage = obj.untyped_storage()
            key = (storage.device.type, storage.data_ptr())
        except (RuntimeError, NotImplementedError):  # meta / functional tensors
            continue
        if key not in seen:
            seen.add(key)
            nbytes += storage.nbytes()
    return count, nbytes


@dataclass
class Snapshot:
    rss: int
    device: int | None
    tensors: int
    tensor_bytes: int

    @staticmethod
    def take(device: torch.device) -> Snapshot:
        count, nbytes = live_tensors()
        return Snapshot(host_rss(), device_allocated(device), count, nbytes)


def assert_flat(before: Snapshot, after: Snapshot, what: str, *, rss_slack: int = 24 * MiB,
                tensor_slack: int = 4, device_slack: int = 1 * MiB) -> dict[str, int]:
    """``after`` (more repetitions of the same work) holds no more than ``before``: live tensors
    within ``tensor_slack`` (and no more bytes than one of them could add), the device allocator
    within ``device_slack``, host RSS within ``rss_slack``. Returns the growths, for the report."""
    growth = {"tensors": after.tensors - before.tensors,
              "tensor_bytes": after.tensor_bytes - before.tensor_bytes,
              "rss_bytes": after.rss - before.rss}
    if before.device is not None and after.device is not None:
        growth["device_bytes"] = after.device - before.device
    problems = []
    if growth["tensors"] > tensor_slack or growth["tensor_bytes"] > device_slack:
        problems.append(f"{growth['tensors']} more live tensors ({growth['tensor_bytes'] / MiB:.1f}"
                        " MiB)")
    if growth.get("device_bytes", 0) > device_slack:
        problems.append(f"device allocator +{growth['device_bytes'] / MiB:.1f} MiB")
    if growth["rss_bytes"] > rss_slack:
        problems.append(f"host RSS +{growth['rss_bytes'] / MiB:.1f} MiB "
                        f"(allowed {rss_slack / MiB:.0f})")
    if problems:
        raise AssertionError(f"{what}: memory grows with repetitions: {'; '.join(problems)}")
    return growth
