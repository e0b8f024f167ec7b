// The arithmetic of one weight stage of a one-token GEMV, shared by gemv_kernels.cu and the
// one-launch decode step (decode_step_linear.cuh), so that both round exactly alike.
#pragma once

#include "dtype_convert.cuh"

namespace pagedllm {

// Thread t multiplies its x vectors t + THREADS * j (16-bit elements as floats; only those below
// k / 8 exist) with the same vectors of each of the stage's nr rows (row r at src + r * k), sums over
// its warp, and leaves warp w's sum for row r in partial[r][w] (rows nr..ROWS-1 get 0).
template <typename T, int KV, int ROWS, int THREADS>
PL_DEVICE void gemv_stage_partials(const T* src, int k, int nr, const float (&x)[KV][8],
                                   float (&partial)[ROWS][THREADS / WARP_SIZE]) {
  static_assert(Vec16<T>::kElems == 8, "16-bit dtypes only");
  const int tid = static_cast<int>(threadIdx.x);
  const int k_vecs = k / 8;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = 0.f;
    if (r < nr) {
#pragma unroll
      for (int j = 0; j < KV; ++j) {
        const int v = tid + j * THREADS;
        if (v < k_vecs) {
          float w[8];
          vec16_to_float<T>(*reinterpret_cast<const uint4*>(src + r * k + v * 8), w);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] += w[e] * x[j][e];
        }
      }
    }
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off /= 2) acc[r] += pl_shfl_xor(acc[r], off);
    if (tid % WARP_SIZE == 0) partial[r][tid / WARP_SIZE] = acc[r];
  }
}

}  // namespace pagedllm
