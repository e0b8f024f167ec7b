// One source tree for CUDA and ROCm: kernel files spell CUDA names and this header maps them to HIP
// when USE_ROCM is defined. Kernel files include nothing else from a vendor SDK and never torch.
//
// Two parts:
//   * host part (always): runtime API names (streams, errors, memcpy). Safe to include from a plain
//     C++ translation unit such as torch_bindings.cpp.
//   * device part (only under nvcc / hipcc): 16-bit float types, warp shuffles, WARP_SIZE, inline
//     qualifiers. The conversion helpers built on top of it live in dtype_convert.cuh.
//
// Under PAGEDLLM_SIMT_EMU (the CPU test harness, tests/kernels/simt_emu/simt_emu.h, force-included
// before this file) neither part is used: the emulator supplies the same names.
//
// The macros below are hipify-safe: torch's hipify may rewrite `cudaStream_t` into `hipStream_t`
// inside this file, which turns `#define cudaStream_t hipStream_t` into a harmless self-definition.
#pragma once

#include <cstdint>

#if defined(USE_ROCM)
  #include <hip/hip_runtime_api.h>
  #define cudaStream_t hipStream_t
  #define cudaError_t hipError_t
  #define cudaSuccess hipSuccess
  #define cudaErrorInvalidValue hipErrorInvalidValue
  #define cudaGetLastError hipGetLastError
  #define cudaGetErrorString hipGetErrorString
  #define cudaMemcpyAsync hipMemcpyAsync
  #define cudaMemcpyKind hipMemcpyKind
  #define cudaMemcpyHostToDevice hipMemcpyHostToDevice
  #define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
  #define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
  #define cudaMemcpyDefault hipMemcpyDefault
  #define cudaGetDevice hipGetDevice
  #define cudaDeviceGetAttribute hipDeviceGetAttribute
  #define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#elif !defined(PAGEDLLM_SIMT_EMU)
  #include <cuda_runtime_api.h>
#endif

// ---------------------------------------------------------------------------------------------
// Device part.
// ---------------------------------------------------------------------------------------------
#if defined(__CUDACC__) || defined(__HIPCC__)

#if defined(USE_ROCM)
  #include <hip/hip_runtime.h>
  #include <hip/hip_fp16.h>
  #if __has_include(<hip/hip_bf16.h>)
    #include <hip/hip_bf16.h>
    typedef __hip_bfloat16 pl_bf16;
  #else
    // ROCm < 5.7 (Debian's HIP 5.2) only has the hip_bfloat16 struct; we only use it as storage.
    #include <hip/hip_bfloat16.h>
    typedef hip_bfloat16 pl_bf16;
  #endif
  typedef __half pl_half;
  // CDNA (gfx90a, gfx942) runs 64-wide wavefronts; RDNA wave32 builds are not supported.
  #define WARP_SIZE 64
#else
  #include <cuda_runtime.h>
  #include <cuda_fp16.h>
  #include <cuda_bf16.h>
  typedef __half pl_half;
  typedef __nv_bfloat16 pl_bf16;
  #define WARP_SIZE 32
#endif

#define PL_DEVICE __device__ __forceinline__

// HIP assumes 1024 threads per block without a bound (which caps registers per lane), so kernels
// state their block size there. On CUDA the bound is left out: with it ptxas picked a lower register
// budget and spilled the decode kernel.
#if defined(USE_ROCM)
  #define PL_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)
#else
  #define PL_LAUNCH_BOUNDS(threads)
#endif

// Butterfly exchange inside groups of `width` lanes (width is a power of two <= WARP_SIZE).
// Every lane of the warp must execute the call (full-mask semantics on CUDA).
PL_DEVICE float pl_shfl_xor(float value, int lane_mask, int width = WARP_SIZE) {
#if defined(USE_ROCM)
  return __shfl_xor(value, lane_mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask, width);
#endif
}

PL_DEVICE float pl_uint_as_float(uint32_t bits) { return __uint_as_float(bits); }
PL_DEVICE uint32_t pl_float_as_uint(float value) { return __float_as_uint(value); }

