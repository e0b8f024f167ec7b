// Bindings of the layer ops (layer_kernels.cu): outputs allocated here, contiguous; rotary_and_cache
// works in place. Checks as listed at the top of torch_bindings.cpp.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <tuple>

#include "binding_checks.h"

namespace pagedllm::binding {
namespace {

// x's device and dtype for a layer-op operand, last dim contiguous.
void check_layer_operand(const torch::Tensor& t, const char* name, const torch::Tensor& x) {
  check_cuda(t, name, x.device());
  check_dtype(t, name, x.scalar_type());
  check_last_dim_contiguous(t, name);
}

void check_rows(int64_t num_tokens, int64_t row_elems, const char* op) {
  PL_CHECK(num_tokens <= INT32_MAX && row_elems <= INT32_MAX, op, ": at most 2^31 - 1 tokens and ",
           "elements per row, got ", num_tokens, " x ", row_elems);
}

std::tuple<torch::Tensor, torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight,
                                                  double eps,
                                                  const c10::optional<torch::Tensor>& residual) {
  check_cuda(x, "x", x.device());
  const ScalarType dtype = to_scalar_type(x, "x");
  PL_CHECK(x.dim() == 2, "x must be [num_tokens, hidden_size], got ", x.sizes());
  check_last_dim_contiguous(x, "x");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  PL_CHECK(hidden > 0, "x must have hidden_size > 0, got ", x.sizes());
  check_rows(num_tokens, hidden, "rms_norm");
  check_layer_operand(weight, "weight", x);
  check_shape(weight, "weight", {hidden});
  PL_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  torch::Tensor out = torch::empty({num_tokens, hidden}, x.options());
  torch::Tensor new_residual = x;

  pagedllm::RmsNormArgs a{};
  if (residual.has_value()) {
    check_layer_operand(*residual, "residual", x);
    check_shape(*residual, "residual", x.sizes());
    new_residual = torch::empty({num_tokens, hidden}, x.options());
    a.residual = residual->data_ptr();
    a.residual_stride = residual->stride(0);
    a.residual_out = new_residual.data_ptr();
  }
  a.dtype = dtype;
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.weight = weight.data_ptr();
  a.num_tokens = static_cast<int>(num_tokens);
  a.hidden_size = static_cast<int>(hidden);
  a.eps = static_cast<float>(eps);

  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(pagedllm::launch_rms_norm(a, current_stream(x)), "rms_norm");
  return {out, new_residual};
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_cuda(x, "x", x.device());
  const ScalarType dtype = to_scalar_type(x, "x");
  PL_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_size], got ", x.sizes());
  check_last_dim_contiguous(x, "x");
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_size = x.size(2);
  PL_CHECK(head_size > 0 && head_size % 2 == 0, "x must have an even head_size > 0, got ",
           head_size);
  check_rows(num_tokens, num_heads * head_size, "rotary");
  check_layer_operand(cos, "cos", x);
  check_shape(cos, "cos", {num_tokens, head_size});
  check_layer_operand(sin, "sin", x);
  check_shape(sin, "sin", {num_tokens, head_size});
  torch::Tensor out = torch::empty({num_tokens, num_heads, head_size}, x.options());

  pagedllm::RotaryArgs a{};
  a.dtype = dtype;
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.x_token_stride = x.stride(0);
  a.x_head_stride = x.stride(1);
  a.cos = cos.data_ptr();
  a.cos_stride = cos.stride(0);
  a.sin = sin.data_ptr();
  a.sin_stride = sin.stride(0);
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_heads = static_cast<int>(num_heads);
  a.head_size = static_cast<int>(head_size);

  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(pagedllm::launch_rotary(a, current_stream(x)), "rotary");
  return out;
}

