// extern "C" entry points over the csrc/ launchers, compiled with simt_emu.h for the CPU and loaded
// with ctypes by tests/kernels/emu_ops.py. Arguments mirror the launcher structs of csrc/ops.h.
#include <cstdint>

#include "ops.h"

using pagedllm::ScalarType;

namespace {

pagedllm::CacheSlots cache_slots(void* key_cache, int64_t kc_s0, int64_t kc_s1, int64_t kc_s2,
                                 void* value_cache, int64_t vc_s0, int64_t vc_s1, int64_t vc_s2,
                                 const int64_t* slot_mapping, int block_size, int64_t num_blocks) {
  return pagedllm::CacheSlots{key_cache,   kc_s0, kc_s1,        kc_s2,      value_cache, vc_s0,
                              vc_s1,       vc_s2, slot_mapping, block_size, num_blocks};
}

}  // namespace

extern "C" {

void emu_reset(uint64_t seed) {
  simt::g_error.clear();
  simt::g_seed = seed;
}

const char* emu_last_error() { return simt::g_error.c_str(); }

int emu_paged_attention(int dtype, void* out, int64_t out_s0, int64_t out_s1, const void* query,
                        int64_t q_s0, int64_t q_s1, const void* key_cache, int64_t k_s0,
                        int64_t k_s1, int64_t k_s2, const void* value_cache, int64_t v_s0,
                        int64_t v_s1, int64_t v_s2, const int32_t* block_tables, int64_t bt_s0,
                        int max_num_blocks_per_seq, const int32_t* seq_lens, float* tmp_out,
                        float* exp_sums, float* max_logits, int num_seqs, int num_heads,
                        int num_kv_heads, int head_size, int block_size, int num_blocks,
                        int max_seq_len, int partition_size, int warps, float scale,
                        int sliding_window, float soft_cap) {
  pagedllm::PagedAttentionArgs a{};
  a.dtype = static_cast<ScalarType>(dtype);
  a.out = out;
  a.out_seq_stride = out_s0;
  a.out_head_stride = out_s1;
  a.query = query;
  a.q_seq_stride = q_s0;
  a.q_head_stride = q_s1;
  a.key_cache = key_cache;
  a.k_block_stride = k_s0;
  a.k_token_stride = k_s1;
  a.k_head_stride = k_s2;
  a.value_cache = value_cache;
  a.v_block_stride = v_s0;
  a.v_token_stride = v_s1;
  a.v_head_stride = v_s2;
  a.block_tables = block_tables;
  a.block_tables_stride = bt_s0;
  a.max_num_blocks_per_seq = max_num_blocks_per_seq;
  a.seq_lens = seq_lens;
  a.tmp_out = tmp_out;
  a.exp_sums = exp_sums;
  a.max_logits = max_logits;
  a.num_seqs = num_seqs;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_size = head_size;
  a.block_size = block_size;
  a.num_blocks = num_blocks;
  a.max_seq_len = max_seq_len;
  a.partition_size = partition_size;
  a.warps = warps;
  a.scale = scale;
  a.sliding_window = sliding_window;
  a.soft_cap = soft_cap;
  return static_cast<int>(pagedllm::launch_paged_attention(a, nullptr));
}

int emu_decode_partition_size(int num_seqs, int num_heads, int num_kv_heads, int max_seq_len) {
  return pagedllm::paged_attention_partition_size(num_seqs, num_heads, num_kv_heads, max_seq_len);
}

int emu_decode_narrow_blocks(int64_t grid_blocks, int partition_size) {
  return pagedllm::paged_attention_narrow_blocks(grid_blocks, partition_size) ? 1 : 0;
}

int emu_reshape_and_cache(int dtype, const void* key, int64_t k_s0, int64_t k_s1, const void* value,
                          int64_t v_s0, int64_t v_s1, void* key_cache, int64_t kc_s0, int64_t kc_s1,
                          int64_t kc_s2, void* value_cache, int64_t vc_s0, int64_t vc_s1,
                          int64_t vc_s2, const int64_t* slot_mapping, int num_tokens,
                          int num_kv_heads, int head_size, int block_size, int64_t num_blocks) {
  pagedllm::ReshapeAndCacheArgs a{};
  a.dtype = static_cast<ScalarType>(dtype);
  a.key = key;
  a.key_token_stride = k_s0;
  a.key_head_stride = k_s1;
  a.value = value;
  a.value_token_stride = v_s0;
  a.value_head_stride = v_s1;
  a.cache = cache_slots(key_cache, kc_s0, kc_s1, kc_s2, value_cache, vc_s0, vc_s1, vc_s2,
                        slot_mapping, block_size, num_blocks);
  a.num_tokens = num_tokens;
  a.num_kv_heads = num_kv_heads;
  a.head_size = head_size;
  return static_cast<int>(pagedllm::launch_reshape_and_cache(a, nullptr));
}

int emu_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                    const int64_t* block_mapping, int num_layers, int64_t num_pairs,
                    int64_t block_stride_bytes, int64_t block_bytes, int64_t num_blocks,
                    int64_t ptr_alignment) {
  pagedllm::CopyBlocksArgs a{};
  a.key_cache_ptrs = key_cache_ptrs;
  a.value_cache_ptrs = value_cache_ptrs;
  a.block_mapping = block_mapping;
  a.num_layers = num_layers;
  a.num_pairs = num_pairs;
  a.block_stride_bytes = block_stride_bytes;
  a.block_bytes = block_bytes;
  a.num_blocks = num_blocks;
  a.ptr_alignment = ptr_alignment;
  return static_cast<int>(pagedllm::launch_copy_blocks(a, nullptr));
}

