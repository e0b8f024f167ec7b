// Vector helpers shared by the cpu attention kernels (paged_attention_cpu.cpp: decode,
// prefill_attention_cpu.cpp: prefill). Float math on at::vec::Vectorized<float>: AVX2 when the
// including file is built with -DCPU_CAPABILITY_AVX2 -mavx2 -mfma, ATen's generic 8-lane
// version otherwise. Header-only; everything is in an anonymous namespace of each includer.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec_math.h"

namespace {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t kLanes = VecF::size();
// Scores are computed for kTile tokens at a time: one horizontal reduction per tile, not per token.
constexpr int64_t kTile = 8;

// ---------------------------------------------------------------------------------------------
// vector helpers
// ---------------------------------------------------------------------------------------------

inline float reduce_add(const VecF& v) {
  return at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return a + b; }, v);
}

// out[j] = the sum of the lanes of acc[j], for kTile vectors.
inline void lane_sums(const VecF (&acc)[kTile], float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  static_assert(kLanes == 8 && kTile == 8, "the AVX2 reduction is an 8 x 8 transpose");
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  // [sum of lanes 0-3 of acc 0..3 | sum of lanes 4-7 of acc 0..3], and the same for acc 4..7
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 low = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 high = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(low, high));
#else
  for (int64_t j = 0; j < kTile; ++j) out[j] = reduce_add(acc[j]);
#endif
}

// out[j] = q . k[j] for the kTile rows k[0..kTile) of d values.
inline void dot_tile(const float* q, const float* const* k, int64_t d, float* out) {
  VecF acc[kTile];
  for (int64_t j = 0; j < kTile; ++j) acc[j] = VecF(0.f);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const VecF qv = VecF::loadu(q + i);
    for (int64_t j = 0; j < kTile; ++j) {
      acc[j] = at::vec::fmadd(qv, VecF::loadu(k[j] + i), acc[j]);
    }
  }
  lane_sums(acc, out);
  for (; i < d; ++i) {
    for (int64_t j = 0; j < kTile; ++j) out[j] += q[i] * k[j][i];
  }
}

// q . k over d values.
inline float dot(const float* q, const float* k, int64_t d) {
  VecF acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    acc = at::vec::fmadd(VecF::loadu(q + i), VecF::loadu(k + i), acc);
  }
  float sum = reduce_add(acc);
  for (; i < d; ++i) sum += q[i] * k[i];
  return sum;
}

// out[0..d) = sum over t < n of p[t] * v[t][0..d). kChunk vectors of out at a time, so that
// their accumulators stay in registers over all n rows.
constexpr int64_t kChunk = 8;
inline void weighted_sum(const float* p, const float* const* v, int64_t n, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + kChunk * kLanes <= d; i += kChunk * kLanes) {
    VecF acc[kChunk];
    for (int64_t c = 0; c < kChunk; ++c) acc[c] = VecF(0.f);
    for (int64_t t = 0; t < n; ++t) {
      const VecF pt(p[t]);
      for (int64_t c = 0; c < kChunk; ++c) {
        acc[c] = at::vec::fmadd(pt, VecF::loadu(v[t] + i + c * kLanes), acc[c]);
      }
    }
    for (int64_t c = 0; c < kChunk; ++c) acc[c].store(out + i + c * kLanes);
  }
  for (; i + kLanes <= d; i += kLanes) {
    VecF acc(0.f);
    for (int64_t t = 0; t < n; ++t) acc = at::vec::fmadd(VecF(p[t]), VecF::loadu(v[t] + i), acc);
    acc.store(out + i);
  }
  for (; i < d; ++i) {
    float acc = 0.f;
    for (int64_t t = 0; t < n; ++t) acc += p[t] * v[t][i];
    out[i] = acc;
  }
}

// x[i] = exp(x[i] - max(x)) over n values; returns their sum.
inline float softmax_numerators(float* x, int64_t n) {
  const float max_x = at::vec::reduce_all<float>(
      [](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, x, n);
  const VecF shift(max_x);
  VecF acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const VecF e = (VecF::loadu(x + i) - shift).exp();
    e.store(x + i);
    acc = acc + e;
  }
  float sum = reduce_add(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max_x);
    sum += x[i];
  }
  return sum;
}

// cap * tanh(x / cap) of one vector (vec_math.h's tanh; absolute error ~2e-7 * cap).
inline VecF soft_cap_vec(const VecF& x, const VecF& inv, const VecF& cap) {
  return cap * tanh_exp_u20(x * inv);
}