void rotary_and_cache(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                      torch::Tensor& key_cache, torch::Tensor& value_cache,
                      const torch::Tensor& slot_mapping, int64_t num_heads) {
  check_cuda(qkv, "qkv", qkv.device());
  const ScalarType dtype = to_scalar_type(qkv, "qkv");
  PL_CHECK(qkv.dim() == 2, "qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * ",
           "head_size], got ", qkv.sizes());
  check_last_dim_contiguous(qkv, "qkv");
  PL_CHECK(key_cache.dim() == 4,
           "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
           key_cache.sizes());
  const int64_t num_tokens = qkv.size(0), num_kv_heads = key_cache.size(2);
  const int64_t head_size = key_cache.size(3), columns = (num_heads + 2 * num_kv_heads) * head_size;
  PL_CHECK(num_heads > 0 && num_kv_heads > 0 && head_size > 0 && head_size % 2 == 0,
           "rotary_and_cache: num_heads (", num_heads, ") and the cache's num_kv_heads (",
           num_kv_heads, ") must be > 0 and its head_size (", head_size, ") even");
  PL_CHECK(qkv.size(1) == columns, "qkv must have (num_heads + 2 * num_kv_heads) * head_size = ",
           columns, " columns for num_heads ", num_heads, " and the cache's ", num_kv_heads,
           " x ", head_size, ", got ", qkv.sizes());
  check_rows(num_tokens, columns, "rotary_and_cache");
  check_layer_operand(cos, "cos", qkv);
  check_shape(cos, "cos", {num_tokens, head_size});
  check_layer_operand(sin, "sin", qkv);
  check_shape(sin, "sin", {num_tokens, head_size});

  pagedllm::RotaryCacheArgs a{};
  a.cache = checked_cache_slots(key_cache, value_cache, slot_mapping, qkv.device(),
                                qkv.scalar_type(), num_tokens, num_kv_heads, head_size);
  a.dtype = dtype;
  a.qkv = qkv.data_ptr();
  a.qkv_stride = qkv.stride(0);
  a.cos = cos.data_ptr();
  a.cos_stride = cos.stride(0);
  a.sin = sin.data_ptr();
  a.sin_stride = sin.stride(0);
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_size = static_cast<int>(head_size);

  const c10::cuda::CUDAGuard guard(qkv.device());
  check_launch(pagedllm::launch_rotary_and_cache(a, current_stream(qkv)), "rotary_and_cache");
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_cuda(x, "x", x.device());
  const ScalarType dtype = to_scalar_type(x, "x");
  PL_CHECK(x.dim() == 2 && x.size(1) % 2 == 0,
           "x must be [num_tokens, 2 * intermediate_size] (gate, then up), got ", x.sizes());
  check_last_dim_contiguous(x, "x");
  const int64_t num_tokens = x.size(0), intermediate = x.size(1) / 2;
  check_rows(num_tokens, x.size(1), "silu_and_mul");
  torch::Tensor out = torch::empty({num_tokens, intermediate}, x.options());

  pagedllm::SiluAndMulArgs a{};
  a.dtype = dtype;
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.num_tokens = static_cast<int>(num_tokens);
  a.intermediate_size = static_cast<int>(intermediate);

  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(pagedllm::launch_silu_and_mul(a, current_stream(x)), "silu_and_mul");
  return out;
}

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight,
                   const c10::optional<torch::Tensor>& bias, bool staged) {
  check_cuda(x, "x", x.device());
  const ScalarType dtype = to_scalar_type(x, "x");
  PL_CHECK(dtype != ScalarType::kFloat32, "gemv: x must be float16 or bfloat16, got ",
           x.scalar_type());
  PL_CHECK(x.dim() == 2 && x.size(0) == 1, "gemv: x must be [1, in_features], got ", x.sizes());
  PL_CHECK(x.is_contiguous(), "gemv: x must be contiguous");
  check_layer_operand(weight, "weight", x);
  PL_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1),
           "gemv: weight must be [out_features, ", x.size(1), "], got ", weight.sizes());
  PL_CHECK(weight.is_contiguous(), "gemv: weight must be contiguous");
  PL_CHECK(pagedllm::gemv_supports_k(x.size(1)), "gemv: in_features must be a multiple of 8 in "
           "[8, ", pagedllm::kGemvMaxK, "], got ", x.size(1));
  check_aligned16(x, "x");
  check_aligned16(weight, "weight");
  const int64_t n = weight.size(0);
  torch::Tensor out = torch::empty({1, n}, x.options());
  pagedllm::GemvArgs a{};
  if (bias.has_value()) {
    check_layer_operand(*bias, "bias", x);
    check_shape(*bias, "bias", {n});
    a.bias = bias->data_ptr();
  }
  a.dtype = dtype;
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.n = n;
  a.k = static_cast<int>(x.size(1));
  a.staged = staged;

  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(pagedllm::launch_gemv(a, current_stream(x)), "gemv");
  return out;
}

#if defined(PL_GEMV_TRACE)
torch::Tensor gemv_trace() {
  torch::Tensor out = torch::empty({1 << 16, 5}, torch::kInt64);
  int64_t count = 0;
  check_launch(pagedllm::gemv_trace_take(out.data_ptr<int64_t>(), out.size(0), &count),
               "gemv_trace");
  return out.narrow(0, 0, count < out.size(0) ? count : out.size(0)).clone();
}
#endif

}  // namespace

void register_layer_ops(pybind11::module_& m) {
#if defined(PL_GEMV_TRACE)
  m.def("gemv_trace", &gemv_trace,
        "The GEMV blocks' records since the last call (-DPL_GEMV_TRACE builds): int64 [n, 5] of "
        "weight address, sm << 32 | block, entry / wait-done / exit globaltimer ns.");
#endif
  m.def("rms_norm", &rms_norm,
        "(weight * rmsnorm(h), h) for x [num_tokens, hidden_size], h = x + residual (or x).",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rotary", &rotary,
        "Neox rotary embedding of x [num_tokens, num_heads, head_size] with cos/sin "
        "[num_tokens, head_size]; returns a contiguous tensor.",
        py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("rotary_and_cache", &rotary_and_cache,
        "Rotary embedding of the q and k heads of qkv [num_tokens, (num_heads + 2 * num_kv_heads) "
        "* head_size] in place; the rotated k and the v written into the caches at slot_mapping.",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("silu_and_mul", &silu_and_mul,
        "silu(x[:, :I]) * x[:, I:] for x [num_tokens, 2 * I]; returns [num_tokens, I].",
        py::arg("x"));
  m.def("gemv", &gemv,
        "x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] for one-token decode steps (float16/bfloat16;"
        " staged: weights streamed through shared memory on sm_90+).",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("staged") = true);
}

}  // namespace pagedllm::binding
