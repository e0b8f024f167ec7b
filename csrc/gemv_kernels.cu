// Weight-streaming GEMV for one-token decode steps: out[n] = sum_k weight[n][k] * x[k] (+ bias[n]),
// float32 accumulation, one rounding to the dtype at the end (what F.linear does through cuBLAS).
//
// At batch 1 a decode step is a chain of weight-bound GEMVs with small latency-bound kernels
// between them (norm, rotary, attention, SiLU), during which the memory system idles. This kernel
// starts streaming its weights before the previous kernel has finished: launched with
// programmatic dependent launch (cuda_compat.h), each thread block first queues bulk copies of its
// first kStages weight chunks into shared memory (the weights never depend on the previous
// kernel), and only then waits for the previous kernel (pl_wait_prior_grids) and reads x.
//
// Work decomposition: one thread block per SM, each owning a contiguous range of whole rows (no
// split-K, so no reduction kernel); its rows are consumed in stages of up to kMaxStageRows rows
// (at most kStageBytes), kStages stages in flight. Thread t holds the x elements of the 16-byte
// vectors t, t + kThreads, ... of a row in registers (KV vectors: K <= KV * kThreads * 8) and
// accumulates their products for every row of a stage; a stage's row sums are reduced over the
// warps through shared memory.
//
// Bulk copies (cp.async.bulk + mbarrier) exist on sm_90+ CUDA only; elsewhere (HIP, older GPUs,
// and launches with GemvArgs::staged false) the same kernel reads the rows from global memory.
#include "bulk_copy.cuh"
#include "dtype_convert.cuh"
#include "gemv_stage.cuh"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kThreads = kGemvThreads;
constexpr int kWarps = kThreads / WARP_SIZE;
// Stages in flight per block; -DPL_GEMV_STAGES=N for A/B runs. At 3 (96 KB) two blocks fit an SM,
// so the next GEMV's block can start streaming beside the previous GEMV's block (cuda_compat.h).
#ifndef PL_GEMV_STAGES
#define PL_GEMV_STAGES 5
#endif
constexpr int kStageBytes = kGemvStageBytes;
constexpr int kStages = PL_GEMV_STAGES;
constexpr int kMaxStageRows = kGemvMaxStageRows;

PL_DEVICE float load_element(const pl_half* p) { return __half2float(*p); }
PL_DEVICE float load_element(const pl_bf16* p) {
  return pl_uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

#if defined(PL_GEMV_TRACE)
constexpr int64_t kTraceRecords = 1 << 16;
__device__ unsigned long long trace_records[kTraceRecords][5];
__device__ unsigned int trace_next;
PL_DEVICE unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
PL_DEVICE unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#endif

template <typename T, int KV>
__global__ void PL_LAUNCH_BOUNDS(kThreads) gemv_kernel(const GemvArgs a) {
  constexpr int VEC = Vec16<T>::kElems;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * a.n / gridDim.x;
  const int64_t row_end = static_cast<int64_t>(blockIdx.x + 1) * a.n / gridDim.x;
  const int rows = static_cast<int>(row_end - row_begin);
  const int k_vecs = a.k / VEC;
  const int stage_rows = a.stage_rows;
  const int num_stages = (rows + stage_rows - 1) / stage_rows;
  const T* weight = static_cast<const T*>(a.weight) + row_begin * a.k;
  __shared__ float partial[2][kMaxStageRows][kWarps];
#if defined(PL_GEMV_TRACE)
  const unsigned long long t_entry = global_ns();
#endif

#if defined(PL_BULK_COPY)
  extern __shared__ __align__(128) unsigned char stage_buffers[];
  __shared__ __align__(8) uint64_t arrived[kStages];
  const bool staged = a.staged;
  const auto issue = [&](int stage) {
    const int n = min(stage_rows, rows - stage * stage_rows);
    bulk_load(stage_buffers + (stage % kStages) * kStageBytes,
              weight + static_cast<int64_t>(stage) * stage_rows * a.k,
              static_cast<uint32_t>(n * a.k * sizeof(T)), &arrived[stage % kStages]);
  };
  if (staged) {
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) barrier_init(&arrived[s]);
      barrier_init_fence();
      for (int s = 0; s < kStages && s < num_stages; ++s) issue(s);
    }
    __syncthreads();
  }
#endif
  // Everything above touches only the weights; x, bias and out may belong to earlier kernels.
  pl_wait_prior_grids();
  pl_release_dependents();
#if defined(PL_GEMV_TRACE)
  const unsigned long long t_wait = global_ns();
#endif

  float xr[KV][VEC];
  const T* x = static_cast<const T*>(a.x);
#pragma unroll
  for (int j = 0; j < KV; ++j) {
    const int v = tid + j * kThreads;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (v < k_vecs) raw = *reinterpret_cast<const uint4*>(x + v * VEC);
    vec16_to_float<T>(raw, xr[j]);
  }

  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
