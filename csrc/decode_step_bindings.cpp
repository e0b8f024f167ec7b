// Binding of the one-token decode step (decode_step_kernel.cu): a DecodeStep object built once per
// model from its weights and KV caches (checked here, with the scratch buffers and the device table
// of layer pointers it owns), then run once per step on the step's one-element input tensors.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "binding_checks.h"

namespace pagedllm::binding {
namespace {

using TensorList = std::vector<torch::Tensor>;

int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  return cudaDeviceGetAttribute(&value, attribute, device) == cudaSuccess ? value : 0;
}

class DecodeStep {
 public:
  DecodeStep(const torch::Tensor& embed, const torch::Tensor& final_norm,
             const torch::Tensor& lm_head, const torch::Tensor& cos, const torch::Tensor& sin,
             const TensorList& qkv, const TensorList& qkv_bias, const TensorList& o_proj,
             const TensorList& gate_up, const TensorList& down, const TensorList& input_norm,
             const TensorList& post_norm, const TensorList& kv_caches, int64_t num_heads,
             int64_t num_kv_heads, double eps, double scale, int64_t max_model_len,
             int64_t ring_slots)
      : keep_(), args_() {
    const torch::Device device = embed.device();
    check_cuda(embed, "embed", device);
    const ScalarType dtype = to_scalar_type(embed, "embed");
    PL_CHECK(dtype != ScalarType::kFloat32, "decode_step: the model dtype must be float16 or ",
             "bfloat16, got ", embed.scalar_type());
    PL_CHECK(embed.dim() == 2, "embed must be [vocab, hidden], got ", embed.sizes());
    const int64_t vocab = embed.size(0), hidden = embed.size(1);
    const int64_t layers = static_cast<int64_t>(qkv.size());
    const int64_t head = kDecodeStepHeadSize;
    PL_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                 num_heads / num_kv_heads <= kDecodeStepMaxGqa,
             "decode_step: num_heads (", num_heads, ") must be a multiple of num_kv_heads (",
             num_kv_heads, ") with at most ", kDecodeStepMaxGqa, " query heads per kv head");
    PL_CHECK(hidden % 8 == 0 && hidden <= kDecodeStepMaxHidden, "decode_step: hidden size must be",
             " a multiple of 8 up to ", kDecodeStepMaxHidden, ", got ", hidden);
    PL_CHECK(ring_slots >= 2 && ring_slots <= kDecodeStepMaxRingSlots, "decode_step: ring_slots ",
             "must be in [2, ", kDecodeStepMaxRingSlots, "], got ", ring_slots);
    PL_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers,
             "decode_step: qkv_bias must be empty or have one tensor per layer");
    for (const TensorList* list : {&o_proj, &gate_up, &down, &input_norm, &post_norm, &kv_caches}) {
      PL_CHECK(static_cast<int64_t>(list->size()) == layers,
               "decode_step: every per-layer list must have ", layers, " tensors (one per layer)");
    }
    PL_CHECK(layers > 0 && !kv_caches.empty() && kv_caches[0].dim() == 5,
             "decode_step: kv caches must be [2, num_blocks, block_size, num_kv_heads, 128]");
    const int64_t num_blocks = kv_caches[0].size(1), block_size = kv_caches[0].size(2);
    PL_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
             "decode_step: block_size must be a power of two, got ", block_size);
    const int64_t inter = gate_up[0].size(0) / 2;
    const int64_t qkv_rows = (num_heads + 2 * num_kv_heads) * head;
    PL_CHECK(inter % 8 == 0 && inter <= 16384 && num_heads * head <= 16384,
             "decode_step: intermediate size (", inter, ") and num_heads * 128 (", num_heads * head,
             ") must be multiples of 8 up to 16384");

    const auto weight = [&](const torch::Tensor& t, const char* name,
                            at::IntArrayRef shape) -> const void* {
      check_cuda(t, name, device);
      check_dtype(t, name, embed.scalar_type());
      check_shape(t, name, shape);
      PL_CHECK(t.is_contiguous(), "decode_step: ", name, " must be contiguous");
      check_aligned16(t, name);
      keep_.push_back(t);
      return t.data_ptr();
    };
    std::vector<DecodeStepLayer> table(static_cast<size_t>(layers));
    for (int64_t i = 0; i < layers; ++i) {
      DecodeStepLayer& l = table[static_cast<size_t>(i)];
      l.qkv_weight = weight(qkv[i], "qkv weight", {qkv_rows, hidden});
      l.qkv_bias = qkv_bias.empty() ? nullptr : weight(qkv_bias[i], "qkv bias", {qkv_rows});
      l.o_weight = weight(o_proj[i], "o_proj weight", {hidden, num_heads * head});
      l.gate_up_weight = weight(gate_up[i], "gate_up weight", {2 * inter, hidden});
      l.down_weight = weight(down[i], "down weight", {hidden, inter});
      l.input_norm = weight(input_norm[i], "input norm weight", {hidden});
      l.post_norm = weight(post_norm[i], "post-attention norm weight", {hidden});
      const void* cache =
          weight(kv_caches[i], "kv cache", {2, num_blocks, block_size, num_kv_heads, head});
      l.key_cache = const_cast<void*>(cache);
      l.value_cache = kv_caches[i].select(0, 1).data_ptr();
    }
    const auto options = embed.options();
    torch::Tensor layer_table = torch::empty(
        {static_cast<int64_t>(table.size() * sizeof(DecodeStepLayer))},
        options.dtype(torch::kUInt8));
    layer_table.copy_(torch::from_blob(table.data(), {layer_table.size(0)}, torch::kUInt8));
    keep_.push_back(layer_table);

    const int dev = device.index();
    const int sms = device_attribute(cudaDevAttrMultiProcessorCount, dev);
    const int64_t max_len = max_model_len < 1 ? 1 : max_model_len;
    const int64_t wanted = (max_len + kDecodeStepPartitionTokens - 1) / kDecodeStepPartitionTokens;
    const int64_t partitions = std::max<int64_t>(1, std::min<int64_t>(sms / num_kv_heads, wanted));
    const int64_t part_size = ((max_len + partitions - 1) / partitions + 15) / 16 * 16;

    DecodeStepArgs& a = args_;
    a.dtype = dtype;
    a.layers = reinterpret_cast<const DecodeStepLayer*>(layer_table.data_ptr());
    a.num_layers = static_cast<int>(layers);
    a.embed = weight(embed, "embed", {vocab, hidden});
    a.final_norm = weight(final_norm, "final norm weight", {hidden});
    a.lm_head = weight(lm_head, "lm_head weight", {vocab, hidden});
    PL_CHECK(cos.dim() == 2 && cos.size(1) == head, "cos must be [max_positions, 128], got ",
             cos.sizes());
    a.cos = weight(cos, "cos", {cos.size(0), head});
    a.sin = weight(sin, "sin", {cos.size(0), head});
    a.max_positions = cos.size(0);
    a.num_cache_blocks = num_blocks;
    a.block_shift = 0;
    while ((int64_t{1} << a.block_shift) < block_size) ++a.block_shift;
    a.hidden_size = static_cast<int>(hidden);
    a.intermediate_size = static_cast<int>(inter);
    a.num_heads = static_cast<int>(num_heads);
    a.num_kv_heads = static_cast<int>(num_kv_heads);
    a.vocab_size = vocab;
    a.max_partitions = static_cast<int>(partitions);
    a.max_partition_size = static_cast<int>(part_size);
    a.ring_slots = static_cast<int>(ring_slots);
    a.eps = static_cast<float>(eps);
    a.scale = static_cast<float>(scale);

    const auto scratch = [&](int64_t n, bool f32) -> torch::Tensor {
      torch::Tensor t = torch::empty({n}, f32 ? options.dtype(torch::kFloat32) : options);
      keep_.push_back(t);
      return t;
    };
    a.qkv_out = scratch(qkv_rows, false).data_ptr();
    a.attn_out = scratch(num_heads * head, false).data_ptr();
    a.o_out = scratch(hidden, false).data_ptr();
    a.gate_up_out = scratch(2 * inter, false).data_ptr();
    a.down_out = scratch(hidden, false).data_ptr();
    a.part_acc = scratch(partitions * num_heads * head, true).data_ptr<float>();
    a.part_max = scratch(partitions * num_heads, true).data_ptr<float>();
    a.part_sum = scratch(partitions * num_heads, true).data_ptr<float>();
    torch::Tensor counters = torch::zeros({2}, options.dtype(torch::kInt32));
    keep_.push_back(counters);
    a.counters = reinterpret_cast<unsigned*>(counters.data_ptr());

    const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    PL_CHECK(decode_step_shared_bytes(a) <= limit, "decode_step: ", decode_step_shared_bytes(a),
             " bytes of shared memory per block (", ring_slots, " ring slots, max_model_len ",
             max_len, ") exceed the device's ", limit);
  }

  void run(const torch::Tensor& token, const torch::Tensor& position, const torch::Tensor& slot,
           const torch::Tensor& seq_len, const torch::Tensor& block_table, torch::Tensor& logits) {
    const torch::Device device = token.device();
    const auto one = [&](const torch::Tensor& t, const char* name, at::ScalarType dtype) {
      check_cuda(t, name, device);
      check_dtype(t, name, dtype);
      PL_CHECK(t.numel() == 1, "decode_step: ", name, " must hold one element, got ", t.sizes());
    };
    one(token, "token", torch::kInt64);
    one(position, "position", torch::kInt64);
    one(slot, "slot", torch::kInt64);
    one(seq_len, "seq_len", torch::kInt32);
    check_cuda(block_table, "block_table", device);
    check_dtype(block_table, "block_table", torch::kInt32);
    PL_CHECK(block_table.dim() == 1 && block_table.is_contiguous() && block_table.numel() > 0,
             "decode_step: block_table must be one contiguous row, got ", block_table.sizes());
    check_cuda(logits, "logits", device);
    check_dtype(logits, "logits", torch::kFloat32);
    check_shape(logits, "logits", {args_.vocab_size});
    PL_CHECK(logits.is_contiguous(), "decode_step: logits must be contiguous");

    DecodeStepArgs a = args_;
    a.token = token.data_ptr<int64_t>();
    a.position = position.data_ptr<int64_t>();
    a.slot = slot.data_ptr<int64_t>();
    a.seq_len = seq_len.data_ptr<int32_t>();
    a.block_table = block_table.data_ptr<int32_t>();
    a.max_blocks_per_seq = static_cast<int>(block_table.numel());
    a.logits = logits.data_ptr<float>();
    const c10::cuda::CUDAGuard guard(device);
    check_launch(launch_decode_step(a, current_stream(token)), "decode_step");
  }

  int64_t shared_bytes() const { return decode_step_shared_bytes(args_); }
  int64_t max_partitions() const { return args_.max_partitions; }

 private:
  TensorList keep_;  // every tensor the kernel reads or writes stays alive with this object
  DecodeStepArgs args_;
};

}  // namespace

