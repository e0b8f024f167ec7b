// Shared by the two binding files (torch_bindings.cpp, layer_bindings.cpp): dtype mapping and the
// tensor checks that raise (PL_CHECK) before a launch, the current stream, launch errors.
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <string>
#include <type_traits>

#include "ops.h"

namespace pagedllm::binding {

// Error messages of the checks below. PL_CHECK(cond, parts...) is TORCH_CHECK with the message
// built here: numbers with std::to_string and shapes as "[a, b]", never through an ostream. On the
// H200 machine's toolchain a TORCH_CHECK message that streamed an integer or an IntArrayRef from
// this library crashed the process (SIGSEGV) instead of raising; strings, dtypes and devices
// streamed fine.
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += ']';
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

#define PL_CHECK(cond, ...) TORCH_CHECK(cond, ::pagedllm::binding::message(__VA_ARGS__))

using pagedllm::CacheSlots;
using pagedllm::ScalarType;

inline ScalarType to_scalar_type(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::ScalarType::Float: return ScalarType::kFloat32;
    case at::ScalarType::Half: return ScalarType::kFloat16;
    case at::ScalarType::BFloat16: return ScalarType::kBFloat16;
    default:
      PL_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline void check_cuda(const torch::Tensor& t, const char* name, const torch::Device& device) {
  PL_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  PL_CHECK(t.device() == device, name, " is on ", t.device(), " but the operands are on ", device);
}

inline void check_shape(const torch::Tensor& t, const char* name, at::IntArrayRef expected) {
  PL_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

inline void check_last_dim_contiguous(const torch::Tensor& t, const char* name) {
  PL_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ",
           t.strides());
}

inline void check_dtype(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  PL_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

// 16-byte vector loads need 16-byte aligned base pointers and strides.
inline void check_aligned16(const torch::Tensor& t, const char* name) {
  const int64_t es = t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.stride(d) * es) % 16 == 0;
  PL_CHECK(ok, name, " must be 16-byte aligned (data pointer and strides), got strides ",
           t.strides(), "; make it contiguous");
}

inline cudaStream_t current_stream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline void check_launch(cudaError_t err, const char* op) {
  PL_CHECK(err == cudaSuccess, op, " failed to launch: ", cudaGetErrorString(err));
}

// Checks the two caches of one layer against each other and the [num_tokens] int64 slot
// mapping: on `device`, of dtype `dtype` (caches), [num_blocks, block_size, num_kv_heads,
// head_size] with the given kv heads and head size, last dim contiguous. Returns where the
// launchers write.
inline CacheSlots checked_cache_slots(torch::Tensor& key_cache, torch::Tensor& value_cache,
                                      const torch::Tensor& slot_mapping, const torch::Device& device,
                                      at::ScalarType dtype, int64_t num_tokens,
                                      int64_t num_kv_heads, int64_t head_size) {
  check_cuda(key_cache, "key_cache", device);
  check_cuda(value_cache, "value_cache", device);
  check_cuda(slot_mapping, "slot_mapping", device);
  check_dtype(key_cache, "key_cache", dtype);
  check_dtype(value_cache, "value_cache", dtype);
  check_dtype(slot_mapping, "slot_mapping", torch::kInt64);
  PL_CHECK(key_cache.dim() == 4,
           "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
           key_cache.sizes());
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  check_shape(key_cache, "key_cache", {num_blocks, block_size, num_kv_heads, head_size});
  check_shape(value_cache, "value_cache", key_cache.sizes());
  check_shape(slot_mapping, "slot_mapping", {num_tokens});
  PL_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  CacheSlots c{};
  c.key_cache = key_cache.data_ptr();
  c.kc_block_stride = key_cache.stride(0);
  c.kc_token_stride = key_cache.stride(1);
  c.kc_head_stride = key_cache.stride(2);
  c.value_cache = value_cache.data_ptr();
  c.vc_block_stride = value_cache.stride(0);
  c.vc_token_stride = value_cache.stride(1);
  c.vc_head_stride = value_cache.stride(2);
  c.slot_mapping = slot_mapping.data_ptr<int64_t>();
  c.block_size = static_cast<int>(block_size);
  c.num_blocks = num_blocks;
  return c;
}

// Registers the layer ops (layer_bindings.cpp) on the module.
void register_layer_ops(pybind11::module_& m);

}  // namespace pagedllm::binding
