#!/usr/bin/env bash
# Compiles every torch-free kernel source (csrc/*.cu) with nvcc (sm_80, sm_90) and hipcc
# (gfx90a, gfx942), no GPU needed, and syntax-checks csrc/torch_bindings.cpp against torch's headers.
# Warnings are errors; spills are reported. Exits non-zero on any failure; prints one summary line
# per compiler.
#
# hipcc is installed with apt-get when missing. Debian 12's HIP 5.2 / clang 15 does not know gfx942
# (MI300X; needs LLVM 17+): when the compiler rejects it we compile its predecessor gfx940 instead
# and say so in the summary.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CSRC="$ROOT/csrc"
OUT="$(mktemp -d /tmp/pagedllm-kernels.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT
JOBS="${JOBS:-$(nproc)}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
export HIP_PLATFORM=amd

ensure_hipcc() {
  command -v hipcc > /dev/null && return 0
  echo "hipcc not found; installing it with apt-get" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc; } > "$OUT/apt.log" 2>&1 \
    || { cat "$OUT/apt.log" >&2; return 1; }
}

HIP_ARCHS=(gfx90a gfx942)
HIP_NOTE=""
HAVE_HIPCC=0
if ensure_hipcc; then
  HAVE_HIPCC=1
  echo '__global__ void probe(float* x) { x[0] = 1.f; }' > "$OUT/probe.hip"
  if ! hipcc -x hip --offload-arch=gfx942 -c "$OUT/probe.hip" -o "$OUT/probe.o" > /dev/null 2>&1; then
    HIP_ARCHS=(gfx90a gfx940)
    HIP_NOTE=" (this hipcc does not know gfx942; compiled gfx940 instead)"
  fi
fi
HAVE_NVCC=0
[[ -x "$NVCC" ]] && HAVE_NVCC=1

# ---- torch_bindings.cpp syntax check ----------------------------------------------------------
bindings_check() {
  local py="${PYTHON:-python3}" incs
  if ! incs="$("$py" -c 'import sysconfig, torch.utils.cpp_extension as c; print(" ".join(c.include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
    echo "g++ -fsyntax-only torch_bindings.cpp: skipped (torch not importable)"; return 0
  fi
  # A CPU build of torch lacks this generated header; it only carries build macros.
  mkdir -p "$OUT/stubs/c10/cuda/impl" && echo '#pragma once' > "$OUT/stubs/c10/cuda/impl/cuda_cmake_macros.h"
  local flags=() d
  for d in $incs "${CUDA_HOME:-/usr/local/cuda}/include" "$OUT/stubs"; do flags+=(-isystem "$d"); done
  if g++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -DTORCH_EXTENSION_NAME=_C "${flags[@]}" \
      "$CSRC/torch_bindings.cpp" > "$OUT/gxx.log" 2>&1; then
    echo "g++ -fsyntax-only torch_bindings.cpp: ok"
  else
    sed 's|^|[g++ bindings] |' "$OUT/gxx.log"
    echo "g++ -fsyntax-only torch_bindings.cpp: FAILED"; return 1
  fi
}

bindings_check > "$OUT/bindings.summary" 2>&1 & BINDINGS_PID=$!

# One job per (compiler, target, source): "<compiler> <target> <source>". Jobs run $JOBS at a time.
run_job() {
  local compiler=$1 target=$2 src=$3
  local name; name="$(basename "$src" .cu)"
  local tag="$compiler-$target-$name" start=$SECONDS rc=0
  if [[ $compiler == nvcc ]]; then
    "$NVCC" -std=c++17 -O3 -gencode "arch=compute_${target#sm_},code=$target" \
      -Xcompiler -Wall,-Wextra -Werror all-warnings -Xptxas -warn-spills,-warn-lmem-usage \
      -c "$src" -o "$OUT/$tag.o" > "$OUT/$tag.log" 2>&1 || rc=$?
  else
    local flags=()
    for a in ${target//,/ }; do flags+=("--offload-arch=$a"); done
    hipcc -std=c++17 -O3 -x hip -DUSE_ROCM -Wall -Wextra -Werror "${flags[@]}" \
      -c "$src" -o "$OUT/$tag.o" > "$OUT/$tag.log" 2>&1 || rc=$?
  fi
  echo "$compiler $rc $((SECONDS - start))" > "$OUT/$tag.result"
  if [[ -s "$OUT/$tag.log" ]]; then sed "s|^|[$tag] |" "$OUT/$tag.log"; fi
  return 0
}
export -f run_job
export NVCC OUT

# Largest sources first so that the long hipcc job overlaps the nvcc jobs.
{
  for src in $(ls -S "$CSRC"/*.cu); do
    if [[ $HAVE_HIPCC == 1 ]]; then echo "hipcc $(IFS=,; echo "${HIP_ARCHS[*]}") $src"; fi
    if [[ $HAVE_NVCC == 1 ]]; then
      echo "nvcc sm_80 $src"
      echo "nvcc sm_90 $src"
    fi
  done
} | xargs -P "$JOBS" -L 1 bash -c 'run_job "$@"' _

STATUS=0
NUM_SOURCES=$(ls "$CSRC"/*.cu | wc -l)
summary() {  # compiler, label
  local compiler=$1 label=$2 n=0 failed=0 secs=0
  for r in "$OUT"/"$compiler"-*.result; do
    [[ -e $r ]] || continue
    read -r _ rc s < "$r"
    n=$((n + 1)); secs=$((secs + s))
    [[ $rc == 0 ]] || failed=$((failed + 1))
  done
  if [[ $n == 0 ]]; then
    echo "$label: NOT RUN (compiler not available)"; STATUS=1
  elif [[ $failed == 0 ]]; then
    echo "$label: ok, $NUM_SOURCES files, $n compile jobs, ${secs}s of compile time"
  else
    echo "$label: FAILED ($failed of $n compile jobs)"; STATUS=1
  fi
}

NVCC_VERSION="$([[ $HAVE_NVCC == 1 ]] && "$NVCC" --version | grep -o 'release [0-9.]*')"
HIP_VERSION="$([[ $HAVE_HIPCC == 1 ]] && hipcc --version 2>/dev/null | grep -o 'HIP version: [0-9.]*' | head -1)"
summary nvcc "nvcc ${NVCC_VERSION:-?} (sm_80, sm_90)"
summary hipcc "hipcc ${HIP_VERSION:-?} (${HIP_ARCHS[*]})$HIP_NOTE"
wait $BINDINGS_PID || STATUS=1
cat "$OUT/bindings.summary"
exit $STATUS
