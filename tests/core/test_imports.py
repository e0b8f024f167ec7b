"""core/ is device-free, and importing pagedllm pulls in no vendor SDK."""
from __future__ import annotations

import subprocess
import sys

VENDOR_SDKS = ("torch_xla", "habana_frameworks", "intel_extension_for_pytorch")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_core_imports_no_torch() -> None:
    mods = _modules_after("import pagedllm.core.scheduler, pagedllm.core.block_manager, "
                          "pagedllm.core.sequence, pagedllm.core.batch, pagedllm.config")
    assert "torch" not in mods


def test_import_pagedllm_is_light_and_vendor_free() -> None:
    mods = _modules_after("import pagedllm; from pagedllm import SamplingParams")
    assert "torch" not in mods
    mods = _modules_after("from pagedllm.backends.registry import discover; discover()")
    assert not [m for m in mods if m.split(".")[0] in VENDOR_SDKS]