void register_decode_step(pybind11::module_& m) {
  py::class_<DecodeStep>(m, "DecodeStep",
                         "The one-token decode step of a Llama-family model in one launch.")
      .def(py::init<const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                    const torch::Tensor&, const torch::Tensor&, const TensorList&,
                    const TensorList&, const TensorList&, const TensorList&, const TensorList&,
                    const TensorList&, const TensorList&, const TensorList&, int64_t, int64_t,
                    double, double, int64_t, int64_t>(),
           py::arg("embed"), py::arg("final_norm"), py::arg("lm_head"), py::arg("cos"),
           py::arg("sin"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o_proj"),
           py::arg("gate_up"), py::arg("down"), py::arg("input_norm"), py::arg("post_norm"),
           py::arg("kv_caches"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"),
           py::arg("scale"), py::arg("max_model_len"), py::arg("ring_slots") = 5)
      .def("run", &DecodeStep::run,
           "Logits [vocab] (float32) of one step: token, position, slot (int64 [1]), seq_len "
           "(int32 [1], the new token included), block_table (int32 row).",
           py::arg("token"), py::arg("position"), py::arg("slot"), py::arg("seq_len"),
           py::arg("block_table"), py::arg("logits"))
      .def_property_readonly("shared_bytes", &DecodeStep::shared_bytes)
      .def_property_readonly("max_partitions", &DecodeStep::max_partitions);
}

}  // namespace pagedllm::binding
