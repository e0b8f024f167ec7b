// 4-bit weight-only linears: a GEMV for decode (few rows, memory bound: each weight word is read
// once and applied to every row) and a tiled GEMM for prefill (x and dequantized W tiles in shared
// memory, each thread a 2 x 2 block of outputs). Layout and arithmetic: quant_ops.h.
#include "../dtype_convert.cuh"
#include "quant_ops.h"

namespace pagedllm {
namespace {

constexpr int kGemvWarps = 4;  // rows of W per GEMV block: one warp each
constexpr int kTile = 32;      // GEMM tile: 32 rows of x x 32 rows of W x 32 inputs
constexpr int kGemmThreads = 256;

PL_DEVICE float load_elem(const float* p) { return *p; }
PL_DEVICE float load_elem(const pl_half* p) { return __half2float(*p); }
PL_DEVICE float load_elem(const pl_bf16* p) {
  return pl_uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

// grid = (ceil(n / kGemvWarps)); warp w of block b computes row n = b * kGemvWarps + w of W for
// all m <= kInt4GemvMaxRows rows of x. Lanes stride over the row's words; a warp reduction ends it.
template <typename T>
__global__ void PL_LAUNCH_BOUNDS(kGemvWarps * WARP_SIZE) int4_gemv_kernel(Int4LinearArgs a) {
  pl_release_and_wait();
  const int lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int n = static_cast<int>(blockIdx.x) * kGemvWarps + static_cast<int>(threadIdx.x) / WARP_SIZE;
  const bool active = n < a.n;  // inactive warps still take part in nothing warp-wide but exit
  const int words = a.k / 8;
  const int groups = a.k / a.group_size;
  const T* x = static_cast<const T*>(a.x);
  float acc[kInt4GemvMaxRows];
#pragma unroll
  for (int m = 0; m < kInt4GemvMaxRows; ++m) acc[m] = 0.f;
  if (active) {
    const uint32_t* row = a.qweight + static_cast<int64_t>(n) * words;
    for (int w = lane; w < words; w += WARP_SIZE) {
      const uint32_t word = row[w];
      const int g = (8 * w) / a.group_size;
      const float scale = a.scales[static_cast<int64_t>(n) * groups + g];
      const float offset = a.offsets[static_cast<int64_t>(n) * groups + g];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float wv = static_cast<float>((word >> (4 * j)) & 0xFu) * scale + offset;
        const int k = 8 * w + j;
#pragma unroll
        for (int m = 0; m < kInt4GemvMaxRows; ++m) {
          if (m < a.m) acc[m] += wv * load_elem(x + m * a.x_stride + k);
        }
      }
    }
  }
  // every lane of the warp reaches the shuffles (n is uniform across a warp)
#pragma unroll
  for (int m = 0; m < kInt4GemvMaxRows; ++m) {
    float v = acc[m];
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) v += pl_shfl_xor(v, mask);
    acc[m] = v;
  }
  if (active && lane == 0) {
    T* y = static_cast<T*>(a.y);
    for (int m = 0; m < a.m; ++m) store_from_float(y + m * a.y_stride + n, acc[m]);
  }
}

// grid = (ceil(n / kTile), ceil(m / kTile)); 256 threads as 16 x 16, thread (ty, tx) owns outputs
// rows {ty, ty + 16} x columns {tx, tx + 16} of the tile. Per 32-input step: 1,024 x values and
// 128 weight words (32 rows x 4 words, one group: group_size is a multiple of 32) are staged.
template <typename T>
__global__ void PL_LAUNCH_BOUNDS(kGemmThreads) int4_gemm_kernel(Int4LinearArgs a) {
  pl_release_and_wait();
  __shared__ float xs[kTile][kTile + 1];  // [x row][input]
  __shared__ float ws[kTile][kTile + 1];  // [W row][input]
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const int n0 = static_cast<int>(blockIdx.x) * kTile;
  const int m0 = static_cast<int>(blockIdx.y) * kTile;
  const int words = a.k / 8;
  const int groups = a.k / a.group_size;
  const T* x = static_cast<const T*>(a.x);
  float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  for (int k0 = 0; k0 < a.k; k0 += kTile) {
    for (int i = tid; i < kTile * kTile; i += kGemmThreads) {
      const int r = i / kTile, c = i % kTile;
      xs[r][c] = (m0 + r < a.m) ? load_elem(x + static_cast<int64_t>(m0 + r) * a.x_stride + k0 + c)
                                : 0.f;
    }
    if (tid < kTile * 4) {
      const int r = tid / 4, wi = tid % 4;
      const int n = n0 + r;
      float vals[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (n < a.n) {
        const uint32_t word = a.qweight[static_cast<int64_t>(n) * words + k0 / 8 + wi];
        const int g = k0 / a.group_size;
        const float scale = a.scales[static_cast<int64_t>(n) * groups + g];
        const float offset = a.offsets[static_cast<int64_t>(n) * groups + g];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          vals[j] = static_cast<float>((word >> (4 * j)) & 0xFu) * scale + offset;
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ws[r][wi * 8 + j] = vals[j];
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kTile; ++kk) {
      const float x0 = xs[ty][kk], x1 = xs[ty + 16][kk];
      const float w0 = ws[tx][kk], w1 = ws[tx + 16][kk];
      acc[0][0] += x0 * w0;
      acc[0][1] += x0 * w1;
      acc[1][0] += x1 * w0;
      acc[1][1] += x1 * w1;
    }
    __syncthreads();
  }
  T* y = static_cast<T*>(a.y);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < a.m && n < a.n) store_from_float(y + static_cast<int64_t>(m) * a.y_stride + n, acc[i][j]);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const Int4LinearArgs& a, cudaStream_t stream) {
  if (a.m <= kInt4GemvMaxRows) {
    launch_kernel(int4_gemv_kernel<T>, dim3((a.n + kGemvWarps - 1) / kGemvWarps),
                  dim3(kGemvWarps * WARP_SIZE), stream, a);
  } else {
    launch_kernel(int4_gemm_kernel<T>, dim3((a.n + kTile - 1) / kTile, (a.m + kTile - 1) / kTile),
                  dim3(kGemmThreads), stream, a);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_int4_linear(const Int4LinearArgs& args, cudaStream_t stream) {
  if (!int4_linear_supports(args.k, args.group_size) || args.m < 0 || args.n < 0) {
    return cudaErrorInvalidValue;
  }
  if (args.m == 0 || args.n == 0) return cudaSuccess;
  switch (args.dtype) {
    case ScalarType::kFloat32:
      return launch_typed<float>(args, stream);
    case ScalarType::kFloat16:
      return launch_typed<pl_half>(args, stream);
    case ScalarType::kBFloat16:
      return launch_typed<pl_bf16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedllm
