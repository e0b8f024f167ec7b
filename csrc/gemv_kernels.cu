// Small-M GEMV (skinny GEMM) for decode: out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for
// at most kGemvMaxRows rows of x, i.e. F.linear with a decode batch. Such a call reads the weight
// once and little else, so it runs at the speed the weight streams from memory.
//
// Work decomposition
//   grid = ceil(n / kRowsPerBlock); a block is kWarps independent warps; a warp owns kRows
//   consecutive weight rows (columns of out) and computes them for all M rows of x.
//   The warp's lanes walk its rows together in steps: in one step lane `lane` takes the 16-byte
//   vectors base + lane + u * WARP_SIZE (u < kUnroll) of every row it owns, so a lane has
//   kRows * kUnroll independent weight loads in flight and each warp load instruction reads
//   WARP_SIZE * 16 contiguous bytes. Weight loads are evict-first (read once). The matching
//   16-byte vectors of the x rows come through the read-only cache (every warp reads all of x,
//   which stays in L1/L2), are converted to float in registers and used for the kRows rows; each
//   weight vector is used for the M rows of x. All products accumulate in float registers.
//   At the end a lane holds kRows * M partial sums; a reduce-scatter over the lanes (shuffles)
//   leaves each total in one lane, which adds the bias and rounds once to the dtype.
//   No split-K, no atomics, no shared memory, no barrier.
//
// M is a template parameter in {1, 2, 4, 8}; a launch with fewer rows of x takes the next one up
// and skips the missing rows (never loaded, never stored). A warp whose last rows lie past n
// reads row n - 1 in their place and stores nothing for them.
#include "dtype_convert.cuh"
#include "ops.h"

// Tuning knobs (like PAGEDLLM_ATTN_WARPS): warps per block, weight rows per warp, 16-byte vectors
// per row a lane loads per step.
#ifndef PAGEDLLM_GEMV_WARPS
#define PAGEDLLM_GEMV_WARPS 4
#endif
#ifndef PAGEDLLM_GEMV_ROWS
#define PAGEDLLM_GEMV_ROWS 4
#endif
#ifndef PAGEDLLM_GEMV_UNROLL
#define PAGEDLLM_GEMV_UNROLL 4
#endif

namespace pagedllm {
namespace {

constexpr int kWarps = PAGEDLLM_GEMV_WARPS;
constexpr int kThreads = kWarps * WARP_SIZE;
constexpr int kRows = PAGEDLLM_GEMV_ROWS;
constexpr int kUnroll = PAGEDLLM_GEMV_UNROLL;
constexpr int kRowsPerBlock = kWarps * kRows;
constexpr int kStepVecs = kUnroll * WARP_SIZE;  // 16-byte vectors of a row per warp step
static_assert(kRows > 0 && (kRows & (kRows - 1)) == 0, "PAGEDLLM_GEMV_ROWS: a power of two");

// Sums each of the N values over the warp's lanes and scatters the totals: a halving exchange per
// lane bit (the upper lanes keep the upper half) while more than one value is left, then plain
// butterflies. Afterwards vals[0 .. max(1, N / WARP_SIZE)) of lane l are the totals of values
// l * N / WARP_SIZE onwards (for N < WARP_SIZE, WARP_SIZE / N neighbouring lanes hold the same
// total). Takes N - 1 + log2(WARP_SIZE / N) shuffles instead of N * log2(WARP_SIZE).
template <int N, int MASK = WARP_SIZE / 2>
PL_DEVICE void warp_reduce_scatter(float* vals, int lane) {
  if constexpr (MASK > 0) {
    if constexpr (N > 1) {
      const bool upper = (lane & MASK) != 0;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        // both read before the selects: `upper ? vals[i] : vals[j]` becomes a load from a
        // computed index, which puts vals in scratch memory under hipcc
        const float lower_half = vals[i];
        const float upper_half = vals[i + N / 2];
        const float send = upper ? lower_half : upper_half;
        const float keep = upper ? upper_half : lower_half;
        vals[i] = keep + pl_shfl_xor(send, MASK);
      }
      warp_reduce_scatter<N / 2, MASK / 2>(vals, lane);
    } else {
      vals[0] += pl_shfl_xor(vals[0], MASK);
      warp_reduce_scatter<1, MASK / 2>(vals, lane);
    }
  }
}

// One step of a warp over its rows: this lane's vectors v0 + u * WARP_SIZE. kTail: the step may
// run past the row end (vectors >= num_vecs are skipped). acc[m * kRows + r] += x_m . w_r.
template <typename T, int M, bool kTail>
PL_DEVICE void gemv_step(const uint4* const (&w)[kRows], const uint4* const (&x)[M], int m_rows,
                         int v0, int num_vecs, float (&acc)[M * kRows]) {
  constexpr int VEC = Vec16<T>::kElems;
  uint4 wv[kUnroll][kRows];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = v0 + u * WARP_SIZE;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      wv[u][r] = make_uint4(0u, 0u, 0u, 0u);
      if (!kTail || v < num_vecs) wv[u][r] = pl_load_stream(w[r] + v);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = v0 + u * WARP_SIZE;
    float wf[kRows][VEC];
#pragma unroll
    for (int r = 0; r < kRows; ++r) vec16_to_float<T>(wv[u][r], wf[r]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      // (conditions, not breaks: hipcc does not unroll loops with an early exit)
      if (m < m_rows && (!kTail || v < num_vecs)) {  // m_rows: warp-uniform
        float xf[VEC];
        vec16_to_float<T>(pl_load_readonly(x[m] + v), xf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[m * kRows + r] += wf[r][j] * xf[j];
        }
      }
    }
  }
}