// x[i] = cap * tanh(x[i] / cap) over n values (a logits soft cap on already scaled scores).
// Vectorized: the scalar std::tanh loop tripled Gemma-2's prefill attention time (and made
// decode 1.7x slower) on the benchmark's shapes.
inline void soft_cap_logits(float* x, int64_t n, float cap) {
  const VecF vinv(1.f / cap), vcap(cap);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) soft_cap_vec(VecF::loadu(x + i), vinv, vcap).store(x + i);
  if (i < n) soft_cap_vec(VecF::loadu(x + i, n - i), vinv, vcap).store(x + i, n - i);
}

// ---------------------------------------------------------------------------------------------
// register-blocked score and output blocks (prefill, and decode with whole GQA row blocks)
// ---------------------------------------------------------------------------------------------

// kRowBlock query rows share every K (and V) vector load; scores are computed kKeyVecs vectors of
// keys at a time, the output kOutVecs vectors of head dims at a time, so a block's accumulators
// (kRowBlock x 2 vectors) stay in registers over the whole inner loop.
constexpr int64_t kRowBlock = 4;
constexpr int64_t kKeyVecs = 2;
constexpr int64_t kOutVecs = 2;
constexpr int64_t kBlockKeys = kKeyVecs * kLanes;  // keys per score_block step

// scores[r * s_stride + j] = q_r . k_t[:, j] for the kRowBlock rows q[r * d ..] and the keys
// j < m (m a multiple of kBlockKeys); k_t is [d, k_stride] (keys transposed).
inline void score_block(const float* q, int64_t d, const float* k_t, int64_t k_stride, int64_t m,
                        float* scores, int64_t s_stride) {
  for (int64_t j0 = 0; j0 < m; j0 += kBlockKeys) {
    VecF acc[kRowBlock][kKeyVecs];
    for (int64_t r = 0; r < kRowBlock; ++r) {
      for (int64_t c = 0; c < kKeyVecs; ++c) acc[r][c] = VecF(0.f);
    }
    for (int64_t i = 0; i < d; ++i) {
      VecF k[kKeyVecs];
      const float* row = k_t + i * k_stride + j0;
      for (int64_t c = 0; c < kKeyVecs; ++c) k[c] = VecF::loadu(row + c * kLanes);
      for (int64_t r = 0; r < kRowBlock; ++r) {
        const VecF qb(q[r * d + i]);
        for (int64_t c = 0; c < kKeyVecs; ++c) acc[r][c] = at::vec::fmadd(qb, k[c], acc[r][c]);
      }
    }
    for (int64_t r = 0; r < kRowBlock; ++r) {
      float* row = scores + r * s_stride + j0;
      for (int64_t c = 0; c < kKeyVecs; ++c) acc[r][c].store(row + c * kLanes);
    }
  }
}

// acc[r] = acc[r] * correction[r] + sum over t < n of p[r * p_stride + t] * v[t], for the
// kRows (<= kRowBlock) rows acc[r * d ..] (d values each).
template <int64_t kRows = kRowBlock>
inline void accumulate_block(const float* p, int64_t p_stride, const float* const* v, int64_t n,
                             int64_t d, const float* correction, float* acc) {
  constexpr int64_t kDims = kOutVecs * kLanes;
  int64_t i = 0;
  for (; i + kDims <= d; i += kDims) {
    VecF o[kRows][kOutVecs];
    for (int64_t r = 0; r < kRows; ++r) {
      const VecF c(correction[r]);
      for (int64_t u = 0; u < kOutVecs; ++u) {
        o[r][u] = VecF::loadu(acc + r * d + i + u * kLanes) * c;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      VecF vv[kOutVecs];
      for (int64_t u = 0; u < kOutVecs; ++u) vv[u] = VecF::loadu(v[t] + i + u * kLanes);
      for (int64_t r = 0; r < kRows; ++r) {
        const VecF pb(p[r * p_stride + t]);
        for (int64_t u = 0; u < kOutVecs; ++u) o[r][u] = at::vec::fmadd(pb, vv[u], o[r][u]);
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t u = 0; u < kOutVecs; ++u) o[r][u].store(acc + r * d + i + u * kLanes);
    }
  }
  for (; i < d; ++i) {  // head sizes that are not a multiple of kDims
    for (int64_t r = 0; r < kRows; ++r) {
      float sum = acc[r * d + i] * correction[r];
      for (int64_t t = 0; t < n; ++t) sum += p[r * p_stride + t] * v[t][i];
      acc[r * d + i] = sum;
    }
  }
}

}  // namespace
