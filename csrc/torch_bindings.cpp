// With layer_bindings.cpp, the only files of csrc/ that know torch: tensor checks, raw pointers and
// strides, the current stream, and the pybind11 module `pagedllm._C`. Kernels and launchers are in
// the torch-free *.cu.
//
// What is checked here (PL_CHECK, binding_checks.h, raises RuntimeError):
//   * devices: every tensor on the same CUDA device (swap_blocks: one side CPU), block tables,
//     seq_lens and slot_mapping included;
//   * dtypes: data tensors share one dtype in {float32, float16, bfloat16}; block_tables and seq_lens
//     int32; slot_mapping and block mappings int64;
//   * shapes: ranks and every dimension that must agree; num_heads % num_kv_heads == 0;
//     head size in {64, 80, 96, 112, 128, 256}; block size a power of two (16 and 32 are tested);
//   * layout: last dim contiguous, 16-byte aligned pointers and strides for paged_attention;
//   * layer ops (rms_norm, rotary, rotary_and_cache, silu_and_mul): every operand on x's (qkv's)
//     device with its dtype, the shapes of ops.h, an even head size / gate-up width, eps finite
//     and >= 0;
//   * block ids of swap_blocks (mapping on CPU) and of copy_blocks when its mapping is on CPU.
// What is NOT checked on the host (it would need a device sync); the kernels enforce it instead:
//   * slot_mapping values: negative = padding, >= num_blocks * block_size is skipped (never written);
//   * block_tables values: an entry outside [0, num_blocks) masks its tokens (never read);
//   * seq_lens values: clamped to [0, max_seq_len] and to the block table width;
//   * copy_blocks mapping on device: pairs with an id outside [0, num_blocks) are skipped.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "binding_checks.h"

