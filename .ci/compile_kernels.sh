#!/usr/bin/env bash
# Compiles every torch-free kernel source (csrc/*.cu) with nvcc (sm_80, sm_90) and hipcc
# (gfx90a, gfx942), no GPU needed, and syntax-checks csrc/torch_bindings.cpp against torch's headers.
# Exits non-zero on any failure; prints one summary line per compiler.
#
# hipcc is installed with apt-get when missing. Debian 12's HIP 5.2 / clang 15 does not know gfx942
# (MI300X, needs LLVM 17+); when the compiler rejects it we compile its predecessor gfx940 instead
# and say so in the summary.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CSRC="$ROOT/csrc"
OUT="$(mktemp -d /tmp/pagedllm-kernels.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT
SOURCES=("$CSRC"/*.cu)
STATUS=0

# ---- nvcc ------------------------------------------------------------------------------------
nvcc_all() {
  local nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
  [[ -x "$nvcc" ]] || { echo "nvcc: not found" > "$OUT/nvcc.summary"; return 1; }
  local failed=0 start=$SECONDS
  for src in "${SOURCES[@]}"; do
    local name; name="$(basename "$src" .cu)"
    if ! "$nvcc" -std=c++17 -O3 --threads 2 \
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
        -Xcompiler -Wall,-Wextra -Werror all-warnings -Xptxas -warn-spills,-warn-lmem-usage \
        -c "$src" -o "$OUT/$name.nvcc.o" > "$OUT/$name.nvcc.log" 2>&1; then
      failed=1
    fi
    if [[ -s "$OUT/$name.nvcc.log" ]]; then sed "s|^|[nvcc $name] |" "$OUT/$name.nvcc.log"; fi
  done
  local verdict=ok; [[ $failed == 0 ]] || verdict=FAILED
  echo "nvcc $("$nvcc" --version | grep -o 'release [0-9.]*'): ${#SOURCES[@]} files for sm_80,sm_90: $verdict ($((SECONDS - start)) s)" > "$OUT/nvcc.summary"
  return $failed
}

# ---- hipcc -----------------------------------------------------------------------------------
ensure_hipcc() {
  command -v hipcc > /dev/null && return 0
  echo "hipcc not found; installing it with apt-get" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc; } > "$OUT/apt.log" 2>&1 \
    || { cat "$OUT/apt.log" >&2; return 1; }
}

hipcc_all() {
  export HIP_PLATFORM=amd
  ensure_hipcc || { echo "hipcc: not available (apt-get install hipcc failed)" > "$OUT/hipcc.summary"; return 1; }
  local archs=(gfx90a gfx942) note=""
  echo '__global__ void probe(float* x) { x[0] = 1.f; }' > "$OUT/probe.hip"
  if ! hipcc -x hip --offload-arch=gfx942 -c "$OUT/probe.hip" -o "$OUT/probe.o" > /dev/null 2>&1; then
    archs=(gfx90a gfx940)
    note=" (this hipcc does not know gfx942; compiled gfx940 instead)"
  fi
  local arch_flags=() failed=0 start=$SECONDS
  for a in "${archs[@]}"; do arch_flags+=("--offload-arch=$a"); done
  for src in "${SOURCES[@]}"; do
    local name; name="$(basename "$src" .cu)"
    if ! hipcc -std=c++17 -O3 -x hip -DUSE_ROCM -Wall -Wextra -Werror "${arch_flags[@]}" \
        -c "$src" -o "$OUT/$name.hip.o" > "$OUT/$name.hip.log" 2>&1; then
      failed=1
    fi
    if [[ -s "$OUT/$name.hip.log" ]]; then sed "s|^|[hipcc $name] |" "$OUT/$name.hip.log"; fi
  done
  local verdict=ok; [[ $failed == 0 ]] || verdict=FAILED
  echo "hipcc $(hipcc --version 2>/dev/null | grep -o 'HIP version: [0-9.]*' | head -1): ${#SOURCES[@]} files for ${archs[*]}: $verdict ($((SECONDS - start)) s)$note" > "$OUT/hipcc.summary"
  return $failed
}

# ---- torch_bindings.cpp syntax check ----------------------------------------------------------
bindings_check() {
  local py="${PYTHON:-python3}"
  local incs
  if ! incs="$("$py" -c 'import sysconfig, torch.utils.cpp_extension as c; print(" ".join(c.include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
    echo "g++ torch_bindings.cpp: skipped (torch not importable)" > "$OUT/gxx.summary"; return 0
  fi
  # A CPU torch lacks this generated header; it only carries build macros.
  mkdir -p "$OUT/stubs/c10/cuda/impl" && echo '#pragma once' > "$OUT/stubs/c10/cuda/impl/cuda_cmake_macros.h"
  local flags=() cuda_inc="${CUDA_HOME:-/usr/local/cuda}/include"
  for d in $incs "$cuda_inc" "$OUT/stubs"; do flags+=(-isystem "$d"); done
  local verdict=ok start=$SECONDS
  if ! g++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -DTORCH_EXTENSION_NAME=_C "${flags[@]}" \
      "$CSRC/torch_bindings.cpp" > "$OUT/gxx.log" 2>&1; then
    verdict=FAILED; sed 's|^|[g++ bindings] |' "$OUT/gxx.log"
  fi
  echo "g++ -fsyntax-only torch_bindings.cpp: $verdict ($((SECONDS - start)) s)" > "$OUT/gxx.summary"
  [[ $verdict == ok ]]
}

# The machine has 2 cores: nvcc (2 threads) and hipcc run side by side.
nvcc_all & NVCC_PID=$!
hipcc_all & HIPCC_PID=$!
wait $NVCC_PID || STATUS=1
wait $HIPCC_PID || STATUS=1
bindings_check || STATUS=1

cat "$OUT/nvcc.summary" "$OUT/hipcc.summary" "$OUT/gxx.summary"
exit $STATUS
