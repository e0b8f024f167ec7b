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

// Weights stream through L2 once per step; marked evict-first there (-DPL_WEIGHTS_EVICT_FIRST=0
// for plain loads) they do not push out the small tensors that the latency-bound kernels between
// two GEMVs read (activations, the residual stream, norm weights, the KV cache).
#ifndef PL_WEIGHTS_EVICT_FIRST
#define PL_WEIGHTS_EVICT_FIRST 1
#endif

// Queues `bytes` of weights (a multiple of 16, both addresses 16-byte aligned) from global src to
// shared dst; the barrier's current phase completes when they have arrived.
PL_DEVICE void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#if PL_WEIGHTS_EVICT_FIRST
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
#endif
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
