// Bindings of the weight-only quantized linears (csrc/quantization/): the output is allocated
// here, contiguous. Checks as listed at the top of torch_bindings.cpp.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include "binding_checks.h"
#include "quantization/quant_ops.h"

namespace pagedllm::binding {
namespace {

// y [m, n] = x [m, k] . W^T, W in the 4-bit layout of quantization/quant_ops.h.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                          const torch::Tensor& scales, const torch::Tensor& offsets,
                          int64_t group_size) {
  check_cuda(x, "x", x.device());
  const ScalarType dtype = to_scalar_type(x, "x");
  PL_CHECK(x.dim() == 2, "x must be [m, k], got ", x.sizes());
  check_last_dim_contiguous(x, "x");
  const int64_t m = x.size(0), k = x.size(1);
  PL_CHECK(pagedllm::int4_linear_supports(k, group_size), "int4_linear: k=", k,
           " and group_size=", group_size, " must satisfy group_size % 32 == 0, k % group_size == 0");
  check_cuda(qweight, "qweight", x.device());
  check_dtype(qweight, "qweight", at::kInt);
  PL_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.size(1) * 8 == k,
           "qweight must be contiguous int32 [n, k / 8], got ", qweight.sizes());
  const int64_t n = qweight.size(0);
  PL_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "int4_linear: sizes over 2^31 - 1");
  for (const auto& [t, name] : {std::pair{&scales, "scales"}, std::pair{&offsets, "offsets"}}) {
    check_cuda(*t, name, x.device());
    check_dtype(*t, name, at::kFloat);
    PL_CHECK(t->is_contiguous(), name, " must be contiguous");
    check_shape(*t, name, {n, k / group_size});
  }
  torch::Tensor y = torch::empty({m, n}, x.options());
  pagedllm::Int4LinearArgs a{};
  a.dtype = dtype;
  a.y = y.data_ptr();
  a.y_stride = y.stride(0);
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  a.scales = scales.data_ptr<float>();
  a.offsets = offsets.data_ptr<float>();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.group_size = static_cast<int>(group_size);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(pagedllm::launch_int4_linear(a, current_stream(x)), "int4_linear");
  return y;
}

}  // namespace

void register_quant_ops(pybind11::module_& m) {
  m.def("int4_linear", &int4_linear,
        "y [m, n] = x [m, k] . W^T for 4-bit W (qweight int32 [n, k / 8], scales / offsets "
        "float32 [n, k / group_size]); a GEMV for m <= 8, a tiled GEMM above.",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("offsets"),
        py::arg("group_size"));
}

}  // namespace pagedllm::binding