int emu_swap_blocks(const void* src, void* dst, int64_t src_stride_bytes, int64_t dst_stride_bytes,
                    int64_t block_bytes, const int64_t* block_mapping, int64_t num_pairs) {
  return static_cast<int>(pagedllm::launch_swap_blocks(src, dst, src_stride_bytes, dst_stride_bytes,
                                                       block_bytes, block_mapping, num_pairs,
                                                       cudaMemcpyHostToHost, nullptr));
}

int emu_rms_norm(int dtype, void* out, void* residual_out, const void* x, int64_t x_stride,
                 const void* residual, int64_t residual_stride, const void* weight, int num_tokens,
                 int hidden_size, float eps) {
  pagedllm::RmsNormArgs a{};
  a.dtype = static_cast<ScalarType>(dtype);
  a.out = out;
  a.residual_out = residual_out;
  a.x = x;
  a.x_stride = x_stride;
  a.residual = residual;
  a.residual_stride = residual_stride;
  a.weight = weight;
  a.num_tokens = num_tokens;
  a.hidden_size = hidden_size;
  a.eps = eps;
  return static_cast<int>(pagedllm::launch_rms_norm(a, nullptr));
}

int emu_rotary(int dtype, void* out, const void* x, int64_t x_s0, int64_t x_s1, const void* cos,
               int64_t cos_s0, const void* sin, int64_t sin_s0, int num_tokens, int num_heads,
               int head_size) {
  pagedllm::RotaryArgs a{};
  a.dtype = static_cast<ScalarType>(dtype);
  a.out = out;
  a.x = x;
  a.x_token_stride = x_s0;
  a.x_head_stride = x_s1;
  a.cos = cos;
  a.cos_stride = cos_s0;
  a.sin = sin;
  a.sin_stride = sin_s0;
  a.num_tokens = num_tokens;
  a.num_heads = num_heads;
  a.head_size = head_size;
  return static_cast<int>(pagedllm::launch_rotary(a, nullptr));
}

int emu_rotary_and_cache(int dtype, void* qkv, int64_t qkv_s0, const void* cos, int64_t cos_s0,
                         const void* sin, int64_t sin_s0, void* key_cache, int64_t kc_s0,
                         int64_t kc_s1, int64_t kc_s2, void* value_cache, int64_t vc_s0,
                         int64_t vc_s1, int64_t vc_s2, const int64_t* slot_mapping, int num_tokens,
                         int num_heads, int num_kv_heads, int head_size, int block_size,
                         int64_t num_blocks) {
  pagedllm::RotaryCacheArgs a{};
  a.dtype = static_cast<ScalarType>(dtype);
  a.qkv = qkv;
  a.qkv_stride = qkv_s0;
  a.cos = cos;
  a.cos_stride = cos_s0;
  a.sin = sin;
  a.sin_stride = sin_s0;
  a.cache = cache_slots(key_cache, kc_s0, kc_s1, kc_s2, value_cache, vc_s0, vc_s1, vc_s2,
                        slot_mapping, block_size, num_blocks);
  a.num_tokens = num_tokens;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_size = head_size;
  return static_cast<int>(pagedllm::launch_rotary_and_cache(a, nullptr));
}

int emu_silu_and_mul(int dtype, void* out, const void* x, int64_t x_s0, int num_tokens,
                     int intermediate_size) {
  pagedllm::SiluAndMulArgs a{};
  a.dtype = static_cast<ScalarType>(dtype);
  a.out = out;
  a.x = x;
  a.x_stride = x_s0;
  a.num_tokens = num_tokens;
  a.intermediate_size = intermediate_size;
  return static_cast<int>(pagedllm::launch_silu_and_mul(a, nullptr));
}

}  // extern "C"
