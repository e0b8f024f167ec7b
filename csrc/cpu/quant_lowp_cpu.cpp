// The cpu backend's INT8 compute mode (pagedllm/backends/cpu/quant_lowp.py): the two passes
// around oneDNN's int8 GEMM, each one pass over its rows in place of 5-6 torch ops.
//
//   quantize_per_token(x [T, K] float32/bf16/fp16) -> (q [T, K] uint8, scale [T, 1] float32)
//     scale[t] = max(max_k |x[t, k]| / 127, 1e-30); q = round_half_even(x / scale) + 128
//     (q - 128 in [-127, 127]; the reference's arithmetic: float32 division, torch.round)
//   scale_rows(y [T, N] float32, scale [T, 1] float32, dtype) -> [T, N] dtype
//     out = dtype(y * scale[t]) (one rounding, as the reference's y.mul_(s).to(dtype))
//
// Registered as torch.ops.pagedllm_cpu.{quantize_per_token, scale_rows} (a fragment of the
// library paged_attention_cpu.cpp defines).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t kLanes = VecF::size();
constexpr float kInt8Max = 127.0f;
constexpr float kMinScale = 1e-30f;

// kLanes values of p as floats (bf16 / fp16 widened exactly).
template <typename T>
inline VecF load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return VecF::loadu(p);
  } else {
    float tmp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
    return VecF::loadu(tmp);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, cols], got ", t.dim(), " dims");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

// Rows per task of at::parallel_for: enough work per task to amortize the hand-off.
int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols));
}

template <typename T>
void quantize_rows(const at::Tensor& x, at::Tensor& q, at::Tensor& scale) {
  const int64_t rows = x.size(0), k = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * k;
      uint8_t* out = qp + r * k;
      VecF vmax(0.0f);
      int64_t i = 0;
      for (; i + kLanes <= k; i += kLanes) vmax = at::vec::maximum(vmax, load_float(row + i).abs());
      float amax = at::vec::vec_reduce_all<float>(
          [](const VecF& a, const VecF& b) { return at::vec::maximum(a, b); }, vmax);
      for (; i < k; ++i) amax = std::max(amax, std::fabs(static_cast<float>(row[i])));
      const float s = std::max(amax / kInt8Max, kMinScale);
      sp[r] = s;
      const VecF vs(s), lo(-kInt8Max), hi(kInt8Max), offset(128.0f);
      float tmp[kLanes];
      for (i = 0; i + kLanes <= k; i += kLanes) {
        VecF v = at::vec::clamp((load_float(row + i) / vs).round(), lo, hi) + offset;
        v.store(tmp);
        for (int64_t j = 0; j < kLanes; ++j) out[i + j] = static_cast<uint8_t>(tmp[j]);
      }
      for (; i < k; ++i) {
        const float v = std::nearbyint(static_cast<float>(row[i]) / s);
        out[i] = static_cast<uint8_t>(std::clamp(v, -kInt8Max, kInt8Max) + 128.0f);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x) {
  check_rows(x, "x");
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows<float>(x, q, scale); break;
    case at::kBFloat16: quantize_rows<c10::BFloat16>(x, q, scale); break;
    case at::kHalf: quantize_rows<c10::Half>(x, q, scale); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return {q, scale};
}

template <typename T>
void scale_rows_impl(const at::Tensor& y, const at::Tensor& scale, at::Tensor& out) {
  const int64_t rows = y.size(0), n = y.size(1);
  const float* yp = y.const_data_ptr<float>();
  const float* sp = scale.const_data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float s = sp[r];
      for (int64_t i = 0; i < n; ++i) op[r * n + i] = static_cast<T>(yp[r * n + i] * s);
    }
  });
}

at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& scale, at::ScalarType dtype) {
  check_rows(y, "y");
  TORCH_CHECK(y.scalar_type() == at::kFloat, "y must be float32, got ", y.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == y.size(0),
              "scale must be a contiguous float32 [rows, 1] tensor with y's ", y.size(0),
              " rows, got ", scale.scalar_type(), " ", scale.sizes());
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat: scale_rows_impl<float>(y, scale, out); break;
    case at::kBFloat16: scale_rows_impl<c10::BFloat16>(y, scale, out); break;
    case at::kHalf: scale_rows_impl<c10::Half>(y, scale, out); break;
    default: TORCH_CHECK(false, "dtype must be float32, bfloat16 or float16, got ", dtype);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor y, Tensor scale, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("quantize_per_token", &quantize_per_token);
  m.impl("scale_rows", &scale_rows);
}
