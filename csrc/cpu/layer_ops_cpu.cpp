// Fused layer ops for the cpu backend (float32, bfloat16, float16): one pass each in place of the
// 3-6 torch ops of the reference ops (pagedllm/models/layers/ops.py), whose per-op dispatch,
// thread-pool round trips and temporaries cost more than their arithmetic at decode-step sizes
// (tens of rows) and, in half precision, at prefill sizes too (each reference op writes a full
// [tokens, width] temporary, some in float32).
//
// Rounding follows the reference op by op (built with -ffp-contract=off, so no product is fused
// into an add behind our back). Arithmetic is in float32, as torch's CPU kernels for bf16/fp16
// do; every value the reference materializes in the half dtype is rounded to it here
// (round-to-nearest-even, as torch's conversions), and read back as float:
//   rms_norm      h = T(x + r); normed = T(h * inv_rms) (the reference's .to(dtype));
//                 out = T(w * normed)                                 (float32: w * (h * inv_rms))
//   rotary        out = T(T(x1 * c) + T(-x2 * s)), T(T(x2 * c) + T(x1 * s))
//   silu_and_mul  out = T(T(g / (1 + exp(-g))) * u)
// So rotary and write_kv are bit-identical to the reference in every dtype, and silu_and_mul is
// where torch runs its AVX2 kernels (the vectors built here); torch's AVX-512 exp can differ by
// one float32 ulp, which a half-precision rounding hides except at a tie. rms_norm sums the
// squares in another order than torch's reduction, so its mean may differ in the last float32
// bit; everything after it (rsqrt, the products, the roundings) is the reference's arithmetic.
//
// rotary_and_cache is the rotary op in place on a qkv projection's q and k heads plus the cache
// write of k and v, in one pass (the cpu attention's forward_rotary).
//
// gemma_rms_norm is rms_norm with Gemma's (1 + w) scale; gelu_tanh_and_mul is silu_and_mul's
// shape with torch's own GELU-tanh (see there).
//
// Registered as torch.ops.pagedllm_cpu.{rms_norm, gemma_rms_norm, rotary, silu_and_mul,
// gelu_tanh_and_mul, write_kv, rotary_and_cache} (a fragment of the library
// paged_attention_cpu.cpp defines).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Gelu.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "vec_math.h"

