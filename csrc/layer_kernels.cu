// Fused elementwise layer ops: rms_norm (with the residual add), neox rotary embedding (alone, or
// in place in the qkv projection together with the K/V cache write) and silu_and_mul; one launch
// each in place of the 2-5 torch kernels of the reference ops (pagedllm/models/layers/ops.py).
//
// Rounding follows the reference op by op: every value the reference materializes in the tensor
// dtype (x + residual, the normalized row, each product of the rotary, silu(gate), the outputs) is
// rounded to that dtype here too, and products and sums that the reference runs as separate
// kernels use pl_fmul_rn / pl_fadd_rn (never fused into an FMA). So rotary is bit-identical to the
// reference in every dtype, and silu_and_mul wherever expf is the function torch uses (the CUDA and
// HIP device libraries). rms_norm sums the squares in another order than torch's reduction: its
// normalized value can land one ulp of the dtype away when it is that close to a rounding boundary.
//
// Memory access: 16-byte vectors of Vec16<T>::kElems elements when every pointer, row stride and
// row length allows it, else one element per access.
#include "dtype_convert.cuh"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kThreads = 256;
// rotary_and_cache: one pass of a block covers a token's q and k pairs and v vectors for models up
// to 32 + 8 + 8 heads of 128 (448 16-byte units), so each thread's loads go out in one round trip
// (a second iteration's loads would wait behind the first one's in-place stores).
constexpr int kRotaryCacheThreads = 512;

// ---- element access ---------------------------------------------------------------------------

PL_DEVICE float load_scalar(const float* p) { return *p; }
PL_DEVICE float load_scalar(const pl_half* p) { return __half2float(*p); }
PL_DEVICE float load_scalar(const pl_bf16* p) {
  return pl_uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

// N consecutive elements at p as floats; N is 1 or Vec16<T>::kElems (p then 16-byte aligned).
template <typename T, int N>
PL_DEVICE void load(const T* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = load_scalar(p);
  } else {
    vec16_to_float<T>(*reinterpret_cast<const uint4*>(p), out);
  }
}

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

