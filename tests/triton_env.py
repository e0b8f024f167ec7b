"""The Triton kernel tests' device: the GPU when there is one, else Triton's interpreter on the
CPU (TRITON_INTERPRET=1, set before triton is first imported). Call ``triton_device()`` at module
level before importing a kernel: it skips the module without triton, or on a CPU where the
interpreter was turned off."""
from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> str:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)
    return device
