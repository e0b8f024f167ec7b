#!/usr/bin/env bash
# CI leg "cuda-emu": the v2 conformance suite against the cuda backend's kernels run on the CPU.
#
# tests/backends/cuda_emu/pagedllm_cuda_emu is the cuda backend (same capabilities, same
# attention and cache-op code) with its csrc/ launchers compiled for the CPU by the SIMT
# emulator (tests/kernels/emu_ops.py, g++, ~20 s once, cached under ~/.cache/pagedllm/emu) and
# its Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1). The backend is registered
# for this leg only: an entry point (a dist-info directory, what pip would write) goes on
# PYTHONPATH, so the main environment's `--device auto` never sees it.
#
# The emulator takes seconds per attention call, so the sweep is sampled
# (--conformance-sample: each check keeps a few cases, every declared head size, GQA group,
# block size and dtype still runs at least once). Engine-level checks (HF equality through the
# worker, CUDA graphs, async output, TP) need a GPU and are reported SKIPPED with the reason.
# Env: PAGEDLLM_CI_REPORTS (writes cuda-emu.json there), PAGEDLLM_CUDA_EMU_SAMPLE (default 2),
# PYTHON (python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
SAMPLE="${PAGEDLLM_CUDA_EMU_SAMPLE:-2}"
command -v g++ > /dev/null || { echo "cuda-emu: g++ is needed to build the SIMT emulator" >&2; exit 1; }
"$PY" -c "import triton" 2> /dev/null || {
  echo "cuda-emu: triton is not importable (pip install triton; the Triton kernels run in its interpreter)" >&2
  exit 1
}

EP_DIR="$(mktemp -d)"
trap 'rm -rf "$EP_DIR"' EXIT
DIST="$EP_DIR/pagedllm_cuda_emu-0.1.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: pagedllm-cuda-emu\nVersion: 0.1\n' > "$DIST/METADATA"
printf '[pagedllm.backends]\ncuda-emu = pagedllm_cuda_emu.backend:CudaEmuBackend\n' \
  > "$DIST/entry_points.txt"

cd "$ROOT"
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$EP_DIR:$ROOT/tests/backends/cuda_emu${PYTHONPATH:+:$PYTHONPATH}"
echo "cuda-emu: building/loading the SIMT emulator"
"$PY" -c "import sys; sys.path.insert(0, 'tests/kernels'); import emu_ops; emu_ops.reset(0)"

"$PY" -m pytest -q -p no:cacheprovider --pyargs pagedllm.testing --device cuda-emu \
  --conformance-sample "$SAMPLE" \
  ${PAGEDLLM_CI_REPORTS:+--conformance-report "$PAGEDLLM_CI_REPORTS/cuda-emu.json"}