// Stores N floats at p, each rounded to T (same N and alignment rule as load).
template <typename T, int N>
PL_DEVICE void store(T* p, const float (&in)[N]) {
  if constexpr (N == 1) {
    store_from_float(p, in[0]);
  } else if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pl_float_as_uint(in[0]), pl_float_as_uint(in[1]),
                                              pl_float_as_uint(in[2]), pl_float_as_uint(in[3]));
  } else {
    uint32_t words[4];
    for (int k = 0; k < 4; ++k) words[k] = bits16<T>(in[2 * k]) | (bits16<T>(in[2 * k + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// Sum over the kThreads threads of the block, returned to every thread. Once per kernel (the
// shared slots are not fenced for reuse).
PL_DEVICE float block_sum(float value) {
  __shared__ float warp_sums[kThreads / WARP_SIZE];
  __shared__ float total;
  for (int mask = WARP_SIZE / 2; mask > 0; mask >>= 1) value += pl_shfl_xor(value, mask);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid % WARP_SIZE == 0) warp_sums[tid / WARP_SIZE] = value;
  __syncthreads();
  if (tid == 0) {
    float sum = 0.f;
    for (int w = 0; w < kThreads / WARP_SIZE; ++w) sum += warp_sums[w];
    total = sum;
  }
  __syncthreads();
  return total;
}

// ---- kernels ----------------------------------------------------------------------------------

// Rows of at most kThreads * kRowUnits accesses run from registers: every load of the row in one
// round trip (the weight's before waiting for the previous kernel: it is no kernel's output), h
// kept for the second pass. At batch 1 the norm is one block between two weight-streaming GEMVs,
// so its latency is the step's (the layer-by-layer round trips measured 3-5 us more than
// silu_and_mul's one pass).
constexpr int kRowUnits = 4;

template <typename T, int N>
PL_DEVICE void load_row(const T* p, int units, float (&out)[kRowUnits][N]) {
#pragma unroll
  for (int k = 0; k < kRowUnits; ++k) {
    const int u = static_cast<int>(threadIdx.x) + k * kThreads;
    if (u < units) load<T, N>(p + u * N, out[k]);
  }
}

// grid = (num_tokens); one block normalizes one row, N elements per access.
template <typename T, int N>
__global__ void PL_LAUNCH_BOUNDS(kThreads) rms_norm_kernel(RmsNormArgs a) {
  const int units = a.hidden_size / N;
  const bool in_registers = units <= kThreads * kRowUnits;
  const T* weight = static_cast<const T*>(a.weight);
  float w[kRowUnits][N];
  if (in_registers) load_row<T, N>(weight, units, w);
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int64_t token = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + token * a.x_stride;
  const bool add_residual = a.residual != nullptr;
  const T* residual = nullptr;  // this token's rows of residual and residual_out
  T* h_out = nullptr;
  if (add_residual) {
    residual = static_cast<const T*>(a.residual) + token * a.residual_stride;
    h_out = static_cast<T*>(a.residual_out) + token * a.hidden_size;
  }
  T* out = static_cast<T*>(a.out) + token * a.hidden_size;

  if (in_registers) {  // a thread's units are u = tid + k * kThreads, as in the loops below
    float h[kRowUnits][N], r[kRowUnits][N];
    load_row<T, N>(x, units, h);
    if (add_residual) load_row<T, N>(residual, units, r);
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kRowUnits; ++k) {
      const int u = static_cast<int>(threadIdx.x) + k * kThreads;
      if (u < units) {
        if (add_residual) {
          for (int j = 0; j < N; ++j) h[k][j] = round_to<T>(h[k][j] + r[k][j]);
          store<T, N>(h_out + u * N, h[k]);
        }
        for (int j = 0; j < N; ++j) sum_sq += h[k][j] * h[k][j];
      }
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(a.hidden_size) + a.eps);
#pragma unroll
    for (int k = 0; k < kRowUnits; ++k) {
      const int u = static_cast<int>(threadIdx.x) + k * kThreads;
      if (u < units) {
        for (int j = 0; j < N; ++j) {
          h[k][j] = pl_fmul_rn(w[k][j], round_to<T>(pl_fmul_rn(h[k][j], inv_rms)));
        }
        store<T, N>(out + u * N, h[k]);
      }
    }
    return;
  }

  float sum_sq = 0.f;
  for (int u = static_cast<int>(threadIdx.x); u < units; u += kThreads) {
    float h[N];
    load<T, N>(x + u * N, h);
    if (add_residual) {
      float r[N];
      load<T, N>(residual + u * N, r);
      for (int j = 0; j < N; ++j) h[j] = round_to<T>(h[j] + r[j]);
      store<T, N>(h_out + u * N, h);
    }
    for (int j = 0; j < N; ++j) sum_sq += h[j] * h[j];
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(a.hidden_size) + a.eps);

  // Each thread reads back only the h_out elements it wrote itself.
  const T* h_row = add_residual ? h_out : x;
  for (int u = static_cast<int>(threadIdx.x); u < units; u += kThreads) {
    float h[N], wv[N];
    load<T, N>(h_row + u * N, h);
    load<T, N>(weight + u * N, wv);
    for (int j = 0; j < N; ++j) h[j] = pl_fmul_rn(wv[j], round_to<T>(pl_fmul_rn(h[j], inv_rms)));
    store<T, N>(out + u * N, h);
  }
}

// Rotates the N element pairs (i, i + half) of one head, x -> out (out may be x):
// out1 = x1 * cos1 + (-x2) * sin1, out2 = x2 * cos2 + x1 * sin2 (rotate_half(x) = [-x2, x1]).
// Also stores the rotated pairs at copy (a cache row) unless it is null.
template <typename T, int N>
PL_DEVICE void rotate_pairs(const T* x, T* out, T* copy, const T* cos, const T* sin, int i,
                            int half) {
  float x1[N], x2[N], c1[N], c2[N], s1[N], s2[N];
  load<T, N>(x + i, x1);
  load<T, N>(x + half + i, x2);
  load<T, N>(cos + i, c1);
  load<T, N>(cos + half + i, c2);
  load<T, N>(sin + i, s1);
  load<T, N>(sin + half + i, s2);
  float o1[N], o2[N];
  for (int j = 0; j < N; ++j) {
    o1[j] = pl_fadd_rn(round_to<T>(pl_fmul_rn(x1[j], c1[j])),
                       round_to<T>(pl_fmul_rn(-x2[j], s1[j])));
    o2[j] = pl_fadd_rn(round_to<T>(pl_fmul_rn(x2[j], c2[j])),
                       round_to<T>(pl_fmul_rn(x1[j], s2[j])));
  }
  store<T, N>(out + i, o1);
  store<T, N>(out + half + i, o2);
  if (copy != nullptr) {
    store<T, N>(copy + i, o1);
    store<T, N>(copy + half + i, o2);
  }
}

// grid = (num_tokens); a thread rotates N element pairs (i, i + head_size / 2) of one head.
template <typename T, int N>
__global__ void PL_LAUNCH_BOUNDS(kThreads) rotary_kernel(RotaryArgs a) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int64_t token = blockIdx.x;
  const int half = a.head_size / 2;
  const int units_per_head = half / N;
  const T* cos = static_cast<const T*>(a.cos) + token * a.cos_stride;
  const T* sin = static_cast<const T*>(a.sin) + token * a.sin_stride;
  const int units = a.num_heads * units_per_head;
  for (int idx = static_cast<int>(threadIdx.x); idx < units; idx += kThreads) {
    const int head = idx / units_per_head;
    const T* x = static_cast<const T*>(a.x) + token * a.x_token_stride + head * a.x_head_stride;
    T* out = static_cast<T*>(a.out) + (token * a.num_heads + head) * a.head_size;
    rotate_pairs<T, N>(x, out, nullptr, cos, sin, (idx % units_per_head) * N, half);
  }
}

// grid = (num_tokens); a thread rotates N element pairs of one q or k head in place (and stores a
// k head's into the key cache), or copies N elements of one v head into the value cache.
template <typename T, int N>
__global__ void PL_LAUNCH_BOUNDS(kRotaryCacheThreads) rotary_and_cache_kernel(RotaryCacheArgs a) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int64_t token = blockIdx.x;
  const int half = a.head_size / 2;
  const int units_per_head = half / N;
  const int rotated_heads = a.num_heads + a.num_kv_heads;
  const int rotary_units = rotated_heads * units_per_head;
  const int v_units_per_head = a.head_size / N;
  const int units = rotary_units + a.num_kv_heads * v_units_per_head;
  const CacheSlots& c = a.cache;
  const int64_t slot = c.slot_mapping[token];
  const bool cached = slot >= 0 && slot < c.num_blocks * c.block_size;  // else padding: no write
  const int64_t block = cached ? slot / c.block_size : 0;
  const int64_t offset = cached ? slot % c.block_size : 0;
  T* row = static_cast<T*>(a.qkv) + token * a.qkv_stride;
  T* k_slot = static_cast<T*>(c.key_cache) + block * c.kc_block_stride + offset * c.kc_token_stride;
  T* v_slot = static_cast<T*>(c.value_cache) + block * c.vc_block_stride +
              offset * c.vc_token_stride;
  const T* cos = static_cast<const T*>(a.cos) + token * a.cos_stride;
  const T* sin = static_cast<const T*>(a.sin) + token * a.sin_stride;
  for (int idx = static_cast<int>(threadIdx.x); idx < units; idx += kRotaryCacheThreads) {
    if (idx < rotary_units) {
      const int head = idx / units_per_head;
      T* x = row + head * a.head_size;
      const int kv_head = head - a.num_heads;  // >= 0 for a k head
      T* copy = cached && kv_head >= 0 ? k_slot + kv_head * c.kc_head_stride : nullptr;
      rotate_pairs<T, N>(x, x, copy, cos, sin, (idx % units_per_head) * N, half);
    } else if (cached) {
      const int v = idx - rotary_units;
      const int head = v / v_units_per_head;
      const int i = (v % v_units_per_head) * N;
      float elems[N];
      load<T, N>(row + (rotated_heads + head) * a.head_size + i, elems);
      store<T, N>(v_slot + head * c.vc_head_stride + i, elems);
    }
  }
}