namespace {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t kLanes = VecF::size();
// Values per vector step: two float vectors, which is one Vectorized<BFloat16 / Half>.
constexpr int64_t kStep = 2 * kLanes;

// ---------------------------------------------------------------------------------------------
// float <-> T (float, c10::BFloat16, c10::Half), kStep values at a time or one
// ---------------------------------------------------------------------------------------------

template <typename T>
inline void load2(const T* p, VecF& a, VecF& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = VecF::loadu(p);
    b = VecF::loadu(p + kLanes);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

// Stores a and b at p, rounded to T (nearest even).
template <typename T>
inline void store2(T* p, const VecF& a, const VecF& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kLanes);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// a and b rounded to T and read back as float (what a torch op storing T hands the next op).
template <typename T>
inline void round2(VecF& a, VecF& b) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
}

template <typename T>
inline float round1(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// ---------------------------------------------------------------------------------------------
// argument checks
// ---------------------------------------------------------------------------------------------

// Calls fn(T()) with T the C++ type of dtype: float, c10::BFloat16 or c10::Half (the model
// dtypes); any other dtype fails naming the op, the argument it is the dtype of and the allowed
// ones. Every kernel below is a template over T instantiated through this one switch.
template <typename Fn>
void dispatch_float_types(const char* op, const char* arg, at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(0.f); break;
    case at::kBFloat16: fn(c10::BFloat16()); break;
    case at::kHalf: fn(c10::Half()); break;
    default:
      TORCH_CHECK(false, op, ": ", arg, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

void check_cpu(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " (the dtype of x), got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, name,
              " must be contiguous in its last dim, got strides ", t.strides());
}

// t (the op's first argument, named `name`) is a CPU tensor of a model dtype, contiguous in its
// last dim; returns its dtype, which the op's other tensor arguments must share.
at::ScalarType check_x(const char* op, const at::Tensor& t, const char* name = "x") {
  dispatch_float_types(op, name, t.scalar_type(), [](auto) {});
  check_cpu(t, name, t.scalar_type());
  return t.scalar_type();
}

// cos and sin [num_tokens=tokens, head_size=d] of dtype (the rotary ops' tables).
void check_cos_sin(const at::Tensor& cos, const at::Tensor& sin, int64_t tokens, int64_t d,
                   at::ScalarType dtype) {
  check_cpu(cos, "cos", dtype);
  check_cpu(sin, "sin", dtype);
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == d,
                "cos and sin must be [num_tokens=", tokens, ", head_size=", d, "], got shape ",
                t->sizes());
  }
}

// Rows per task of at::parallel_for: enough work per task to amortize the hand-off.
int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

// ---------------------------------------------------------------------------------------------
// rms_norm
// ---------------------------------------------------------------------------------------------

// kUnitOffset (Gemma): out = T((h * inv_rms) * (1 + w)), all in float32, one rounding at the end
// (transformers' GemmaRMSNorm); otherwise the reference's T(w * T(h * inv_rms)).
template <typename T, bool kUnitOffset = false>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps,
                   const c10::optional<at::Tensor>& residual, at::Tensor& out, at::Tensor& h_out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* x_ptr = x.const_data_ptr<T>();
  const int64_t x_stride = x.stride(0);
  const T* r_ptr = residual.has_value() ? residual->const_data_ptr<T>() : nullptr;
  const int64_t r_stride = residual.has_value() ? residual->stride(0) : 0;
  const T* w = weight.const_data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  T* h_ptr = residual.has_value() ? h_out.data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* h = x_ptr + row * x_stride;
      if (r_ptr != nullptr) {  // h = T(x + residual), stored as the new residual
        T* hr = h_ptr + row * n;
        const T* r = r_ptr + row * r_stride;
        int64_t i = 0;
        for (; i + kStep <= n; i += kStep) {
          VecF a0, a1, b0, b1;
          load2(h + i, a0, a1);
          load2(r + i, b0, b1);
          store2(hr + i, a0 + b0, a1 + b1);
        }
        for (; i < n; ++i) {
          hr[i] = static_cast<T>(static_cast<float>(h[i]) + static_cast<float>(r[i]));
        }
        h = hr;
      }
      VecF acc0(0.f), acc1(0.f);
      int64_t i = 0;
      for (; i + kStep <= n; i += kStep) {
        VecF v0, v1;
        load2(h + i, v0, v1);
        acc0 = acc0 + v0 * v0;
        acc1 = acc1 + v1 * v1;
      }
      float lanes[kLanes];
      (acc0 + acc1).store(lanes);
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
      for (; i < n; ++i) sum += static_cast<float>(h[i]) * static_cast<float>(h[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      const VecF inv_v(inv);
      T* o = o_ptr + row * n;
      int64_t k = 0;
      for (; k + kStep <= n; k += kStep) {
        VecF h0, h1, w0, w1;
        load2(h + k, h0, h1);
        load2(w + k, w0, w1);
        h0 = h0 * inv_v;
        h1 = h1 * inv_v;
        if constexpr (kUnitOffset) {
          const VecF one(1.f);
          store2(o + k, h0 * (one + w0), h1 * (one + w1));
        } else {
          round2<T>(h0, h1);
          store2(o + k, w0 * h0, w1 * h1);
        }
      }
      for (; k < n; ++k) {
        if constexpr (kUnitOffset) {
          const float normed = static_cast<float>(h[k]) * inv;
          o[k] = static_cast<T>(normed * (1.f + static_cast<float>(w[k])));
        } else {
          const float normed = round1<T>(static_cast<float>(h[k]) * inv);
          o[k] = static_cast<T>(static_cast<float>(w[k]) * normed);
        }
      }
    }
  });
}

// (T(w * T(h * rsqrt(mean(h^2) + eps))), h) with h = T(x + residual) (or x): the reference's
// rms_norm, residual add included (float32: one F.rms_norm). unit_offset: Gemma's
// T((h * rsqrt(mean(h^2) + eps)) * (1 + w)) instead (the gemma_rms_norm op).
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps,
                                                 const c10::optional<at::Tensor>& residual,
                                                 bool unit_offset) {
  const char* op = unit_offset ? "gemma_rms_norm" : "rms_norm";
  const auto dtype = check_x(op, x);
  check_cpu(weight, "weight", dtype);
  TORCH_CHECK(x.dim() == 2, "x must be [num_tokens, hidden_size], got shape ", x.sizes());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [hidden_size=", n,
              "], got shape ", weight.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor h_out = x;
  if (residual.has_value()) {
    check_cpu(*residual, "residual", dtype);
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have the shape of x ", x.sizes(),
                ", got ", residual->sizes());
    h_out = at::empty({rows, n}, x.options());
  }
  const auto feps = static_cast<float>(eps);
  dispatch_float_types(op, "x", dtype, [&](auto zero) {
    using T = decltype(zero);
    if (unit_offset) {
      rms_norm_rows<T, true>(x, weight, feps, residual, out, h_out);
    } else {
      rms_norm_rows<T, false>(x, weight, feps, residual, out, h_out);
    }
  });
  return {out, h_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual) {
  return rms_norm_impl(x, weight, eps, residual, false);
}

// Gemma's (1 + w) norm: ``weight`` is the checkpoint's w (zeros = identity).
std::tuple<at::Tensor, at::Tensor> gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                  double eps,
                                                  const c10::optional<at::Tensor>& residual) {
  return rms_norm_impl(x, weight, eps, residual, true);
}

