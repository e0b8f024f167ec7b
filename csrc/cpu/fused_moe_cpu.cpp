// The cpu backend's fused MoE layer in one op call (pagedllm/backends/cpu/fused_moe.py): top-k
// routing, grouping of the (token, slot) pairs by expert, each expert's two GEMMs on its
// pre-packed weights and the weighted sum, in place of moe_ops.run_grouped's Python loop (~8 torch
// ops per expert hit, whose dispatch cost more than the GEMMs at decode sizes).
//
// Results are bit-equal to run_grouped with cpu_ops.linear as the expert MLP, step by step:
//   routing   w, ids = topk(softmax(float32(logits))), w /= sum(w) when renormalize (at:: ops)
//   grouping  pairs p = slot * T + token, stably ordered by expert (a counting sort: the same
//             order as argsort(stable=True) over ids.t())
//   expert e  h = linear(x_e, up[e]) [n, 2I]; a = silu(h[:, :I]) * h[:, I:] (at::silu, at::mul);
//             y = linear(a, down[e]) [n, H] in the activation dtype T
//   sum       out[tok] = T(out[tok] + T(float(y) * w_pair)), experts in ascending order (a token
//             appears at most once per expert, so rows never collide within one expert)
// where linear(x, pack) is oneDNN's packed GEMM (mkldnn::_linear_pointwise, x cast to the pack's
// compute dtype and the result back to T where they differ) or MKL's packed sgemm
// (mkl::_mkl_linear, float32), both called through the dispatcher as cpu_ops.linear calls them.
//
// parallel_experts: the experts hit run concurrently on torch's OpenMP threads, each GEMM
// single-threaded (oneDNN and MKL run serially inside a parallel region); each expert writes its
// scaled rows into its own slice of a [T * topk, H] buffer and the sum above then runs in expert
// order, so the result does not depend on the schedule.
//
// Registered as torch.ops.pagedllm_cpu.fused_moe_packed (a fragment of the library
// paged_attention_cpu.cpp defines).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

namespace {

constexpr int64_t kRouteOneDnn = 0;
constexpr int64_t kRouteMkl = 1;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, std::string_view,
                                         c10::List<std::optional<c10::Scalar>>,
                                         std::optional<std::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(),
                 std::string_view(""));
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& origin) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, origin, std::nullopt, x.size(0));
}

// cpu_ops.linear on one prepared layer: x [n, in] in T -> [n, out] in T
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* origin,
                         int64_t route, at::ScalarType compute) {
  if (route == kRouteMkl) return mkl_linear(x, packed, *origin);
  if (x.scalar_type() == compute) return onednn_linear(x, packed);
  return onednn_linear(x.to(compute), packed).to(x.scalar_type());
}

struct Experts {
  const std::vector<at::Tensor>& up;
  const std::vector<at::Tensor>& down;
  const std::vector<at::Tensor>& up_origin;
  const std::vector<at::Tensor>& down_origin;
  int64_t route;
  at::ScalarType compute;
  int64_t inter;

  // One expert's MLP on its rows x [n, H] -> [n, H] in x's dtype.
  at::Tensor mlp(int64_t e, const at::Tensor& x) const {
    const bool mkl = route == kRouteMkl;
    at::Tensor h = packed_linear(x, up[e], mkl ? &up_origin[e] : nullptr, route, compute);
    at::Tensor a = at::mul(at::silu(h.narrow(1, 0, inter)), h.narrow(1, inter, inter));
    return packed_linear(a, down[e], mkl ? &down_origin[e] : nullptr, route, compute);
  }
};

// dst[r] = T(float(y[r]) * w[r]) for the n rows of y [n, H] (contiguous)
template <typename T>
void scale_rows(const at::Tensor& y, const float* w, T* dst) {
  const int64_t n = y.size(0), h = y.size(1);
  const T* src = y.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r) {
    const float s = w[r];
    for (int64_t j = 0; j < h; ++j)
      dst[r * h + j] = static_cast<T>(static_cast<float>(src[r * h + j]) * s);
  }
}

// out[tok[p]] = T(out[tok[p]] + scaled[p]) for p in [0, pairs), in order
template <typename T>
void accumulate(const T* scaled, const int64_t* tok, int64_t pairs, int64_t h, T* out) {
  for (int64_t p = 0; p < pairs; ++p) {
    T* o = out + tok[p] * h;
    const T* s = scaled + p * h;
    for (int64_t j = 0; j < h; ++j)
      o[j] = static_cast<T>(static_cast<float>(o[j]) + static_cast<float>(s[j]));
  }
}

