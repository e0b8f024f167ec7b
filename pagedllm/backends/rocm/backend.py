"""The rocm backend: the cuda backend's Python and the same csrc/ sources built by hipcc.

What differs is declared here: the platform (torch.version.hip), the wavefront size (64 on
CDNA), and the collective library (RCCL, reached through torch's "nccl" backend name).
"""
from __future__ import annotations

from pagedllm.backends.cuda.backend import CudaBackend


class RocmBackend(CudaBackend):
    name = "rocm"
    platform = "rocm"
    warp_size = 64
    dist_backend = "nccl"  # RCCL implements the NCCL API; torch names it "nccl" on ROCm