// grid = (ceil(n / kRowsPerBlock)); warp w of block b owns rows (b * kWarps + w) * kRows + r.
template <typename T, int M>
__global__ void PL_LAUNCH_BOUNDS(kThreads) gemv_kernel(const GemvArgs a) {
  constexpr int VEC = Vec16<T>::kElems;
  constexpr int kValues = M * kRows;
  const int lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRows;
  if (row0 >= a.n) return;  // the whole warp: no rows left

  const uint4* w[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r < a.n ? row0 + r : a.n - 1;
    w[r] = reinterpret_cast<const uint4*>(static_cast<const T*>(a.weight) + row * a.weight_stride);
  }
  const uint4* x[M];  // rows past a.m are never read; they point at row 0
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int64_t offset = m < a.m ? m * a.x_stride : 0;
    x[m] = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + offset);
  }

  float acc[kValues];
#pragma unroll
  for (int i = 0; i < kValues; ++i) acc[i] = 0.f;
  const int num_vecs = a.k / VEC;
  int base = 0;
  for (; base + kStepVecs <= num_vecs; base += kStepVecs) {
    gemv_step<T, M, false>(w, x, a.m, base + lane, num_vecs, acc);
  }
  if (base < num_vecs) gemv_step<T, M, true>(w, x, a.m, base + lane, num_vecs, acc);

  warp_reduce_scatter<kValues>(acc, lane);
  constexpr int kLanesPerValue = kValues < WARP_SIZE ? WARP_SIZE / kValues : 1;
  constexpr int kValuesPerLane = kValues > WARP_SIZE ? kValues / WARP_SIZE : 1;
  if (lane % kLanesPerValue != 0) return;
  const T* bias = static_cast<const T*>(a.bias);
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    const int value = lane / kLanesPerValue * kValuesPerLane + i;  // = m * kRows + r
    const int m = value / kRows;
    const int64_t row = row0 + value % kRows;
    if (m >= a.m || row >= a.n) continue;
    const float total = bias != nullptr ? acc[i] + load_scalar(bias + row) : acc[i];
    store_from_float(static_cast<T*>(a.out) + m * a.out_stride + row, total);
  }
}

// ---- launch -----------------------------------------------------------------------------------

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <typename T, int M>
void launch_rows(const GemvArgs& a, cudaStream_t stream) {
  const int64_t blocks = (static_cast<int64_t>(a.n) + kRowsPerBlock - 1) / kRowsPerBlock;
  launch_kernel(gemv_kernel<T, M>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, a);
}

// The smallest compiled M that covers the rows of x.
template <typename T>
void dispatch_rows(const GemvArgs& a, cudaStream_t stream) {
  if (a.m <= 1) {
    launch_rows<T, 1>(a, stream);
  } else if (a.m <= 2) {
    launch_rows<T, 2>(a, stream);
  } else if (a.m <= 4) {
    launch_rows<T, 4>(a, stream);
  } else {
    launch_rows<T, 8>(a, stream);
  }
}

}  // namespace

cudaError_t launch_gemv(const GemvArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  const int64_t es = scalar_type_size(a.dtype);
  const int64_t vec = 16 / es;
  const bool aligned = aligned16(a.x) && aligned16(a.weight) && (a.x_stride * es) % 16 == 0 &&
                       (a.weight_stride * es) % 16 == 0;
  if (a.m < 0 || a.m > kGemvMaxRows || a.n < 0 || a.k < 0 || a.k % vec != 0 || !aligned) {
    return cudaErrorInvalidValue;
  }
  switch (a.dtype) {
    case ScalarType::kFloat32: dispatch_rows<float>(a, stream); break;
    case ScalarType::kFloat16: dispatch_rows<pl_half>(a, stream); break;
    case ScalarType::kBFloat16: dispatch_rows<pl_bf16>(a, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace pagedllm
