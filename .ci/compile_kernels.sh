#!/usr/bin/env bash
# Compiles every torch-free kernel source (csrc/*.cu) with nvcc (sm_80, sm_90) and hipcc
# (gfx90a, gfx942), no GPU needed, and syntax-checks the binding files (csrc/*_bindings.cpp)
# against torch's headers.
# Warnings are errors; spills are reported. Exits non-zero on any failure; prints one summary line
# per compiler.
#
# hipcc is installed with apt-get when missing. Debian 12's hipcc (HIP 5.2) drives clang 15, which
# does not know gfx942 (MI300X; LLVM 17+). Then gfx942 is compiled by the HIP compiler hipcc wraps,
# clang, in Debian's newer LLVM 19 (apt-get install clang-19 lld-19), with the same HIP 5.2 headers
# and device libraries; the one device library 5.2 lacks for gfx942, its ISA-version constant
# (oclc_isa_version_942.bc), is generated. Without clang 19 we fall back to compiling gfx940 with
# hipcc and say so in the summary.
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

CLANG19=/usr/lib/llvm-19/bin/clang++
# Prints the --rocm-device-lib-path for clang 19 targeting gfx942: Debian's device libraries plus a
# generated ISA-version constant for gfx942. Fails when clang 19 / lld 19 can not be installed.
gfx942_device_libs() {
  if [[ ! -x $CLANG19 || ! -x /usr/lib/llvm-19/bin/ld.lld ]]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-19 lld-19; } \
      >> "$OUT/apt.log" 2>&1 || return 1
  fi
  local bitcode; bitcode="$(dirname "$(find /usr/lib -name ockl.bc -path '*amdgcn*' | head -1)")"
  [[ -f $bitcode/ockl.bc ]] || return 1
  mkdir -p "$OUT/devlibs" && cp "$bitcode"/*.bc "$OUT/devlibs/"
  echo '__constant int __oclc_ISA_version = 9402;' > "$OUT/isa942.cl"
  /usr/lib/llvm-19/bin/clang -x cl -Xclang -finclude-default-header -target amdgcn-amd-amdhsa \
    -mcpu=gfx942 -nogpulib -emit-llvm -c "$OUT/isa942.cl" -o "$OUT/devlibs/oclc_isa_version_942.bc" \
    > "$OUT/isa942.log" 2>&1 || return 1
  echo "$OUT/devlibs"
}

HIP_ARCHS=(gfx90a gfx942)
HIP_NOTE=""
HAVE_HIPCC=0
HAVE_CLANG19=0  # gfx942 goes to clang 19 (see the header)
if ensure_hipcc; then
  HAVE_HIPCC=1
  echo '__global__ void probe(float* x) { x[0] = 1.f; }' > "$OUT/probe.hip"
  if ! hipcc -x hip --offload-arch=gfx942 -c "$OUT/probe.hip" -o "$OUT/probe.o" > /dev/null 2>&1; then
    if DEVLIBS="$(gfx942_device_libs)"; then
      HAVE_CLANG19=1
      HIP_ARCHS=(gfx90a)
      export CLANG19 DEVLIBS
    else
      HIP_ARCHS=(gfx90a gfx940)
      HIP_NOTE=" (this hipcc does not know gfx942 and clang 19 is unavailable; compiled gfx940 instead)"
    fi
  fi
fi
HAVE_NVCC=0
[[ -x "$NVCC" ]] && HAVE_NVCC=1

# ---- binding files' syntax check (csrc/*_bindings.cpp) -----------------------
bindings_check() {
  local py="${PYTHON:-python3}" incs
  if ! incs="$("$py" -c 'import sysconfig, torch.utils.cpp_extension as c; print(" ".join(c.include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
    echo "g++ -fsyntax-only bindings: skipped (torch not importable)"; return 0
  fi
  # A CPU build of torch lacks this generated header; it only carries build macros.
  mkdir -p "$OUT/stubs/c10/cuda/impl" && echo '#pragma once' > "$OUT/stubs/c10/cuda/impl/cuda_cmake_macros.h"
  local flags=() d src rc=0
  for d in $incs "${CUDA_HOME:-/usr/local/cuda}/include" "$OUT/stubs"; do flags+=(-isystem "$d"); done
  for src in torch_bindings.cpp layer_bindings.cpp quant_bindings.cpp; do
    if g++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -DTORCH_EXTENSION_NAME=_C "${flags[@]}" \
        "$CSRC/$src" > "$OUT/gxx-$src.log" 2>&1; then
      echo "g++ -fsyntax-only $src: ok"
    else
      sed "s|^|[g++ $src] |" "$OUT/gxx-$src.log"
      echo "g++ -fsyntax-only $src: FAILED"; rc=1
    fi
  done
  return $rc
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
  elif [[ $compiler == clang19 ]]; then
    "$CLANG19" -std=c++17 -O3 -x hip -DUSE_ROCM -Wall -Wextra -Werror --offload-arch="$target" \
      --rocm-path=/usr --rocm-device-lib-path="$DEVLIBS" \
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
  for src in $(ls -S "$CSRC"/*.cu "$CSRC"/quantization/*.cu); do
    if [[ $HAVE_HIPCC == 1 ]]; then echo "hipcc $(IFS=,; echo "${HIP_ARCHS[*]}") $src"; fi
    if [[ $HAVE_CLANG19 == 1 ]]; then echo "clang19 gfx942 $src"; fi
    if [[ $HAVE_NVCC == 1 ]]; then
      echo "nvcc sm_80 $src"
      echo "nvcc sm_90 $src"
    fi
  done
} | xargs -P "$JOBS" -L 1 bash -c 'run_job "$@"' _

STATUS=0
NUM_SOURCES=$(ls "$CSRC"/*.cu "$CSRC"/quantization/*.cu | wc -l)
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
if [[ $HAVE_CLANG19 == 1 ]]; then
  summary clang19 "clang 19 HIP (gfx942; hipcc's HIP ${HIP_VERSION#HIP version: } headers and device libraries)"
fi
wait $BINDINGS_PID || STATUS=1
cat "$OUT/bindings.summary"
exit $STATUS
