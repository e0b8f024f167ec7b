"""Kernel backends for tests/kernels.

cuda_ops: the real extension (pagedllm.backends.cuda.ops, built on first use); skipped without a GPU.
emu_ops:  the same csrc/ kernels compiled for the CPU with the SIMT emulator (tests/kernels/emu_ops.py);
          runs anywhere g++ exists, so the kernel code is exercised on CPU-only CI too.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

# Helpers of this directory (kernel_reference, emu_ops) are imported by plain name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def cuda_ops() -> ModuleType:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device (torch.cuda.is_available() is False)")
    from pagedllm.backends.cuda import ops

    ok, reason = ops.kernels_available(build=True)
    if not ok:
        pytest.fail(f"a GPU is present but the kernels are unavailable: {reason}")
    return ops


@pytest.fixture(scope="session")
def emu_ops() -> ModuleType:
    import emu_ops as emu

    ok, reason = emu.emulator_available()
    if not ok:
        pytest.skip(f"SIMT emulator unavailable: {reason}")
    emu.reset(seed=1234)
    return emu
