// Fused float32 layer ops for the cpu backend: one pass each in place of the 3-6 torch ops of the
// reference ops (pagedllm/models/layers/ops.py), whose per-op dispatch and thread-pool round trips
// cost more than their arithmetic at decode-step sizes (tens of rows).
//
// Rounding follows the reference op by op (built with -ffp-contract=off, so no product is fused
// into an add behind our back):
//   * rotary and write_kv are bit-identical to the reference, and silu_and_mul is where torch runs
//     its AVX2 kernels (the vectors built here); torch's AVX-512 exp can differ by one ulp;
//   * rms_norm sums the squares in another order than torch's reduction, so its mean may differ in
//     the last bit; everything after it (rsqrt, the two products) is the reference's arithmetic.
//
// Registered as torch.ops.pagedllm_cpu.{rms_norm, rotary, silu_and_mul, write_kv} (a fragment of
// the library paged_attention_cpu.cpp defines).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t kLanes = VecF::size();

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, name,
              " must be contiguous in its last dim, got strides ", t.strides());
}

// Rows per task of at::parallel_for: enough work per task to amortize the hand-off.
int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

// (weight * round(h * rsqrt(mean(h^2) + eps)), h) with h = x + residual (or x): the reference's
// F.rms_norm in float32, residual add included.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2, "x must be [num_tokens, hidden_size], got shape ", x.sizes());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [hidden_size=", n,
              "], got shape ", weight.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor h_out = x;
  const float* r_ptr = nullptr;
  int64_t r_stride = 0;
  if (residual.has_value()) {
    check_float_cpu(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have the shape of x ", x.sizes(),
                ", got ", residual->sizes());
    h_out = at::empty({rows, n}, x.options());
    r_ptr = residual->const_data_ptr<float>();
    r_stride = residual->stride(0);
  }
  const float* x_ptr = x.const_data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const float* w = weight.const_data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  float* h_ptr = residual.has_value() ? h_out.data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* h = x_ptr + row * x_stride;
      if (r_ptr != nullptr) {  // h = x + residual, stored as the new residual
        float* hr = h_ptr + row * n;
        const float* r = r_ptr + row * r_stride;
        for (int64_t i = 0; i < n; ++i) hr[i] = h[i] + r[i];
        h = hr;
      }
      VecF acc(0.f);
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const VecF v = VecF::loadu(h + i);
        acc = acc + v * v;
      }
      float lanes[kLanes];
      acc.store(lanes);
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
      for (; i < n; ++i) sum += h[i] * h[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + feps);
      float* o = o_ptr + row * n;
      for (int64_t k = 0; k < n; ++k) o[k] = w[k] * (h[k] * inv);
    }
  });
  return {out, h_out};
}

// Neox rotary embedding of x [num_tokens, num_heads, head_size] with cos/sin [num_tokens,
// head_size]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; a new contiguous tensor.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_cpu(x, "x");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_size], got shape ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "x must have an even head_size, got ", d);
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == d,
                "cos and sin must be [num_tokens=", tokens, ", head_size=", d, "], got shape ",
                t->sizes());
  }
  at::Tensor out = at::empty({tokens, heads, d}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = xp + t * xs0 + h * xs1;
        float* o = op + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = xr[i], x2 = xr[i + half];
          o[i] = x1 * c[i] + (-x2) * s[i];
          o[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
  return out;
}

// x [num_tokens, 2 * I] (gate, then up) -> silu(gate) * up [num_tokens, I], silu(g) = g / (1 +
// exp(-g)) computed as torch's CPU silu kernel does (its vectorized exp on whole vectors, std::exp
// on the rest).
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0,
              "x must be [num_tokens, 2 * intermediate_size] (gate, then up), got shape ",
              x.sizes());
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({tokens, inter}, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const VecF one(1.f);
  at::parallel_for(0, tokens, grain_rows(inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + inter;
      float* o = op + t * inter;
      int64_t i = 0;
      for (; i + kLanes <= inter; i += kLanes) {
        const VecF gv = VecF::loadu(g + i);
        const VecF silu = gv / (one + gv.neg().exp());
        (silu * VecF::loadu(u + i)).store(o + i);
      }
      for (; i < inter; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
  return out;
}

// key/value [num_tokens, num_kv_heads, head_size] into kv_cache [2, num_blocks, block_size,
// num_kv_heads, head_size] at slot_mapping [num_tokens] (int64; negative = padding, skipped).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_size], "
              "got shape ", kv_cache.sizes(), " strides ", kv_cache.strides());
  const int64_t heads = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
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
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == tokens,
              "slot_mapping must be int64 [num_tokens=", tokens, "], got ",
              slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] < num_slots, "slot_mapping[", t, "]=", sp[t],
                " is outside the cache's slots [0, ", num_slots, ")");
  }
  const int64_t row_bytes = d * kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const int64_t half_bytes = kv_cache.stride(0) * kv_cache.element_size();  // K -> V
  const int64_t slot_bytes = heads * row_bytes;
  for (int64_t i = 0; i < 2; ++i) {
    const at::Tensor& src = i == 0 ? key : value;
    const char* s = static_cast<const char*>(src.const_data_ptr());
    const int64_t s0 = src.stride(0) * src.element_size(), s1 = src.stride(1) * src.element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      if (sp[t] < 0) continue;
      char* dst = base + i * half_bytes + sp[t] * slot_bytes;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(dst + h * row_bytes, s + t * s0 + h * s1, row_bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv", &write_kv);
}
