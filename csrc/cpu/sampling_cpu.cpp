// Greedy draws with their logprobs for the cpu backend: logits [rows, vocab] float32 -> (argmax
// [rows] int64, log_softmax(logits)[row, argmax] [rows] float32), one pass over each row in place
// of the reference's argmax + log_softmax + gather (pagedllm/models/layers/ops.py:
// greedy_logprobs), whose argmax alone takes ~200 us for 64 x 4096 logits on 2 cores.
//
// Same arithmetic as torch's CPU log_softmax over the last dim (ATen's
// serial_vec_log_softmax_lastdim_range, built for the ISA torch runs: kernels.py): the row max by
// vec::reduce_all(maximum), sum(exp(x - max)) by vec::map_reduce_all, log by the vectorized log,
// then (x - max) - log_sum. So the logprob is bit-identical to the reference, and the token is
// torch.argmax's: the first index of the maximum (of the first NaN where the row has one).
//
// Registered as torch.ops.pagedllm_cpu.greedy_logprobs (a fragment of the library
// paged_attention_cpu.cpp defines).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using VecF = at::vec::Vectorized<float>;

// (first index of the row's maximum, its logprob) of one row of n > 0 values.
std::tuple<int64_t, float> greedy_row(const float* x, int64_t n) {
  const float max = at::vec::reduce_all<float>(
      [](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, x, n);
  const float sum = at::vec::map_reduce_all<float>(
      [max](VecF v) { return (v - VecF(max)).exp(); }, [](VecF a, VecF b) { return a + b; }, x,
      n);
  float log_sum = sum;
  at::vec::map([](VecF v) { return v.log(); }, &log_sum, &log_sum, 1);
  int64_t arg = 0;
  if (std::isnan(max)) {
    while (!std::isnan(x[arg])) ++arg;
  } else {
    while (x[arg] != max) ++arg;
  }
  return {arg, x[arg] - max - log_sum};
}

std::tuple<at::Tensor, at::Tensor> greedy_logprobs(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat,
              "logits must be a float32 CPU tensor, got ", logits.scalar_type(), " on ",
              logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "logits must be [rows, vocab > 0] with a contiguous last dim, got shape ",
              logits.sizes(), " strides ", logits.strides());
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, logits.options());
  const float* x = logits.const_data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::tie(tp[r], lp[r]) = greedy_row(x + r * stride, n);
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("greedy_logprobs(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("greedy_logprobs", &greedy_logprobs);
}
