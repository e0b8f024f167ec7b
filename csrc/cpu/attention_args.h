// Argument checks and the stride geometry shared by the cpu attention kernels
// (paged_attention_cpu.cpp: decode, prefill_attention_cpu.cpp: prefill). Both take
//   out, query  [num_tokens, num_heads, head_size]  (decode: one token per sequence)
//   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_size]  K = [0], V = [1]
//   block_tables [num_seqs, max_blocks] int32
// with one dtype (float32, bfloat16 or float16) for out, query and kv_cache, and every tensor's
// last dim contiguous. Header-only; everything is in an anonymous namespace of each includer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

namespace {

// Sizes and strides (in elements) both kernels index with, plus the scores' options.
struct AttentionGeometry {
  int64_t num_heads, num_kv_heads, head_size, block_size;
  int64_t group;                          // query heads per kv head
  int64_t q_tok, q_head;                  // query strides (a token: a sequence in decode)
  int64_t o_tok, o_head;                  // out strides
  int64_t c_kv, c_block, c_slot, c_head;  // kv_cache strides (dims 0-3)
  int64_t table_stride;                   // block_tables stride(0)
  float scale;
  int64_t window;  // > 0: a query at position p sees keys k > p - window only
  float soft_cap;  // > 0: scores become soft_cap * tanh(score / soft_cap) before the softmax
};

// Checks out / query / kv_cache / block_tables as described above (`op` names the kernel in
// the messages; `more` are further tensors that must be on the CPU too), and returns their
// geometry. block_tables' row count is the caller's to check.
inline AttentionGeometry check_attention_args(const char* op, const at::Tensor& out,
                                              const at::Tensor& query,
                                              const at::Tensor& kv_cache,
                                              const at::Tensor& block_tables, double scale,
                                              int64_t sliding_window, double soft_cap,
                                              std::initializer_list<const at::Tensor*> more) {
  for (const at::Tensor* t : {&out, &query, &kv_cache, &block_tables}) {
    TORCH_CHECK(t->device().is_cpu(), op, ": every tensor must be on the CPU, got one on ",
                t->device());
  }
  for (const at::Tensor* t : more) {
    TORCH_CHECK(t->device().is_cpu(), op, ": every tensor must be on the CPU, got one on ",
                t->device());
  }
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got "
              "shape ", query.sizes());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, op, ": kv_cache must be [2, "
              "num_blocks, block_size, num_kv_heads, head_size], got shape ", kv_cache.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out must have the shape of query ",
              query.sizes(), ", got ", out.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": query must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(kv_cache.scalar_type() == dtype && out.scalar_type() == dtype, op,
              ": query, out and kv_cache must have one dtype, got query ", dtype, ", out ",
              out.scalar_type(), ", kv_cache ", kv_cache.scalar_type());
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1, op,
              ": query, out and kv_cache must be contiguous in their last (head_size) dim, got "
              "strides ", query.strides(), ", ", out.strides(), ", ", kv_cache.strides());
  TORCH_CHECK(kv_cache.size(4) == query.size(2), op, ": kv_cache head_size ", kv_cache.size(4),
              " differs from query head_size ", query.size(2));
  TORCH_CHECK(kv_cache.size(3) > 0 && query.size(1) % kv_cache.size(3) == 0, op, ": num_heads=",
              query.size(1), " must be a multiple of the cache's num_kv_heads=", kv_cache.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
              op, ": block_tables must be int32 [num_seqs, max_blocks], contiguous in its last "
              "dim, got ", block_tables.scalar_type(), " ", block_tables.sizes(), " strides ",
              block_tables.strides());
  TORCH_CHECK(sliding_window >= 0, op, ": sliding_window must be >= 0 (0: none), got ",
              sliding_window);
  TORCH_CHECK(soft_cap >= 0, op, ": soft_cap must be >= 0 (0: none), got ", soft_cap);

  AttentionGeometry g;
  g.num_heads = query.size(1);
  g.head_size = query.size(2);
  g.block_size = kv_cache.size(2);
  g.num_kv_heads = kv_cache.size(3);
  g.group = g.num_heads / g.num_kv_heads;
  g.q_tok = query.stride(0);
  g.q_head = query.stride(1);
  g.o_tok = out.stride(0);
  g.o_head = out.stride(1);
  g.c_kv = kv_cache.stride(0);
  g.c_block = kv_cache.stride(1);
  g.c_slot = kv_cache.stride(2);
  g.c_head = kv_cache.stride(3);
  g.table_stride = block_tables.stride(0);
  g.scale = static_cast<float>(scale);
  g.window = sliding_window;
  g.soft_cap = static_cast<float>(soft_cap);
  return g;
}

}  // namespace