namespace {

using namespace pagedllm::binding;  // NOLINT(build/namespaces): the check helpers

torch::Tensor empty_float(const torch::Tensor& like, at::IntArrayRef sizes) {
  return torch::empty(sizes, like.options().dtype(torch::kFloat32));
}

void paged_attention(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                     const torch::Tensor& value_cache, int64_t num_kv_heads, double scale,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                     int64_t block_size, int64_t max_seq_len,
                     const c10::optional<torch::Tensor>& tmp_out_opt,
                     const c10::optional<torch::Tensor>& exp_sums_opt,
                     const c10::optional<torch::Tensor>& max_logits_opt, int64_t partition_size,
                     int64_t num_warps, int64_t sliding_window, double soft_cap) {
  const torch::Device device = query.device();
  check_cuda(query, "query", device);
  check_cuda(out, "out", device);
  check_cuda(key_cache, "key_cache", device);
  check_cuda(value_cache, "value_cache", device);
  check_cuda(block_tables, "block_tables", device);
  check_cuda(seq_lens, "seq_lens", device);
  const ScalarType dtype = to_scalar_type(query, "query");
  check_dtype(out, "out", query.scalar_type());
  check_dtype(key_cache, "key_cache", query.scalar_type());
  check_dtype(value_cache, "value_cache", query.scalar_type());
  check_dtype(block_tables, "block_tables", torch::kInt32);
  check_dtype(seq_lens, "seq_lens", torch::kInt32);

  PL_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size], got ", query.sizes());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  check_shape(out, "out", query.sizes());
  PL_CHECK(key_cache.dim() == 4,
           "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
           key_cache.sizes());
  const int64_t num_blocks = key_cache.size(0);
  check_shape(key_cache, "key_cache", {num_blocks, block_size, num_kv_heads, head_size});
  check_shape(value_cache, "value_cache", key_cache.sizes());
  PL_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
           "block_tables must be [num_seqs=", num_seqs, ", max_num_blocks_per_seq], got ",
           block_tables.sizes());
  PL_CHECK(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim");
  check_shape(seq_lens, "seq_lens", {num_seqs});
  PL_CHECK(seq_lens.is_contiguous(), "seq_lens must be contiguous");
  PL_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
           ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  PL_CHECK(pagedllm::paged_attention_supports_head_size(static_cast<int>(head_size)),
           "paged_attention: unsupported head_size ", head_size,
           "; supported: 64, 80, 96, 112, 128, 256");
  PL_CHECK(pagedllm::paged_attention_supports_block_size(static_cast<int>(block_size)),
           "paged_attention: block_size must be a power of two (16 or 32), got ", block_size);
  PL_CHECK(num_seqs <= 65535, "paged_attention: at most 65535 sequences per call, got ", num_seqs);
  PL_CHECK(max_seq_len >= 0 && max_seq_len <= (int64_t{1} << 30), "max_seq_len out of range: ",
           max_seq_len);
  check_last_dim_contiguous(out, "out");
  check_last_dim_contiguous(query, "query");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  check_aligned16(query, "query");
  check_aligned16(key_cache, "key_cache");
  check_aligned16(value_cache, "value_cache");

  if (partition_size == 0) {
    partition_size = pagedllm::paged_attention_partition_size(
        static_cast<int>(num_seqs), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
        static_cast<int>(max_seq_len));
  }
  PL_CHECK(pagedllm::paged_attention_supports_partition_size(static_cast<int>(partition_size)),
           "paged_attention: partition_size must be a power of two in [",
           pagedllm::kMinPartitionSize, ", ", pagedllm::kMaxPartitionSize, "] (or 0: chosen "
           "per launch), got ", partition_size);
  const int num_partitions = pagedllm::paged_attention_num_partitions(
      static_cast<int>(max_seq_len), static_cast<int>(partition_size));
  torch::Tensor tmp_out, exp_sums, max_logits;
  if (num_partitions > 1) {
    const std::vector<int64_t> part_shape = {num_seqs, num_heads, num_partitions};
    const std::vector<int64_t> out_shape = {num_seqs, num_heads, num_partitions, head_size};
    tmp_out = tmp_out_opt.has_value() ? *tmp_out_opt : empty_float(query, out_shape);
    exp_sums = exp_sums_opt.has_value() ? *exp_sums_opt : empty_float(query, part_shape);
    max_logits = max_logits_opt.has_value() ? *max_logits_opt : empty_float(query, part_shape);
    for (const auto& [t, name] : {std::pair<const torch::Tensor*, const char*>{&tmp_out, "tmp_out"},
                                  {&exp_sums, "exp_sums"},
                                  {&max_logits, "max_logits"}}) {
      check_cuda(*t, name, device);
      check_dtype(*t, name, torch::kFloat32);
      PL_CHECK(t->is_contiguous(), name, " must be contiguous");
    }
    check_shape(tmp_out, "tmp_out", out_shape);
    check_shape(exp_sums, "exp_sums", part_shape);
    check_shape(max_logits, "max_logits", part_shape);
  }

  pagedllm::PagedAttentionArgs a{};
  a.dtype = dtype;
  a.out = out.data_ptr();
  a.out_seq_stride = out.stride(0);
  a.out_head_stride = out.stride(1);
  a.query = query.data_ptr();
  a.q_seq_stride = query.stride(0);
  a.q_head_stride = query.stride(1);
  a.key_cache = key_cache.data_ptr();
  a.k_block_stride = key_cache.stride(0);
  a.k_token_stride = key_cache.stride(1);
  a.k_head_stride = key_cache.stride(2);
  a.value_cache = value_cache.data_ptr();
  a.v_block_stride = value_cache.stride(0);
  a.v_token_stride = value_cache.stride(1);
  a.v_head_stride = value_cache.stride(2);
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.block_tables_stride = block_tables.stride(0);
  a.max_num_blocks_per_seq = static_cast<int>(block_tables.size(1));
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.tmp_out = num_partitions > 1 ? tmp_out.data_ptr<float>() : nullptr;
  a.exp_sums = num_partitions > 1 ? exp_sums.data_ptr<float>() : nullptr;
  a.max_logits = num_partitions > 1 ? max_logits.data_ptr<float>() : nullptr;
  a.num_seqs = static_cast<int>(num_seqs);
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_size = static_cast<int>(head_size);
  a.block_size = static_cast<int>(block_size);
  a.num_blocks = static_cast<int>(num_blocks);
  a.max_seq_len = static_cast<int>(max_seq_len);
  a.partition_size = static_cast<int>(partition_size);
  PL_CHECK(num_warps == 0 || num_warps == 2 || num_warps == 4,
           "paged_attention: num_warps must be 0 (chosen per launch), 2 or 4, got ", num_warps);
  a.warps = static_cast<int>(num_warps);
  a.scale = static_cast<float>(scale);
  PL_CHECK(sliding_window >= 0 && sliding_window <= (int64_t{1} << 30),
           "paged_attention: sliding_window must be >= 0 (0: off), got ", sliding_window);
  PL_CHECK(soft_cap >= 0.0, "paged_attention: soft_cap must be >= 0 (0: off), got ", soft_cap);
  a.sliding_window = static_cast<int>(sliding_window);
  a.soft_cap = static_cast<float>(soft_cap);

  const c10::cuda::CUDAGuard guard(device);
  check_launch(pagedllm::launch_paged_attention(a, current_stream(query)), "paged_attention");
}

