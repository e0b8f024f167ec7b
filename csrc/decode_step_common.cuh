// Shared pieces of the one-launch decode step (decode_step_kernel.cu): its thread layout, warp and
// block reductions, dtype rounding, loads of data other blocks wrote, and the grid barrier.
#pragma once

#include <cmath>
#include <type_traits>

#include "dtype_convert.cuh"
#include "gemv_stage.cuh"
#include "ops.h"

namespace pagedllm {
namespace decode_step_detail {

constexpr int kThreads = kGemvThreads;  // the stage geometry is the GEMV's (gemv_stage.cuh)
constexpr int kWarps = kThreads / WARP_SIZE;
constexpr int kStageBytes = kGemvStageBytes;
constexpr int kMaxStageRows = kGemvMaxStageRows;
constexpr int kVec = 8;                      // elements of a 16-byte vector (16-bit dtypes)
// Vectors per thread (vector j of thread t: elements (t + 256 j) * 8 ...): the kernel is compiled for
// HV (hidden size, and q size for o_proj) and IV (intermediate size) in these sets, rounded up, so
// that no GEMV stage issues instructions for vectors it does not have.
constexpr int kMaxVecs = 8;                  // K <= 8 * 256 * 8 = 16384
constexpr int kHead = kDecodeStepHeadSize;
constexpr int kRowLanes = kHead / kVec;      // lanes that read one K/V row (16)
constexpr int kTokenSlots = kThreads / kRowLanes;  // tokens per pass over a partition (16)
constexpr int kAttnUnroll = 4;               // passes whose loads are in flight together
constexpr int kMaxGqa = kDecodeStepMaxGqa;
constexpr int kLinearsPerLayer = 4;          // qkv, o_proj, gate_up, down

PL_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int off = WARP_SIZE / 2; off > 0; off /= 2) v += pl_shfl_xor(v, off);
  return v;
}
PL_DEVICE float warp_max(float v) {
#pragma unroll
  for (int off = WARP_SIZE / 2; off > 0; off /= 2) v = fmaxf(v, pl_shfl_xor(v, off));
  return v;
}

template <typename T>
PL_DEVICE float round_to(float v);
template <>
PL_DEVICE float round_to<pl_bf16>(float v) {
  return pl_uint_as_float(static_cast<uint32_t>(float_to_bf16_bits(v)) << 16);
}
template <>
PL_DEVICE float round_to<pl_half>(float v) { return __half2float(__float2half(v)); }

template <typename T>
PL_DEVICE float to_float(unsigned short bits);
template <>
PL_DEVICE float to_float<pl_bf16>(unsigned short bits) {
  return pl_uint_as_float(static_cast<uint32_t>(bits) << 16);
}
template <>
PL_DEVICE float to_float<pl_half>(unsigned short bits) {
  return __half2float(__ushort_as_half(bits));
}
template <typename T>
PL_DEVICE float load_scalar(const T* p) {
  return to_float<T>(*reinterpret_cast<const unsigned short*>(p));
}
template <typename T>
PL_DEVICE float load_scalar_coherent(const T* p) {
  return to_float<T>(pl_load_coherent_u16(p));
}

// ---- grid barrier ------------------------------------------------------------------------------

// Every block arrives once; returns when all gridDim.x blocks have arrived `*ordinal` times.
PL_DEVICE void grid_sync(unsigned* counter, unsigned& ordinal) {
  ++ordinal;
  __threadfence();  // this thread's global writes, visible to the device before the arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(counter, 1u);
    pl_spin_until(counter, ordinal * gridDim.x);
    __threadfence();
  }
  __syncthreads();
}

// Sum over the block, as layer_kernels.cu's block_sum adds it up; `slots` holds kWarps + 1 floats.
PL_DEVICE float block_sum(float value, float* slots) {
  for (int mask = WARP_SIZE / 2; mask > 0; mask >>= 1) value += pl_shfl_xor(value, mask);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid % WARP_SIZE == 0) slots[tid / WARP_SIZE] = value;
  __syncthreads();
  if (tid == 0) {
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += slots[w];
    slots[kWarps] = sum;
  }
  __syncthreads();
  return slots[kWarps];
}

// 8 floats rounded to T, packed (the bits a T store would write).
template <typename T>
PL_DEVICE uint4 pack(const float (&f)[kVec]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t lo, hi;
    if constexpr (sizeof(T) == 2 && std::is_same<T, pl_half>::value) {
      lo = __half_as_ushort(__float2half(f[2 * k]));
      hi = __half_as_ushort(__float2half(f[2 * k + 1]));
    } else {
      lo = float_to_bf16_bits(f[2 * k]);
      hi = float_to_bf16_bits(f[2 * k + 1]);
    }
    w[k] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace decode_step_detail
}  // namespace pagedllm