template <typename T>
at::Tensor run(const at::Tensor& hidden, const at::Tensor& gating_output, int64_t topk,
               bool renormalize, const Experts& experts, bool parallel_experts) {
  const int64_t t = hidden.size(0), hdim = hidden.size(1), num_experts = gating_output.size(1);
  const int64_t pairs = t * topk;
  at::Tensor out = at::zeros_like(hidden);
  if (t == 0) return out;

  // routing: weights [T, topk] float32, ids [T, topk] int64 (moe_ops.select_experts)
  auto [weights, ids] = at::topk(at::softmax(gating_output.to(at::kFloat), -1), topk, -1);
  if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  weights = weights.contiguous();
  ids = ids.contiguous();
  const float* wp = weights.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();

  // grouping: pair p = slot * T + token, a stable counting sort by expert
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = ip[i];
    TORCH_CHECK(e >= 0 && e < num_experts, "fused_moe_packed: expert id ", e, " out of range");
    ++start[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  std::vector<int64_t> tok(pairs);
  std::vector<float> pair_weight(pairs);
  for (int64_t slot = 0; slot < topk; ++slot) {
    for (int64_t token = 0; token < t; ++token) {
      const int64_t q = fill[ip[token * topk + slot]]++;
      tok[q] = token;
      pair_weight[q] = wp[token * topk + slot];
    }
  }

  // x [pairs, H]: the routed rows, grouped by expert
  at::Tensor src = hidden.contiguous();
  at::Tensor x = at::empty({pairs, hdim}, hidden.options());
  const T* hp = src.data_ptr<T>();
  T* xp = x.data_ptr<T>();
  for (int64_t p = 0; p < pairs; ++p)
    std::memcpy(xp + p * hdim, hp + tok[p] * hdim, hdim * sizeof(T));

  // scaled [pairs, H]: each pair's expert output times its routing weight, rounded to T
  at::Tensor scaled = at::empty({pairs, hdim}, hidden.options());
  T* sp = scaled.data_ptr<T>();
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) hit.push_back(e);
  auto one = [&](int64_t e) {
    const int64_t s = start[e], n = start[e + 1] - s;
    at::Tensor y = experts.mlp(e, x.narrow(0, s, n)).contiguous();
    scale_rows<T>(y, pair_weight.data() + s, sp + s * hdim);
  };
  const int64_t hits = static_cast<int64_t>(hit.size());
#ifdef _OPENMP
  if (parallel_experts && hits > 1 && at::get_num_threads() > 1) {
    const at::ThreadLocalState state;  // grad / inference mode of the caller, in every thread
    std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
    for (int64_t i = 0; i < hits; ++i) {
      at::ThreadLocalStateGuard guard(state);
      try {
        one(hit[i]);
      } catch (...) {
#pragma omp critical
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  } else
#endif
  {
    for (int64_t i = 0; i < hits; ++i) one(hit[i]);
  }
  accumulate<T>(sp, tok.data(), pairs, hdim, out.data_ptr<T>());
  return out;
}

at::Tensor fused_moe_packed(const at::Tensor& hidden, const at::Tensor& gating_output,
                            int64_t topk, bool renormalize, std::vector<at::Tensor> up,
                            std::vector<at::Tensor> down, std::vector<at::Tensor> up_origin,
                            std::vector<at::Tensor> down_origin, int64_t route,
                            at::ScalarType compute, int64_t inter, bool parallel_experts) {
  TORCH_CHECK(hidden.dim() == 2 && gating_output.dim() == 2 &&
                  gating_output.size(0) == hidden.size(0),
              "fused_moe_packed: hidden [T, H] and gating_output [T, E] expected, got ",
              hidden.sizes(), " and ", gating_output.sizes());
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fused_moe_packed: hidden dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t num_experts = gating_output.size(1);
  TORCH_CHECK(topk >= 1 && topk <= num_experts, "fused_moe_packed: topk=", topk,
              " is not in 1..", num_experts);
  TORCH_CHECK(static_cast<int64_t>(up.size()) == num_experts &&
                  static_cast<int64_t>(down.size()) == num_experts,
              "fused_moe_packed: one packed up and down weight per expert expected (", num_experts,
              "), got ", up.size(), " and ", down.size());
  TORCH_CHECK(route == kRouteOneDnn || route == kRouteMkl, "fused_moe_packed: route=", route,
              " is not 0 (oneDNN) or 1 (MKL)");
  TORCH_CHECK(route != kRouteMkl || (static_cast<int64_t>(up_origin.size()) == num_experts &&
                                     static_cast<int64_t>(down_origin.size()) == num_experts &&
                                     hidden.scalar_type() == at::kFloat),
              "fused_moe_packed: the MKL route takes float32 input and every expert's weights");
  const Experts experts{up, down, up_origin, down_origin, route, compute, inter};
  const bool par = parallel_experts;
  switch (hidden.scalar_type()) {
    case at::kFloat: return run<float>(hidden, gating_output, topk, renormalize, experts, par);
    case at::kBFloat16:
      return run<c10::BFloat16>(hidden, gating_output, topk, renormalize, experts, par);
    default: return run<c10::Half>(hidden, gating_output, topk, renormalize, experts, par);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("fused_moe_packed(Tensor hidden, Tensor gating_output, int topk, bool renormalize, "
        "Tensor[] up, Tensor[] down, Tensor[] up_origin, Tensor[] down_origin, int route, "
        "ScalarType compute, int inter, bool parallel_experts) -> Tensor");
}

// the packed weights are MkldnnCPU tensors, which outrank CPU in the dispatch key set
TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("fused_moe_packed", &fused_moe_packed);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, MkldnnCPU, m) {
  m.impl("fused_moe_packed", &fused_moe_packed);
}