// grid = (num_tokens, ceil(intermediate_size / N / kThreads)); a thread handles N outputs.
template <typename T, int N>
__global__ void PL_LAUNCH_BOUNDS(kThreads) silu_and_mul_kernel(SiluAndMulArgs a) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int64_t token = blockIdx.x;
  const int i = (static_cast<int>(blockIdx.y) * kThreads + static_cast<int>(threadIdx.x)) * N;
  if (i >= a.intermediate_size) return;
  const T* gate = static_cast<const T*>(a.x) + token * a.x_stride + i;
  float g[N], up[N];
  load<T, N>(gate, g);
  load<T, N>(gate + a.intermediate_size, up);
  for (int j = 0; j < N; ++j) g[j] = pl_fmul_rn(round_to<T>(g[j] / (1.0f + expf(-g[j]))), up[j]);
  store<T, N>(static_cast<T*>(a.out) + token * a.intermediate_size + i, g);
}

// ---- launch helpers ---------------------------------------------------------------------------

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// Whether rows of `elems` elements at `ptr`, `stride` elements apart, allow 16-byte accesses.
bool rows_aligned16(const void* ptr, int64_t stride, int64_t elems, int64_t elem_size) {
  return aligned16(ptr) && (stride * elem_size) % 16 == 0 && (elems * elem_size) % 16 == 0;
}

