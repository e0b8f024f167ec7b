// Bulk copies from global to shared memory completing on an mbarrier (cp.async.bulk, sm_90+ CUDA).
// Defines PL_BULK_COPY where they exist; kernels keep a path without them (HIP, older GPUs, the SIMT
// emulator), which reads the same bytes from global memory.
#pragma once

#include "cuda_compat.h"

#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PL_BULK_COPY 1

namespace pagedllm {

PL_DEVICE uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// One thread initializes each barrier (one arrival per phase), then fences the initialization
// before any copy may complete on it.
PL_DEVICE void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}
PL_DEVICE void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Queues `bytes` (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst;
// the barrier's current phase completes when they have arrived.
PL_DEVICE void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

PL_DEVICE void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// Orders the block's generic-proxy reads of a buffer before a bulk copy rewrites it.
PL_DEVICE void bulk_fence_before_reuse() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace pagedllm
#endif
