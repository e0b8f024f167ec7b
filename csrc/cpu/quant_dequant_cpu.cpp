// The cpu backend's INT4 dequantize route (pagedllm/backends/cpu/quant_ops.py): at many rows the
// weight is dequantized into a scratch buffer and the dense GEMM runs on it.
//
//   int4pack_dequant(packed [N, K / 2] uint8, scales_zeros [G, N, 2] float32/bf16, group_size,
//                    block_n, out [K, N] float32/bf16 (the scales' dtype)) -> out
//     out = W^T (x @ W^T is F.linear(x, out.t()); this layout makes every load and store
//     contiguous): out[k, n] = (q[n, k] - 8) * scale[g, n] + offset[g, n], g = k / group_size,
//     in float32, rounded once to out's dtype (round to nearest even), the formula of
//     torch._weight_int4pack_mm_for_cpu.
//   q is torch._convert_weight_to_int4pack_for_cpu's layout for N % block_n == 0, which
//   depends on the CPU capability torch dispatches to: block_n = 64 on AVX-512, 32 on AVX2
//   (pagedllm/backends/cpu/quant_ops.py probes it once). packed viewed as
//   [N / B, K, B / 2] bytes, byte (b, k, d) = q[B b + d, k] | q[B b + B / 2 + d, k] << 4.
//
// Registered as torch.ops.pagedllm_cpu.int4pack_dequant (a fragment of the library
// paged_attention_cpu.cpp defines).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxBlockN = 64;  // rows per packed block: 64 (AVX-512) or 32 (AVX2)

#if defined(__AVX512F__)
// 16 floats -> 16 bf16, round to nearest even (finite inputs: the dequantized weights).
inline void store_bf16(c10::BFloat16* dst, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}
#endif

// One packed block's output channels [B b, B b + B) for every column: out is W^T [K, N], so
// byte (b, k, d) gives out[k, B b + d] (low nibble) and out[k, B b + B / 2 + d] (high nibble),
// B / 2 contiguous values each. The scale and offset of the block's B channels are widened to
// float once per group.
template <typename T>
void dequant_block(const uint8_t* blk, const T* sz, int64_t n_total, int64_t b, int64_t k,
                   int64_t gs, int64_t block_n, T* out) {
  const int64_t half_n = block_n / 2;
  alignas(64) float scale[kMaxBlockN];
  alignas(64) float offset[kMaxBlockN];
  for (int64_t g = 0; g < k / gs; ++g) {
    for (int64_t i = 0; i < block_n; ++i) {
      const T* p = sz + (g * n_total + b * block_n + i) * 2;
      scale[i] = static_cast<float>(p[0]);
      offset[i] = static_cast<float>(p[1]);
    }
    for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
      const uint8_t* bytes = blk + c * half_n;  // [B / 2]
      T* dst = out + c * n_total + b * block_n;  // [B]
#if defined(__AVX512F__)
      const __m512 eight = _mm512_set1_ps(8.0f);
      for (int64_t d0 = 0; d0 < half_n; d0 += 16) {
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + d0)));
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF));
        const __m512i hi = _mm512_srli_epi32(v, 4);
        for (int half = 0; half < 2; ++half) {
          const int64_t i = half * half_n + d0;
          const __m512 w = _mm512_add_ps(
              _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(half ? hi : lo), eight),
                            _mm512_load_ps(scale + i)),
              _mm512_load_ps(offset + i));
          if constexpr (std::is_same_v<T, float>) {
            _mm512_storeu_ps(dst + i, w);
          } else {
            store_bf16(dst + i, w);
          }
        }
      }
#else
      for (int64_t d = 0; d < half_n; ++d) {
        for (int half = 0; half < 2; ++half) {
          const int64_t i = half * half_n + d;
          const int q = half ? (bytes[d] >> 4) : (bytes[d] & 0xF);
          dst[i] = static_cast<T>((static_cast<float>(q) - 8.0f) * scale[i] + offset[i]);
        }
      }
#endif
    }
  }
}

template <typename T>
void dequant(const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t gs,
             int64_t block_n, at::Tensor& out) {
  const int64_t k = out.size(0), n = out.size(1);
  const uint8_t* pp = packed.const_data_ptr<uint8_t>();
  const T* sz = scales_zeros.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n / block_n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      dequant_block<T>(pp + b * k * (block_n / 2), sz, n, b, k, gs, block_n, op);
    }
  });
}

at::Tensor int4pack_dequant(const at::Tensor& packed, const at::Tensor& scales_zeros,
                            int64_t group_size, int64_t block_n, at::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.device().is_cpu(),
              "out must be a contiguous 2-D CPU tensor [K, N], got sizes ", out.sizes());
  TORCH_CHECK(block_n == 32 || block_n == 64, "block_n must be 32 (AVX2) or 64 (AVX-512), got ",
              block_n);
  const int64_t k = out.size(0), n = out.size(1);
  TORCH_CHECK(n % block_n == 0, "int4pack_dequant takes N % block_n == 0 (torch's packed "
              "layout for it), got N=", n, ", block_n=", block_n);
  TORCH_CHECK(group_size > 0 && k % group_size == 0,
              "group_size must be positive and divide K=", k, ", got ", group_size);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == n * k / 2,
              "packed must be contiguous uint8 [N, K / 2] = [", n, ", ", k / 2, "], got ",
              packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(scales_zeros.scalar_type() == out.scalar_type() && scales_zeros.is_contiguous() &&
                  scales_zeros.dim() == 3 && scales_zeros.size(0) == k / group_size &&
                  scales_zeros.size(1) == n && scales_zeros.size(2) == 2,
              "scales_zeros must be contiguous [K / group_size, N, 2] = [", k / group_size, ", ",
              n, ", 2] in out's dtype ", out.scalar_type(), ", got ",
              scales_zeros.scalar_type(), " ", scales_zeros.sizes());
  switch (out.scalar_type()) {
    case at::kFloat: dequant<float>(packed, scales_zeros, group_size, block_n, out); break;
    case at::kBFloat16:
      dequant<c10::BFloat16>(packed, scales_zeros, group_size, block_n, out);
      break;
    default: TORCH_CHECK(false, "out must be float32 or bfloat16, got ", out.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("int4pack_dequant(Tensor packed, Tensor scales_zeros, int group_size, int block_n, "
        "Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("int4pack_dequant", &int4pack_dequant);
}