// ---------------------------------------------------------------------------------------------
// rotary
// ---------------------------------------------------------------------------------------------

// One head of d values: o = x * c + rotate_half(x) * s (o may be x: every value of a step is
// loaded before any is stored).
template <typename T>
inline void rotate_head(const T* xr, const T* c, const T* s, int64_t d, T* o) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + kStep <= half; i += kStep) {
    VecF x1a, x1b, x2a, x2b, c1a, c1b, c2a, c2b, s1a, s1b, s2a, s2b;
    load2(xr + i, x1a, x1b);
    load2(xr + i + half, x2a, x2b);
    load2(c + i, c1a, c1b);
    load2(c + i + half, c2a, c2b);
    load2(s + i, s1a, s1b);
    load2(s + i + half, s2a, s2b);
    VecF p1a = x1a * c1a, p1b = x1b * c1b, q1a = x2a.neg() * s1a, q1b = x2b.neg() * s1b;
    VecF p2a = x2a * c2a, p2b = x2b * c2b, q2a = x1a * s2a, q2b = x1b * s2b;
    round2<T>(p1a, p1b);
    round2<T>(q1a, q1b);
    round2<T>(p2a, p2b);
    round2<T>(q2a, q2b);
    store2(o + i, p1a + q1a, p1b + q1b);
    store2(o + i + half, p2a + q2a, p2b + q2b);
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[i + half]);
    o[i] = static_cast<T>(round1<T>(x1 * static_cast<float>(c[i])) +
                          round1<T>((-x2) * static_cast<float>(s[i])));
    o[i + half] = static_cast<T>(round1<T>(x2 * static_cast<float>(c[i + half])) +
                                 round1<T>(x1 * static_cast<float>(s[i + half])));
  }
}

template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  const T* xp = x.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(xp + t * xs0 + h * xs1, cp + t * cs, sp + t * ss, d, op + (t * heads + h) * d);
      }
    }
  });
}