void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  const torch::Device device = key.device();
  check_cuda(key, "key", device);
  check_cuda(value, "value", device);
  const ScalarType dtype = to_scalar_type(key, "key");
  check_dtype(value, "value", key.scalar_type());
  PL_CHECK(key.dim() == 3, "key must be [num_tokens, num_kv_heads, head_size], got ", key.sizes());
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  check_shape(value, "value", key.sizes());
  PL_CHECK(num_tokens <= INT32_MAX, "too many tokens: ", num_tokens);
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");

  pagedllm::ReshapeAndCacheArgs a{};
  a.cache = checked_cache_slots(key_cache, value_cache, slot_mapping, device, key.scalar_type(),
                                num_tokens, num_kv_heads, head_size);
  a.dtype = dtype;
  a.key = key.data_ptr();
  a.key_token_stride = key.stride(0);
  a.key_head_stride = key.stride(1);
  a.value = value.data_ptr();
  a.value_token_stride = value.stride(0);
  a.value_head_stride = value.stride(1);
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_size = static_cast<int>(head_size);

  const c10::cuda::CUDAGuard guard(device);
  check_launch(pagedllm::launch_reshape_and_cache(a, current_stream(key)), "reshape_and_cache");
}

// Checks the [num_pairs, 2] int64 mapping on the host: both ids in [0, num_blocks).
void check_mapping_ids(const torch::Tensor& cpu_mapping, int64_t src_blocks, int64_t dst_blocks) {
  const int64_t* ids = cpu_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < cpu_mapping.size(0); ++i) {
    PL_CHECK(ids[2 * i] >= 0 && ids[2 * i] < src_blocks, "block_mapping[", i, "] source block ",
             ids[2 * i], " out of range [0, ", src_blocks, ")");
    PL_CHECK(ids[2 * i + 1] >= 0 && ids[2 * i + 1] < dst_blocks, "block_mapping[", i,
             "] destination block ", ids[2 * i + 1], " out of range [0, ", dst_blocks, ")");
  }
}

void check_mapping_shape(const torch::Tensor& mapping) {
  check_dtype(mapping, "block_mapping", torch::kInt64);
  PL_CHECK(mapping.dim() == 2 && mapping.size(1) == 2, "block_mapping must be [num_pairs, 2], got ",
           mapping.sizes());
}

// A block of a cache is dims 1.. of the tensor and must be contiguous; dim 0 is the block id.
void check_block_contiguous(const torch::Tensor& t, const char* name) {
  PL_CHECK(t.dim() >= 2, name, " must have a leading block dimension, got ", t.sizes());
  PL_CHECK(t[0].is_contiguous(), name, " must be contiguous within a block, got strides ", t.strides());
}

