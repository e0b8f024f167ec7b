// Shared by the two binding files (torch_bindings.cpp, layer_bindings.cpp): dtype mapping and the
// tensor checks that raise (TORCH_CHECK) before a launch, the current stream, launch errors.
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include "ops.h"

namespace pagedllm::binding {

using pagedllm::ScalarType;

inline ScalarType to_scalar_type(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::ScalarType::Float: return ScalarType::kFloat32;
    case at::ScalarType::Half: return ScalarType::kFloat16;
    case at::ScalarType::BFloat16: return ScalarType::kBFloat16;
    default:
      TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline void check_cuda(const torch::Tensor& t, const char* name, const torch::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the operands are on ", device);
}

inline void check_shape(const torch::Tensor& t, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

inline void check_last_dim_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ",
              t.strides());
}

inline void check_dtype(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

// 16-byte vector loads need 16-byte aligned base pointers and strides.
inline void check_aligned16(const torch::Tensor& t, const char* name) {
  const int64_t es = t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.stride(d) * es) % 16 == 0;
  TORCH_CHECK(ok, name, " must be 16-byte aligned (data pointer and strides), got strides ",
              t.strides(), "; make it contiguous");
}

inline cudaStream_t current_stream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " failed to launch: ", cudaGetErrorString(err));
}

// Registers the layer ops (layer_bindings.cpp) on the module.
void register_layer_ops(pybind11::module_& m);

}  // namespace pagedllm::binding
