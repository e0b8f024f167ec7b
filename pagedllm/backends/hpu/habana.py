"""The only module that calls into habana_frameworks (Intel Gaudi's PyTorch bridge).

Everything else in the hpu backend is plain torch and runs anywhere; these wrappers import the
SDK on first use. With a CPU device (tests emulate the backend on the host) they do nothing.
"""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "it ships with the Intel Gaudi software stack (habana-torch-plugin)"


def is_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def device_count() -> int:
    import habana_frameworks.torch.hpu as hthpu

    return hthpu.device_count() if hthpu.is_available() else 0


def device_name() -> str:
    import habana_frameworks.torch.hpu as hthpu

    return str(hthpu.get_device_name())


def lazy_mode() -> bool:
    """Gaudi's lazy mode (PT_HPU_LAZY_MODE=1, the default): ops queue up until mark_step."""
    return os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"


def mark_step(device: torch.device) -> None:
    """End a lazy-mode graph: what was queued is compiled (once per shape) and launched."""
    if device.type == "hpu" and lazy_mode():
        import habana_frameworks.torch.core as htcore

        htcore.mark_step()


def records_graphs(device: torch.device) -> bool:
    """Whether ``wrap_in_hpu_graph`` records graphs on ``device`` (a Gaudi; not a CPU stand-in)."""
    return device.type == "hpu"


def wrap_in_hpu_graph(module: Any, device: torch.device) -> Any:
    """Record the module's launches as an HPU graph per input shape and replay them."""
    if device.type != "hpu":
        return module
    from habana_frameworks.torch.hpu import wrap_in_hpu_graph as wrap

    return wrap(module, disable_tensor_cache=True)


def memory_limit_and_peak(device: torch.device) -> tuple[int, int]:
    """(bytes the device may hold, peak bytes used so far)."""
    import habana_frameworks.torch.hpu as hthpu

    stats = hthpu.memory_stats(device)
    return int(stats["Limit"]), int(stats["MaxInUse"])


def synchronize() -> None:
    import habana_frameworks.torch.hpu as hthpu

    hthpu.synchronize()
