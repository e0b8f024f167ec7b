// Scalar math the layer kernels and the GEMV's fused epilogues share, with the torch reference's
// rounding points (pagedllm/models/layers/ops.py), so a fused kernel gives the same bits as the
// separate ones.
#pragma once

#include "dtype_convert.cuh"

namespace pagedllm {

// Storage bits of a float rounded to nearest even in the 16-bit type T.
template <typename T>
PL_DEVICE uint32_t bits16(float value);
template <>
PL_DEVICE uint32_t bits16<pl_half>(float value) { return __half_as_ushort(__float2half(value)); }
template <>
PL_DEVICE uint32_t bits16<pl_bf16>(float value) { return float_to_bf16_bits(value); }

// A float rounded to nearest even in T, as a float (what a torch op storing T then reading it
// back sees).
template <typename T>
PL_DEVICE float round_to(float value);
template <>
PL_DEVICE float round_to<float>(float value) { return value; }
template <>
PL_DEVICE float round_to<pl_half>(float value) { return __half2float(__float2half(value)); }
template <>
PL_DEVICE float round_to<pl_bf16>(float value) {
  return pl_uint_as_float(bits16<pl_bf16>(value) << 16);
}

// silu(gate) * up for one element of silu_and_mul: gate and up are T values read as floats;
// silu(gate) is rounded to T before the product, as the reference's F.silu output is (the store
// rounds the product).
template <typename T>
PL_DEVICE float silu_and_mul_value(float gate, float up) {
  return pl_fmul_rn(round_to<T>(gate / (1.0f + expf(-gate))), up);
}

}  // namespace pagedllm
