#!/usr/bin/env bash
# The decode kernel's two tuning constants, measured side by side on the GPU machine:
# partition size (tokens per thread block) and warps per block. Each variant is JIT-built into its
# own cache directory (PAGEDLLM_KERNEL_FLAGS is part of the build hash) and timed with
# gpu_kernel_check.py, which also spot-checks its output against torch.
#
#   bash benchmarks/decode_kernel_variants.sh [FLAGS ...]   # default: the four variants below
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PAGEDLLM_CACHE_DIR="${PAGEDLLM_CACHE_DIR:-$PWD/.carry/pc}"
VARIANTS=("$@")
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(
  "-DPAGEDLLM_PARTITION_SIZE=512 -DPAGEDLLM_ATTN_WARPS=4"
  "-DPAGEDLLM_PARTITION_SIZE=256 -DPAGEDLLM_ATTN_WARPS=4"
  "-DPAGEDLLM_PARTITION_SIZE=1024 -DPAGEDLLM_ATTN_WARPS=4"
  "-DPAGEDLLM_PARTITION_SIZE=512 -DPAGEDLLM_ATTN_WARPS=8")
for flags in "${VARIANTS[@]}"; do
  echo "=== $flags"
  PAGEDLLM_KERNEL_FLAGS="$flags" python benchmarks/gpu_kernel_check.py 2>&1 | grep -E "^\(b\)|^ +[0-9]+ +[0-9]+ " 
done