// Neox rotary embedding of x [num_tokens, num_heads, head_size] with cos/sin [num_tokens,
// head_size] of x's dtype: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; a new
// contiguous tensor.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = check_x("rotary", x);
  TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_size], got shape ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "x must have an even head_size, got ", d);
  check_cos_sin(cos, sin, tokens, d, dtype);
  at::Tensor out = at::empty({tokens, heads, d}, x.options());
  dispatch_float_types("rotary", "x", dtype, [&](auto zero) {
    rotary_rows<decltype(zero)>(x, cos, sin, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// silu_and_mul
// ---------------------------------------------------------------------------------------------

// row(g, u, o, I) for every token of x [num_tokens, 2 * I] of T: its gate g [I], its up u [I]
// and its row o [I] of out [num_tokens, I], tokens split over torch's threads.
template <typename T, typename Row>
void gated_rows(const at::Tensor& x, at::Tensor& out, Row&& row) {
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  const T* xp = x.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, tokens, grain_rows(inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      row(xp + t * xs, xp + t * xs + inter, op + t * inter, inter);
    }
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  gated_rows<T>(x, out, [](const T* g, const T* u, T* o, int64_t inter) {
    const VecF one(1.f);
    int64_t i = 0;
    for (; i + kStep <= inter; i += kStep) {
      VecF g0, g1, u0, u1;
      load2(g + i, g0, g1);
      load2(u + i, u0, u1);
      VecF s0 = g0 / (one + g0.neg().exp()), s1 = g1 / (one + g1.neg().exp());
      round2<T>(s0, s1);
      store2(o + i, s0 * u0, s1 * u1);
    }
    for (; i < inter; ++i) {  // torch's scalar tail: std::exp
      const float gv = static_cast<float>(g[i]);
      const float silu = round1<T>(gv / (1.f + std::exp(-gv)));
      o[i] = static_cast<T>(silu * static_cast<float>(u[i]));
    }
  });
}

// The output [num_tokens, I] of a gated activation op on x [num_tokens, 2 * I] (gate, then up),
// after checking x; run(out, T()) fills it, T the C++ type of x's dtype.
template <typename Run>
at::Tensor gated_and_mul(const char* op, const at::Tensor& x, Run&& run) {
  const auto dtype = check_x(op, x);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0,
              "x must be [num_tokens, 2 * intermediate_size] (gate, then up), got shape ",
              x.sizes());
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch_float_types(op, "x", dtype, [&](auto zero) { run(out, zero); });
  return out;
}

// x [num_tokens, 2 * I] (gate, then up) -> silu(gate) * up [num_tokens, I], silu(g) = g / (1 +
// exp(-g)) computed as torch's CPU silu kernel does (its vectorized exp on whole vectors, std::exp
// on the rest).
at::Tensor silu_and_mul(const at::Tensor& x) {
  return gated_and_mul("silu_and_mul", x, [&](at::Tensor& out, auto zero) {
    silu_and_mul_rows<decltype(zero)>(x, out);
  });
}

// ---------------------------------------------------------------------------------------------
// gelu_tanh_and_mul
// ---------------------------------------------------------------------------------------------

// float32: torch's own GELU-tanh functions (ATen/native/cpu/Gelu.h) on the elements torch's
// vectorized loop gives them (whole chunks of 2 * Vectorized<float>::size() in vector code, the
// rest of a row in scalar code), so the gate is F.gelu(approximate="tanh")'s bits. bf16/fp16:
// torch's formula 0.5 x (1 + tanh(z)) in float32 with vec_math.h's tanh (Sleef's tanhf took ~70%
// of the op's time; ~97% of bf16 values stay bit-equal, the rest one rounding away), the gate
// rounded to T, then out = T(gate * u), the reference's product of two T tensors.
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

inline VecF gelu_tanh_fast(const VecF& x) {
  const VecF z = VecF(kGeluBeta) * (x + VecF(kGeluKappa) * x * x * x);
  return VecF(0.5f) * x * (VecF(1.f) + tanh_exp_u20(z));
}

template <typename T>
void gelu_tanh_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  gated_rows<T>(x, out, [](const T* g, const T* u, T* o, int64_t inter) {
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {
      constexpr int64_t kChunk = 2 * VecF::size();
      for (; i + kChunk <= inter; i += kChunk) {
        for (int64_t j = i; j < i + kChunk; j += VecF::size()) {
          const VecF act = at::native::vectorized_gelu_approximated_with_tanh(VecF::loadu(g + j));
          (act * VecF::loadu(u + j)).store(o + j);
        }
      }
      for (; i < inter; ++i) o[i] = at::native::scalar_gelu_approximated_with_tanh(g[i]) * u[i];
    } else {
      for (; i + kStep <= inter; i += kStep) {
        VecF g0, g1, u0, u1;
        load2(g + i, g0, g1);
        load2(u + i, u0, u1);
        VecF a0 = gelu_tanh_fast(g0), a1 = gelu_tanh_fast(g1);
        round2<T>(a0, a1);
        store2(o + i, a0 * u0, a1 * u1);
      }
      for (; i < inter; ++i) {
        const float gv = static_cast<float>(g[i]);
        const float inner = kGeluBeta * (gv + kGeluKappa * gv * gv * gv);
        const float act = round1<T>(0.5f * gv * (1.f + std::tanh(inner)));
        o[i] = static_cast<T>(act * static_cast<float>(u[i]));
      }
    }
  });
}

// x [num_tokens, 2 * I] (gate, then up) -> gelu_tanh(gate) * up [num_tokens, I] (Gemma's MLP).
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return gated_and_mul("gelu_tanh_and_mul", x, [&](at::Tensor& out, auto zero) {
    gelu_tanh_and_mul_rows<decltype(zero)>(x, out);
  });
}

// ---------------------------------------------------------------------------------------------
// cache writes
// ---------------------------------------------------------------------------------------------

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous(),
              "kv_cache must be a contiguous CPU [2, num_blocks, block_size, num_kv_heads, "
              "head_size], got shape ", kv_cache.sizes(), " strides ", kv_cache.strides());
}

// slot_mapping as a contiguous int64 [tokens], every entry checked to be < the cache's slots
// (negative entries are padding, skipped by the writers).
at::Tensor checked_slots(const at::Tensor& slot_mapping, int64_t tokens,
                         const at::Tensor& kv_cache) {
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
              "slot_mapping must be a CPU int64 [num_tokens=", tokens, "], got ",
              slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] < num_slots, "slot_mapping[", t, "]=", sp[t],
                " is outside the cache's slots [0, ", num_slots, ")");
  }
  return slots;
}