// One IEEE multiply / add, never fused into an FMA with a neighbouring operation, so that a torch
// reference made of separate rounded ops is reproduced bit for bit. HIP's __fmul_rn / __fadd_rn are
// plain operators that clang contracts (hipcc compiles with -ffp-contract=fast-honor-pragmas), so
// the HIP twins switch contraction off for their one operation.
PL_DEVICE float pl_fmul_rn(float a, float b) {
#if defined(USE_ROCM)
  #pragma clang fp contract(off)
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}

PL_DEVICE float pl_fadd_rn(float a, float b) {
#if defined(USE_ROCM)
  #pragma clang fp contract(off)
  return a + b;
#else
  return __fadd_rn(a, b);
#endif
}

// Programmatic dependent launch (CUDA, sm_90 and newer; see launch_kernel below). Every kernel
// calls pl_wait_prior_grids() before it touches memory that an earlier kernel of the stream writes
// or reads (it returns once that kernel has completed and its writes are visible), and
// pl_release_dependents() once the next kernel may be scheduled beside it. Dependents always wait,
// so ordering is as with plain launches whatever the release point. Both are no-ops elsewhere.
PL_DEVICE void pl_wait_prior_grids() {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
PL_DEVICE void pl_release_dependents() {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The entry of every kernel but the GEMV (which queues its weight copies first, gemv_kernels.cu).
// Releasing before waiting lets a chain of small kernels launch at once, so the GEMV after them
// takes each SM as soon as the GEMV before them leaves it and streams its weights while they run.
// The GEMV itself releases only after its wait, which bounds the look-ahead to one GEMV.
// -DPL_RELEASE_BEFORE_WAIT=0 builds the other order (wait, then release) for A/B runs.
#ifndef PL_RELEASE_BEFORE_WAIT
#define PL_RELEASE_BEFORE_WAIT 1
#endif
PL_DEVICE void pl_release_and_wait() {
#if PL_RELEASE_BEFORE_WAIT
  pl_release_dependents();
  pl_wait_prior_grids();
#else
  pl_wait_prior_grids();
  pl_release_dependents();
#endif
}

#endif  // __CUDACC__ || __HIPCC__

// Kernel launches go through this one helper so the launch syntax lives in a single place.
//
// On CUDA, once configure_programmatic_launch(true) found the kernels compiled for sm_90 or newer,
// launches carry the programmatic-stream-serialization attribute: a kernel may be scheduled while
// the previous kernel of the stream finishes (its blocks wait in pl_wait_prior_grids), which hides
// most of a launch's latency between the many small kernels of a decode step. Kept in CUDA graphs.
namespace pagedllm {
// Whether launch_kernel uses programmatic dependent launch (false until configured; always on HIP).
bool programmatic_launch_enabled();
// Turns it on when `enable` and the kernels run as sm_90+ code on the current device (probed with
// one kernel and a synchronizing copy: call it outside graph capture), else off. Returns the state.
bool configure_programmatic_launch(bool enable);
// __CUDA_ARCH__ of the kernels as they run on the device (e.g. 900), as probed by
// configure_programmatic_launch; 0 before that and on HIP.
int kernel_arch();
}  // namespace pagedllm

#if defined(__CUDACC__) || defined(__HIPCC__)
namespace pagedllm {
template <typename... KernelArgs, typename... Args>
inline void launch_kernel_smem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                               int dynamic_smem_bytes, cudaStream_t stream, Args... args) {
#if !defined(USE_ROCM)
  if (programmatic_launch_enabled()) {
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = dynamic_smem_bytes;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = 1;
    cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
    return;
  }
#endif
  kernel<<<grid, block, dynamic_smem_bytes, stream>>>(static_cast<KernelArgs>(args)...);
}

template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream,
                          Args... args) {
  launch_kernel_smem(kernel, grid, block, 0, stream, args...);
}
}  // namespace pagedllm
#endif