void copy_blocks(const std::vector<torch::Tensor>& key_caches,
                 const std::vector<torch::Tensor>& value_caches, const torch::Tensor& block_mapping) {
  PL_CHECK(key_caches.size() == value_caches.size(), "copy_blocks: ", key_caches.size(),
           " key caches but ", value_caches.size(), " value caches");
  if (key_caches.empty()) return;
  check_mapping_shape(block_mapping);
  const torch::Tensor& first = key_caches[0];
  const torch::Device device = first.device();
  PL_CHECK(first.is_cuda(), "copy_blocks: caches must be CUDA tensors, got ", device);
  check_block_contiguous(first, "key_caches[0]");
  int64_t ptr_alignment = 16;
  std::vector<int64_t> key_ptrs, value_ptrs;
  for (size_t i = 0; i < key_caches.size(); ++i) {
    for (const auto* t : {&key_caches[i], &value_caches[i]}) {
      check_cuda(*t, "cache", device);
      check_dtype(*t, "cache", first.scalar_type());
      PL_CHECK(t->sizes() == first.sizes() && t->strides() == first.strides(),
               "copy_blocks: every cache must have the shape and strides of key_caches[0] (",
               first.sizes(), "), got ", t->sizes());
      const auto address = reinterpret_cast<int64_t>(t->data_ptr());
      while (address % ptr_alignment != 0) ptr_alignment /= 2;
    }
    key_ptrs.push_back(reinterpret_cast<int64_t>(key_caches[i].data_ptr()));
    value_ptrs.push_back(reinterpret_cast<int64_t>(value_caches[i].data_ptr()));
  }
  const int64_t num_blocks = first.size(0);
  torch::Tensor mapping = block_mapping;
  if (!mapping.is_cuda()) {
    mapping = mapping.contiguous();
    check_mapping_ids(mapping, num_blocks, num_blocks);
    mapping = mapping.to(device);
  }
  check_cuda(mapping, "block_mapping", device);
  mapping = mapping.contiguous();
  if (mapping.size(0) == 0) return;

  const auto int64_cpu = torch::TensorOptions().dtype(torch::kInt64);
  const torch::Tensor key_ptrs_dev =
      torch::from_blob(key_ptrs.data(), {static_cast<int64_t>(key_ptrs.size())}, int64_cpu).to(device);
  const torch::Tensor value_ptrs_dev =
      torch::from_blob(value_ptrs.data(), {static_cast<int64_t>(value_ptrs.size())}, int64_cpu)
          .to(device);

  pagedllm::CopyBlocksArgs a{};
  a.key_cache_ptrs = key_ptrs_dev.data_ptr<int64_t>();
  a.value_cache_ptrs = value_ptrs_dev.data_ptr<int64_t>();
  a.block_mapping = mapping.data_ptr<int64_t>();
  a.num_layers = static_cast<int>(key_caches.size());
  a.num_pairs = mapping.size(0);
  a.block_stride_bytes = first.stride(0) * first.element_size();
  a.block_bytes = first[0].numel() * first.element_size();
  a.num_blocks = num_blocks;
  a.ptr_alignment = ptr_alignment;

  const c10::cuda::CUDAGuard guard(device);
  check_launch(pagedllm::launch_copy_blocks(a, current_stream(first)), "copy_blocks");
}

