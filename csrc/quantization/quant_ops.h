// Torch-free launcher API of the weight-only quantized linears (csrc/quantization/).
#pragma once

#include <cstdint>

#include "../ops.h"

namespace pagedllm {

// y[M, N] = x[M, K] . W^T with 4-bit W in pagedllm's GPU layout (made once at load time from any
// 4-bit checkpoint, GPTQ without act order, AWQ or compressed-tensors W4A16):
//   qweight  uint32 [N, K / 8]: word w of row n holds input k = 8 w + j in bits [4 j, 4 j + 4)
//   scales   float  [N, K / group_size], offsets float [N, K / group_size]:
//            w[n, k] = q * scale + offset (offset = -zero_point * scale)
// x and y are of `dtype`, rows contiguous with strides x_stride / y_stride (elements). Products
// accumulate in float32; y is rounded once to dtype.
struct Int4LinearArgs {
  ScalarType dtype;
  void* y;
  int64_t y_stride;
  const void* x;
  int64_t x_stride;
  const uint32_t* qweight;
  const float* scales;
  const float* offsets;
  int m, n, k;
  int group_size;  // a multiple of 32 dividing k
};

// Rows of x up to which the GEMV (decode) kernel runs; more rows take the tiled GEMM (prefill).
constexpr int kInt4GemvMaxRows = 8;

inline bool int4_linear_supports(int64_t k, int64_t group_size) {
  return group_size >= 32 && group_size % 32 == 0 && k > 0 && k % group_size == 0;
}

// Picks the GEMV for m <= kInt4GemvMaxRows, else the GEMM. cudaErrorInvalidValue for shapes
// int4_linear_supports refuses.
cudaError_t launch_int4_linear(const Int4LinearArgs& args, cudaStream_t stream);

}  // namespace pagedllm
