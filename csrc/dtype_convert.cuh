// Conversions between the storage dtypes (float, half, bfloat16) and float, on 16-byte vectors.
// Kernels load 16 bytes at a time as a uint4 and convert to float registers; all math is in float.
// bfloat16 is converted with bit operations (exact, and identical on CUDA and every HIP version).
#pragma once

#include "cuda_compat.h"

namespace pagedllm {

// Number of elements of T in one 16-byte vector.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

// uint4 (16 bytes) -> Vec16<T>::kElems floats.
template <typename T>
PL_DEVICE void vec16_to_float(const uint4& raw, float* out);

template <>
PL_DEVICE void vec16_to_float<float>(const uint4& raw, float* out) {
  out[0] = pl_uint_as_float(raw.x);
  out[1] = pl_uint_as_float(raw.y);
  out[2] = pl_uint_as_float(raw.z);
  out[3] = pl_uint_as_float(raw.w);
}

PL_DEVICE void bf16x2_to_float(uint32_t word, float* out) {
  out[0] = pl_uint_as_float(word << 16);            // element 0: low half (little endian)
  out[1] = pl_uint_as_float(word & 0xffff0000u);    // element 1: high half
}

template <>
PL_DEVICE void vec16_to_float<pl_bf16>(const uint4& raw, float* out) {
  bf16x2_to_float(raw.x, out + 0);
  bf16x2_to_float(raw.y, out + 2);
  bf16x2_to_float(raw.z, out + 4);
  bf16x2_to_float(raw.w, out + 6);
}

PL_DEVICE void halfx2_to_float(uint32_t word, float* out) {
  out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
  out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
}

template <>
PL_DEVICE void vec16_to_float<pl_half>(const uint4& raw, float* out) {
  halfx2_to_float(raw.x, out + 0);
  halfx2_to_float(raw.y, out + 2);
  halfx2_to_float(raw.z, out + 4);
  halfx2_to_float(raw.w, out + 6);
}

// Round-to-nearest-even float -> bfloat16 bits; NaN stays NaN.
PL_DEVICE uint16_t float_to_bf16_bits(float value) {
  uint32_t bits = pl_float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(0x7fc0u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Scalar store of a float into storage type T.
PL_DEVICE void store_from_float(float* ptr, float value) { *ptr = value; }
PL_DEVICE void store_from_float(pl_half* ptr, float value) { *ptr = __float2half(value); }
PL_DEVICE void store_from_float(pl_bf16* ptr, float value) {
  *reinterpret_cast<uint16_t*>(ptr) = float_to_bf16_bits(value);
}

}  // namespace pagedllm