void swap_blocks(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& block_mapping) {
  check_mapping_shape(block_mapping);
  PL_CHECK(block_mapping.device().is_cpu(), "swap_blocks: block_mapping must be on the CPU, got ",
           block_mapping.device());
  PL_CHECK(src.scalar_type() == dst.scalar_type(), "swap_blocks: src is ", src.scalar_type(),
           " but dst is ", dst.scalar_type());
  PL_CHECK(src.dim() >= 2 && src.sizes().slice(1) == dst.sizes().slice(1),
           "swap_blocks: src and dst must have the same block shape, got ", src.sizes(), " and ",
           dst.sizes());
  check_block_contiguous(src, "src");
  check_block_contiguous(dst, "dst");
  cudaMemcpyKind kind;
  torch::Device cuda_device = src.device();
  if (src.is_cuda() && dst.is_cuda()) {
    PL_CHECK(src.device() == dst.device(), "swap_blocks: src and dst on different GPUs (",
             src.device(), ", ", dst.device(), ")");
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda() && dst.device().is_cpu()) {
    kind = cudaMemcpyDeviceToHost;
  } else if (src.device().is_cpu() && dst.is_cuda()) {
    kind = cudaMemcpyHostToDevice;
    cuda_device = dst.device();
  } else {
    PL_CHECK(false, "swap_blocks: one of src (", src.device(), ") and dst (", dst.device(),
             ") must be a CUDA tensor");
  }
  const torch::Tensor mapping = block_mapping.contiguous();
  check_mapping_ids(mapping, src.size(0), dst.size(0));

  const c10::cuda::CUDAGuard guard(cuda_device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(cuda_device.index()).stream();
  const int64_t block_bytes = src[0].numel() * src.element_size();
  check_launch(pagedllm::launch_swap_blocks(src.data_ptr(), dst.data_ptr(),
                                            src.stride(0) * src.element_size(),
                                            dst.stride(0) * dst.element_size(), block_bytes,
                                            mapping.data_ptr<int64_t>(), mapping.size(0), kind, stream),
               "swap_blocks");
}

}  // namespace

namespace pagedllm::binding {
void register_quant_ops(pybind11::module_& m);  // quant_bindings.cpp
}  // namespace pagedllm::binding

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedllm CUDA/ROCm kernels: paged decode attention, KV-cache maintenance, layer ops";
  m.attr("MIN_PARTITION_SIZE") = pagedllm::kMinPartitionSize;
  m.attr("MAX_PARTITION_SIZE") = pagedllm::kMaxPartitionSize;
  m.def("decode_partition_size", &pagedllm::paged_attention_partition_size,
        "Tokens per partition paged_attention uses when partition_size=0.", py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("max_seq_len"));
  m.def("paged_attention", &paged_attention,
        "Decode attention over the paged KV cache; writes out [num_seqs, num_heads, head_size].",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("num_kv_heads"), py::arg("scale"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("max_seq_len"), py::arg("tmp_out") = py::none(),
        py::arg("exp_sums") = py::none(), py::arg("max_logits") = py::none(),
        py::arg("partition_size") = 0, py::arg("num_warps") = 0, py::arg("sliding_window") = 0,
        py::arg("soft_cap") = 0.0);
  m.def("reshape_and_cache", &reshape_and_cache,
        "Write key/value [num_tokens, num_kv_heads, head_size] into the caches at slot_mapping.",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"));
  m.def("copy_blocks", &copy_blocks, "Copy blocks src -> dst in every layer's key and value cache.",
        py::arg("key_caches"), py::arg("value_caches"), py::arg("block_mapping"));
  m.def("swap_blocks", &swap_blocks, "Copy blocks between a GPU cache and a (pinned) CPU cache.",
        py::arg("src"), py::arg("dst"), py::arg("block_mapping"));
  m.def("configure_programmatic_launch", &pagedllm::configure_programmatic_launch,
        "Use programmatic dependent launch when `enable` and the device runs the kernels as "
        "sm_90+ code (call outside graph capture); returns whether it is on.",
        py::arg("enable"));
  m.def("programmatic_launch_enabled", &pagedllm::programmatic_launch_enabled,
        "Whether the kernels are launched with programmatic dependent launch.");
  m.def("kernel_arch", &pagedllm::kernel_arch,
        "__CUDA_ARCH__ of the kernels as they run on the device (e.g. 900; 0 before "
        "configure_programmatic_launch and on HIP).");
  pagedllm::binding::register_layer_ops(m);
  pagedllm::binding::register_quant_ops(m);
}
