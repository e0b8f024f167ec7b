// The arithmetic of one weight stage of a one-token GEMV (gemv_kernels.cu).
#pragma once

#include "dtype_convert.cuh"

namespace pagedllm {

// A weight stage's geometry: a stage holds up to kGemvStageBytes of whole rows, at most
// kGemvMaxStageRows of them, read by kGemvThreads threads (8 16-bit elements per thread per vector).
constexpr int kGemvThreads = 256;
constexpr int kGemvStageBytes = 32 * 1024;
constexpr int kGemvMaxStageRows = 4;

// Whole rows of K 16-bit elements per stage: as many as fit kGemvStageBytes, 1 to
// kGemvMaxStageRows.
__host__ __device__ constexpr int gemv_stage_rows(int k) {
  const int rows = kGemvStageBytes / (k * 2);
  return rows < 1 ? 1 : (rows > kGemvMaxStageRows ? kGemvMaxStageRows : rows);
}

// The most rows a stage has for any K that threads hold in KV vectors each, i.e. the shortest
// such K, (KV - 1) * THREADS + 1 vectors (KV <= 2: 4, KV 3: 3, KV 4: 2, longer rows: 1). The
// stage code is compiled for this many rows, so a stage never spends instructions on rows it
// cannot have.
template <int KV, int THREADS>
__host__ __device__ constexpr int gemv_max_stage_rows() {
  return gemv_stage_rows(((KV - 1) * THREADS + 1) * 8);
}
static_assert(gemv_max_stage_rows<2, kGemvThreads>() == 4 &&
                  gemv_max_stage_rows<3, kGemvThreads>() == 3 &&
                  gemv_max_stage_rows<4, kGemvThreads>() == 2 &&
                  gemv_max_stage_rows<5, kGemvThreads>() == 1,
              "stage rows per vector count");

// Thread t multiplies its x vectors t + THREADS * j (16-bit elements as floats) with the same
// vectors of each of the stage's nr rows (row r at src + r * k), sums over its warp, and leaves
// warp w's sum for row r in partial[r][w] (rows nr..ROWS-1 get 0). Vectors at or past k / 8 must
// have x = 0: they multiply the row's last vector again (a valid address, no branch around the
// load).
//
// Written for instruction-level parallelism, since one 8-warp block per SM leaves each scheduler
// two warps to hide latency with: the loads of a pass are unconditional (rows past nr re-read row
// nr - 1 and are discarded) so the compiler issues them ahead of the math, each (row, vector) pair
// sums its 8 products in its own chain, and the rows' warp reductions run interleaved. A row's sum
// is sum_j (sum_e w[j][e] * x[j][e]), then the butterfly over the warp. One pass of kRows rows
// covers the stage unless x has more vectors than k needs.
template <typename T, int KV, int ROWS, int THREADS>
PL_DEVICE void gemv_stage_partials(const T* src, int k, int nr, const float (&x)[KV][8],
                                   float (&partial)[ROWS][THREADS / WARP_SIZE]) {
  static_assert(Vec16<T>::kElems == 8, "16-bit dtypes only");
  constexpr int kMaxRows = gemv_max_stage_rows<KV, THREADS>();
  constexpr int kRows = kMaxRows < ROWS ? kMaxRows : ROWS;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % WARP_SIZE;
  const int k_vecs = k / 8;
  for (int base = 0; base < nr; base += kRows) {
    uint4 w[kRows][KV];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const T* row = src + static_cast<int64_t>(base + r < nr ? base + r : nr - 1) * k;
#pragma unroll
      for (int j = 0; j < KV; ++j) {
        const int v = tid + j * THREADS;
        w[r][j] = *reinterpret_cast<const uint4*>(row + (v < k_vecs ? v : k_vecs - 1) * 8);
      }
    }
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float part[KV];
#pragma unroll
      for (int j = 0; j < KV; ++j) {
        float wf[8];
        vec16_to_float<T>(w[r][j], wf);
        part[j] = wf[0] * x[j][0];
#pragma unroll
        for (int e = 1; e < 8; ++e) part[j] = fmaf(wf[e], x[j][e], part[j]);
      }
      acc[r] = part[0];
#pragma unroll
      for (int j = 1; j < KV; ++j) acc[r] += part[j];
    }
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off /= 2) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] += pl_shfl_xor(acc[r], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (base + r < nr) partial[base + r][tid / WARP_SIZE] = acc[r];
      }
    }
  }
  if (lane == 0) {
    for (int r = nr; r < ROWS; ++r) partial[r][tid / WARP_SIZE] = 0.f;
  }
}

}  // namespace pagedllm
