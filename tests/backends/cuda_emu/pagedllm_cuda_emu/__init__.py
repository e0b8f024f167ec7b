"""cuda-emu: the cuda backend's kernels run on the CPU through the SIMT emulator (a CI leg)."""