// Token t's `heads` rows of `row_bytes` each (src + h * head_bytes) into slot `slot` of the K
// (half 0) or V (half 1) cache.
inline void copy_slot(at::Tensor& kv_cache, int64_t half, int64_t slot, const char* src,
                      int64_t head_bytes) {
  const int64_t heads = kv_cache.size(3), row_bytes = kv_cache.size(4) * kv_cache.element_size();
  char* dst = static_cast<char*>(kv_cache.data_ptr()) +
              (half * kv_cache.stride(0) + slot * heads * kv_cache.size(4)) *
                  kv_cache.element_size();
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(dst + h * row_bytes, src + h * head_bytes, row_bytes);
  }
}

// key/value [num_tokens, num_kv_heads, head_size] into kv_cache [2, num_blocks, block_size,
// num_kv_heads, head_size] at slot_mapping [num_tokens] (int64; negative = padding, skipped).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  check_cache(kv_cache);
  const int64_t heads = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t tokens = key.size(0);
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == kv_cache.scalar_type(),
                "key and value must be CPU tensors of the cache's dtype ", kv_cache.scalar_type(),
                ", got ", t->scalar_type(), " on ", t->device());
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads && t->size(2) == d &&
                    t->stride(2) == 1,
                "key and value must be [num_tokens, num_kv_heads=", heads, ", head_size=", d,
                "] with a contiguous last dim, got shape ", t->sizes(), " strides ", t->strides());
  }
  const at::Tensor slots = checked_slots(slot_mapping, tokens, kv_cache);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < 2; ++i) {
    const at::Tensor& src = i == 0 ? key : value;
    const char* s = static_cast<const char*>(src.const_data_ptr());
    const int64_t s0 = src.stride(0) * src.element_size(), s1 = src.stride(1) * src.element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      if (sp[t] >= 0) copy_slot(kv_cache, i, sp[t], s + t * s0, s1);
    }
  }
}

template <typename T>
void rotary_and_cache_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor& kv_cache, const int64_t* slots, int64_t num_heads) {
  const int64_t tokens = qkv.size(0), kv_heads = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t rotated = num_heads + kv_heads;  // q heads, then k heads
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  const int64_t head_bytes = d * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, tokens, grain_rows(rotated * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = xp + t * xs;
      for (int64_t h = 0; h < rotated; ++h) {
        rotate_head(row + h * d, cp + t * cs, sp + t * ss, d, row + h * d);
      }
      if (slots[t] < 0) continue;
      copy_slot(kv_cache, 0, slots[t], reinterpret_cast<const char*>(row + num_heads * d),
                head_bytes);
      copy_slot(kv_cache, 1, slots[t],
                reinterpret_cast<const char*>(row + (num_heads + kv_heads) * d), head_bytes);
    }
  });
}

// The rotary op on the q and k heads of qkv [num_tokens, (num_heads + 2 * num_kv_heads) *
// head_size] (q heads, k heads, v heads), in place, then the rotated k and the v rows into
// kv_cache at slot_mapping (as write_kv): the rotary op's bits, one pass over the projection.
void rotary_and_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  const auto dtype = check_x("rotary_and_cache", qkv, "qkv");
  check_cache(kv_cache);
  TORCH_CHECK(kv_cache.scalar_type() == dtype, "kv_cache must be ", dtype,
              " (the dtype of qkv), got ", kv_cache.scalar_type());
  const int64_t tokens = qkv.size(0), kv_heads = kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK(num_heads > 0, "num_heads must be > 0, got ", num_heads);
  TORCH_CHECK(d % 2 == 0, "kv_cache must have an even head_size, got ", d);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * kv_heads) * d,
              "qkv must be [num_tokens, (num_heads=", num_heads, " + 2 * num_kv_heads=", kv_heads,
              ") * head_size=", d, "], got shape ", qkv.sizes());
  check_cos_sin(cos, sin, tokens, d, dtype);
  const at::Tensor slots = checked_slots(slot_mapping, tokens, kv_cache);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  dispatch_float_types("rotary_and_cache", "qkv", dtype, [&](auto zero) {
    rotary_and_cache_rows<decltype(zero)>(qkv, cos, sin, kv_cache, sp, num_heads);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gemma_rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("rotary_and_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int num_heads) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gemma_rms_norm", &gemma_rms_norm);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("write_kv", &write_kv);
  m.impl("rotary_and_cache", &rotary_and_cache);
}