// Each launcher picks the 16-byte-vector instantiation (N = Vec16<T>::kElems) or the scalar one.
template <typename T>
void rms_norm_for(const RmsNormArgs& a, bool vec, cudaStream_t stream) {
  launch_kernel(vec ? rms_norm_kernel<T, Vec16<T>::kElems> : rms_norm_kernel<T, 1>,
                dim3(a.num_tokens), dim3(kThreads), stream, a);
}

template <typename T>
void rotary_for(const RotaryArgs& a, bool vec, cudaStream_t stream) {
  launch_kernel(vec ? rotary_kernel<T, Vec16<T>::kElems> : rotary_kernel<T, 1>, dim3(a.num_tokens),
                dim3(kThreads), stream, a);
}

template <typename T>
void rotary_and_cache_for(const RotaryCacheArgs& a, bool vec, cudaStream_t stream) {
  launch_kernel(vec ? rotary_and_cache_kernel<T, Vec16<T>::kElems> : rotary_and_cache_kernel<T, 1>,
                dim3(a.num_tokens), dim3(kRotaryCacheThreads), stream, a);
}

template <typename T>
void silu_and_mul_for(const SiluAndMulArgs& a, bool vec, cudaStream_t stream) {
  const int n = vec ? Vec16<T>::kElems : 1;
  const int units = (a.intermediate_size + n - 1) / n;
  const dim3 grid(a.num_tokens, (units + kThreads - 1) / kThreads);
  launch_kernel(vec ? silu_and_mul_kernel<T, Vec16<T>::kElems> : silu_and_mul_kernel<T, 1>, grid,
                dim3(kThreads), stream, a);
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens < 0 || a.hidden_size <= 0) return cudaErrorInvalidValue;
  const int64_t es = scalar_type_size(a.dtype);
  const int64_t h = a.hidden_size;
  const bool residual_vec = a.residual == nullptr ||
                            (rows_aligned16(a.residual, a.residual_stride, h, es) &&
                             rows_aligned16(a.residual_out, h, h, es));
  const bool vec = rows_aligned16(a.x, a.x_stride, h, es) && rows_aligned16(a.out, h, h, es) &&
                   aligned16(a.weight) && residual_vec;
  switch (a.dtype) {
    case ScalarType::kFloat32: rms_norm_for<float>(a, vec, stream); break;
    case ScalarType::kFloat16: rms_norm_for<pl_half>(a, vec, stream); break;
    case ScalarType::kBFloat16: rms_norm_for<pl_bf16>(a, vec, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_rotary(const RotaryArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_heads == 0) return cudaSuccess;
  if (a.num_tokens < 0 || a.num_heads < 0 || a.head_size <= 0 || a.head_size % 2 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t es = scalar_type_size(a.dtype);
  const int64_t half = a.head_size / 2;
  // every half row starts on a 16-byte boundary: x rows, heads and halves; cos/sin rows and halves
  const bool vec = rows_aligned16(a.x, a.x_token_stride, half, es) &&
                   (a.x_head_stride * es) % 16 == 0 && rows_aligned16(a.out, half, half, es) &&
                   rows_aligned16(a.cos, a.cos_stride, half, es) &&
                   rows_aligned16(a.sin, a.sin_stride, half, es);
  switch (a.dtype) {
    case ScalarType::kFloat32: rotary_for<float>(a, vec, stream); break;
    case ScalarType::kFloat16: rotary_for<pl_half>(a, vec, stream); break;
    case ScalarType::kBFloat16: rotary_for<pl_bf16>(a, vec, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_rotary_and_cache(const RotaryCacheArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens < 0 || a.num_heads <= 0 || a.num_kv_heads <= 0 || a.head_size <= 0 ||
      a.head_size % 2 != 0 || a.cache.block_size <= 0 || a.cache.num_blocks < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t es = scalar_type_size(a.dtype);
  const int64_t half = a.head_size / 2;
  const CacheSlots& c = a.cache;
  const auto strides16 = [es](int64_t x, int64_t y, int64_t z) {
    return (x * es) % 16 == 0 && (y * es) % 16 == 0 && (z * es) % 16 == 0;
  };
  // every half row starts on a 16-byte boundary: qkv rows and heads, cos/sin rows, cache rows
  const bool vec = rows_aligned16(a.qkv, a.qkv_stride, half, es) &&
                   rows_aligned16(a.cos, a.cos_stride, half, es) &&
                   rows_aligned16(a.sin, a.sin_stride, half, es) && aligned16(c.key_cache) &&
                   aligned16(c.value_cache) &&
                   strides16(c.kc_block_stride, c.kc_token_stride, c.kc_head_stride) &&
                   strides16(c.vc_block_stride, c.vc_token_stride, c.vc_head_stride);
  switch (a.dtype) {
    case ScalarType::kFloat32: rotary_and_cache_for<float>(a, vec, stream); break;
    case ScalarType::kFloat16: rotary_and_cache_for<pl_half>(a, vec, stream); break;
    case ScalarType::kBFloat16: rotary_and_cache_for<pl_bf16>(a, vec, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_silu_and_mul(const SiluAndMulArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.intermediate_size == 0) return cudaSuccess;
  if (a.num_tokens < 0 || a.intermediate_size < 0) return cudaErrorInvalidValue;
  const int64_t es = scalar_type_size(a.dtype);
  const int64_t inter = a.intermediate_size;
  const bool vec =
      rows_aligned16(a.x, a.x_stride, inter, es) && rows_aligned16(a.out, inter, inter, es);
  if ((inter + kThreads - 1) / kThreads > 65535) return cudaErrorInvalidValue;  // grid.y limit
  switch (a.dtype) {
    case ScalarType::kFloat32: silu_and_mul_for<float>(a, vec, stream); break;
    case ScalarType::kFloat16: silu_and_mul_for<pl_half>(a, vec, stream); break;
    case ScalarType::kBFloat16: silu_and_mul_for<pl_bf16>(a, vec, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace pagedllm