#pragma unroll 1
  for (int stage = 0; stage < num_stages; ++stage) {
    const int r0 = stage * stage_rows;
    const int nr = min(stage_rows, rows - r0);
    const T* src = weight + static_cast<int64_t>(r0) * a.k;
#if defined(PL_BULK_COPY)
    if (staged) {
      barrier_wait(&arrived[stage % kStages], (stage / kStages) & 1);
      src = reinterpret_cast<const T*>(stage_buffers + (stage % kStages) * kStageBytes);
    }
#endif
    gemv_stage_partials<T, KV, kMaxStageRows, kThreads>(src, a.k, nr, xr, partial[stage & 1]);
    __syncthreads();  // the stage's buffer is read and its partial sums are written
#if defined(PL_BULK_COPY)
    if (staged && tid == 0 && stage + kStages < num_stages) {
      bulk_fence_before_reuse();
      issue(stage + kStages);
    }
#endif
    if (tid < nr) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[stage & 1][tid][w];
      if (bias != nullptr) sum += load_element(bias + row_begin + r0 + tid);
      store_from_float(out + row_begin + r0 + tid, sum);
    }
  }
#if defined(PL_GEMV_TRACE)
  if (tid == 0) {
    const unsigned slot = atomicAdd(&trace_next, 1u);
    if (slot < kTraceRecords) {
      unsigned long long* r = trace_records[slot];
      r[0] = reinterpret_cast<unsigned long long>(a.weight);
      r[1] = (static_cast<unsigned long long>(sm_id()) << 32) | blockIdx.x;
      r[2] = t_entry;
      r[3] = t_wait;
      r[4] = global_ns();
    }
  }
#endif
}

template <typename T, int KV>
cudaError_t gemv_for(const GemvArgs& a, int blocks, cudaStream_t stream) {
  const int smem = a.staged ? kStages * kStageBytes : 0;
#if !defined(USE_ROCM)
  if (a.staged) {
    // All of the SM's unified L1 as shared memory: the stages take most of it (and at 3 stages or
    // fewer two blocks fit an SM).
    static const cudaError_t attribute = [] {
      const cudaError_t size = cudaFuncSetAttribute(
          gemv_kernel<T, KV>, cudaFuncAttributeMaxDynamicSharedMemorySize, kStages * kStageBytes);
      if (size != cudaSuccess) return size;
      return cudaFuncSetAttribute(gemv_kernel<T, KV>,
                                  cudaFuncAttributePreferredSharedMemoryCarveout,
                                  static_cast<int>(cudaSharedmemCarveoutMaxShared));
    }();
    if (attribute != cudaSuccess) return attribute;
  }
#endif
  launch_kernel_smem(gemv_kernel<T, KV>, dim3(blocks), dim3(kThreads), smem, stream, a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gemv_dispatch(const GemvArgs& a, int kv, int blocks, cudaStream_t stream) {
  switch (kv) {
    case 1: return gemv_for<T, 1>(a, blocks, stream);
    case 2: return gemv_for<T, 2>(a, blocks, stream);
    case 3: return gemv_for<T, 3>(a, blocks, stream);
    case 4: return gemv_for<T, 4>(a, blocks, stream);
    case 5: return gemv_for<T, 5>(a, blocks, stream);
    case 6: return gemv_for<T, 6>(a, blocks, stream);
    case 7: return gemv_for<T, 7>(a, blocks, stream);
    default: return gemv_for<T, 8>(a, blocks, stream);
  }
}

int multiprocessors() {
  int device = 0;
  int count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return count;
}

}  // namespace

#if defined(PL_GEMV_TRACE)
cudaError_t gemv_trace_take(int64_t* host, int64_t max_records, int64_t* count) {
  unsigned recorded = 0;
  cudaError_t e = cudaMemcpyFromSymbol(&recorded, trace_next, sizeof(recorded));
  if (e != cudaSuccess) return e;
  *count = recorded < kTraceRecords ? recorded : kTraceRecords;
  const int64_t n = *count < max_records ? *count : max_records;
  if (n > 0) e = cudaMemcpyFromSymbol(host, trace_records, n * 5 * sizeof(int64_t));
  const unsigned zero = 0;
  return e != cudaSuccess ? e : cudaMemcpyToSymbol(trace_next, &zero, sizeof(zero));
}
#endif

cudaError_t launch_gemv(GemvArgs a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  if (a.n < 0 || !gemv_supports_k(a.k) || a.dtype == ScalarType::kFloat32) {
    return cudaErrorInvalidValue;
  }
  const int sms = multiprocessors();
  if (sms <= 0) return cudaErrorInvalidValue;
  a.stage_rows = gemv_stage_rows(a.k);
  a.staged = a.staged && kernel_arch() >= 900;
  const int blocks = static_cast<int>(a.n < sms ? a.n : sms);
  const int kv = (a.k / 8 + kThreads - 1) / kThreads;
  return a.dtype == ScalarType::kFloat16 ? gemv_dispatch<pl_half>(a, kv, blocks, stream)
                                         : gemv_dispatch<pl_bf16>(a, kv, blocks, stream);
}

}  // namespace pagedllm
