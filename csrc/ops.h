// Torch-free launcher API of the pagedllm kernels. Implemented in paged_attention.cu,
// cache_kernels.cu and layer_kernels.cu; called from torch_bindings.cpp (the only file that knows
// about torch).
//
// Conventions: pointers are raw device pointers (host pointers where stated), strides are in
// ELEMENTS of the tensor's dtype, the last dimension of every tensor is contiguous, and every
// launcher enqueues work on `stream` and returns the launch status (cudaSuccess when fine).
// Launchers allocate nothing and do not synchronize.
#pragma once

#include <cstdint>

#include "cuda_compat.h"

namespace pagedllm {

enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int scalar_type_size(ScalarType dtype) { return dtype == ScalarType::kFloat32 ? 4 : 2; }

// ---------------------------------------------------------------------------------------------
// Paged decode attention (one query token per sequence).
// ---------------------------------------------------------------------------------------------

// Tokens per partition of the context, chosen per launch (PagedAttentionArgs::partition_size): a
// power of two in [kMinPartitionSize, kMaxPartitionSize]. A sequence longer than one partition is
// split over several thread blocks whose partial results a second (reduce) kernel combines.
constexpr int kMinPartitionSize = 64;
constexpr int kMaxPartitionSize = 1024;
// The grid size below which partitions are shortened (about 4 thread blocks per SM of an H200).
constexpr int kTargetDecodeBlocks = 512;

inline bool paged_attention_supports_partition_size(int p) {
  return p >= kMinPartitionSize && p <= kMaxPartitionSize && (p & (p - 1)) == 0;
}

inline int paged_attention_num_partitions(int max_seq_len, int partition_size) {
  return max_seq_len <= 0 ? 1 : (max_seq_len + partition_size - 1) / partition_size;
}

// Query heads one thread block serves: the kv group, in the compiled sizes 1, 4 and 8 (larger
// groups take several blocks).
inline int paged_attention_heads_per_block(int q_per_kv) {
  return q_per_kv <= 1 ? 1 : (q_per_kv <= 4 ? 4 : 8);
}

// The decode kernel is compiled with 4 warps per thread block and with 2. A 2-warp block needs half
// the registers, so twice as many blocks fit on an SM and overlap their latency-bound phases (q
// load, softmax, reductions), which short partitions are made of. Measured on an H200 (bf16,
// d128, GQA 4): 2 warps 6-11% faster for partitions of 128-256 tokens in grids of 2048 blocks;
// 4 warps faster for fewer blocks (17% at 512) and for longer partitions.
constexpr int kNarrowMaxPartitionSize = 256;
constexpr int64_t kNarrowMinBlocks = 1024;

inline bool paged_attention_narrow_blocks(int64_t grid_blocks, int partition_size) {
  return partition_size <= kNarrowMaxPartitionSize && grid_blocks >= kNarrowMinBlocks;
}

// The partition size for a launch: the longest one (no longer than the context needs) that still
// gives the grid kTargetDecodeBlocks thread blocks. Long partitions mean fewer partial results to
// combine; short ones spread a few sequences (batch-1 decode) over more of the GPU.
inline int paged_attention_partition_size(int num_seqs, int num_heads, int num_kv_heads,
                                          int max_seq_len) {
  const int q_per_kv = num_kv_heads > 0 ? num_heads / num_kv_heads : 1;
  const int gqa = paged_attention_heads_per_block(q_per_kv);
  const int64_t blocks_per_partition =
      static_cast<int64_t>(num_seqs) * num_kv_heads * ((q_per_kv + gqa - 1) / gqa);
  int p = kMinPartitionSize;
  while (p < kMaxPartitionSize && p < max_seq_len) p *= 2;
  while (p > kMinPartitionSize &&
         blocks_per_partition * paged_attention_num_partitions(max_seq_len, p) < kTargetDecodeBlocks) {
    p /= 2;
  }
  return p;
}

// Head sizes the decode kernel is compiled for.
inline bool paged_attention_supports_head_size(int head_size) {
  return head_size == 64 || head_size == 80 || head_size == 96 || head_size == 112 ||
         head_size == 128 || head_size == 256;
}

// Any power of two works (a token's block is `pos >> log2(block_size)`); 16 and 32 are tested.
inline bool paged_attention_supports_block_size(int block_size) {
  return block_size > 0 && (block_size & (block_size - 1)) == 0;
}

struct PagedAttentionArgs {
  ScalarType dtype;               // of out, query, key_cache and value_cache
  void* out;                      // [num_seqs, num_heads, head_size]
  int64_t out_seq_stride;
  int64_t out_head_stride;
  const void* query;              // [num_seqs, num_heads, head_size]
  int64_t q_seq_stride;
  int64_t q_head_stride;
  const void* key_cache;          // [num_blocks, block_size, num_kv_heads, head_size]
  int64_t k_block_stride;
  int64_t k_token_stride;
  int64_t k_head_stride;
  const void* value_cache;        // [num_blocks, block_size, num_kv_heads, head_size]
  int64_t v_block_stride;
  int64_t v_token_stride;
  int64_t v_head_stride;
  const int32_t* block_tables;    // [num_seqs, max_num_blocks_per_seq]
  int64_t block_tables_stride;
  int max_num_blocks_per_seq;
  const int32_t* seq_lens;        // [num_seqs]; tokens of context including the current one
  // Partition buffers, used (and required) only when paged_attention_num_partitions(max_seq_len,
  // partition_size) > 1.
  // All contiguous float32.
  float* tmp_out;                 // [num_seqs, num_heads, num_partitions, head_size]
  float* exp_sums;                // [num_seqs, num_heads, num_partitions]
  float* max_logits;              // [num_seqs, num_heads, num_partitions]
  int num_seqs;
  int num_heads;
  int num_kv_heads;               // divides num_heads
  int head_size;
  int block_size;
  int num_blocks;                 // block ids outside [0, num_blocks) are treated as masked tokens
  int max_seq_len;                // >= every seq_len; sets the partitions launched: a longer
                                  // sequence is cut at ceil(max_seq_len / P) * P tokens
  int partition_size;             // P: tokens per partition (paged_attention_supports_partition_size)
  int warps;                      // warps per thread block: 0 = paged_attention_narrow_blocks
                                  // decides; 2 or 4 forces one (tests, tuning)
  float scale;
  // Optional attention features (zero-initialized args leave both off):
  int sliding_window;             // > 0: the query (position seq_len - 1) sees only the last
                                  // sliding_window tokens (positions > seq_len - 1 - window)
  float soft_cap;                 // > 0: logits (scaled q.k) become cap * tanh(logit / cap)
};

// All pointers and strides must be aligned to 16 bytes (the kernel uses 16-byte vector loads).
cudaError_t launch_paged_attention(const PagedAttentionArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// KV-cache maintenance.
// ---------------------------------------------------------------------------------------------

// Where a step's new K/V rows go: both caches of one layer and each token's slot.
struct CacheSlots {
  void* key_cache;                // [num_blocks, block_size, num_kv_heads, head_size]
  int64_t kc_block_stride;
  int64_t kc_token_stride;
  int64_t kc_head_stride;
  void* value_cache;              // [num_blocks, block_size, num_kv_heads, head_size]
  int64_t vc_block_stride;
  int64_t vc_token_stride;
  int64_t vc_head_stride;
  const int64_t* slot_mapping;    // [num_tokens]; slot = block * block_size + offset
  int block_size;
  int64_t num_blocks;
};

struct ReshapeAndCacheArgs {
  ScalarType dtype;               // of key, value and both caches
  const void* key;                // [num_tokens, num_kv_heads, head_size]
  int64_t key_token_stride;
  int64_t key_head_stride;
  const void* value;              // [num_tokens, num_kv_heads, head_size]
  int64_t value_token_stride;
  int64_t value_head_stride;
  CacheSlots cache;
  int num_tokens;
  int num_kv_heads;
  int head_size;
};

// Negative slots are padding and skipped; slots >= num_blocks * block_size are skipped as well
// (the kernel never writes outside the caches).
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

struct CopyBlocksArgs {
  const int64_t* key_cache_ptrs;    // device array [num_layers] of key-cache base addresses
  const int64_t* value_cache_ptrs;  // device array [num_layers] of value-cache base addresses
  const int64_t* block_mapping;     // device [num_pairs, 2] (src, dst), contiguous
  int num_layers;
  int64_t num_pairs;
  int64_t block_stride_bytes;       // distance between consecutive blocks of one cache
  int64_t block_bytes;              // bytes of one block (contiguous)
  int64_t num_blocks;               // pairs with an id outside [0, num_blocks) are skipped
  int64_t ptr_alignment;            // largest power of two (<= 16) dividing every base address
};

// Copies block src -> dst in the key and value cache of every layer, in one launch.
cudaError_t launch_copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream);

// One cudaMemcpyAsync of block_bytes per pair of the HOST array block_mapping [num_pairs, 2].
// The caller has validated the block ids.
cudaError_t launch_swap_blocks(const void* src, void* dst, int64_t src_block_stride_bytes,
                               int64_t dst_block_stride_bytes, int64_t block_bytes,
                               const int64_t* block_mapping, int64_t num_pairs, cudaMemcpyKind kind,
                               cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Fused elementwise layer ops (layer_kernels.cu). float16/bfloat16 results are bit-identical to the
// torch reference ops of pagedllm/models/layers/ops.py except where a float32 reduction or exp
// rounds differently (see layer_kernels.cu); every launcher accepts num_tokens == 0.
// ---------------------------------------------------------------------------------------------

struct RmsNormArgs {
  ScalarType dtype;               // of every tensor
  void* out;                      // [num_tokens, hidden_size], contiguous
  void* residual_out;             // [num_tokens, hidden_size], contiguous; only with residual
  const void* x;                  // [num_tokens, hidden_size]
  int64_t x_stride;
  const void* residual;           // [num_tokens, hidden_size], or nullptr: h = x
  int64_t residual_stride;
  const void* weight;             // [hidden_size]
  int num_tokens;
  int hidden_size;
  float eps;
};

// h = x + residual (rounded to the dtype; written to residual_out), then
// out = weight * round(h * rsqrt(mean(h^2) + eps)), the mean taken in float32.
cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);

struct RotaryArgs {
  ScalarType dtype;               // of every tensor
  void* out;                      // [num_tokens, num_heads, head_size], contiguous
  const void* x;                  // [num_tokens, num_heads, head_size]
  int64_t x_token_stride;
  int64_t x_head_stride;
  const void* cos;                // [num_tokens, head_size]
  int64_t cos_stride;
  const void* sin;                // [num_tokens, head_size]
  int64_t sin_stride;
  int num_tokens;
  int num_heads;
  int head_size;                  // even
};

// Neox-style rotary embedding: out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
cudaError_t launch_rotary(const RotaryArgs& args, cudaStream_t stream);

struct RotaryCacheArgs {
  ScalarType dtype;               // of every tensor
  void* qkv;                      // [num_tokens, (num_heads + 2 * num_kv_heads) * head_size]: the
  int64_t qkv_stride;             //   q heads, k heads, v heads of each token; q and k rotated in place
  const void* cos;                // [num_tokens, head_size]
  int64_t cos_stride;
  const void* sin;                // [num_tokens, head_size]
  int64_t sin_stride;
  CacheSlots cache;
  int num_tokens;
  int num_heads;
  int num_kv_heads;
  int head_size;                  // even
};

// The rotary embedding of launch_rotary applied in place to the q and k heads of a qkv projection,
// and the rotated k and the v of each token written into the caches at its slot (as
// launch_reshape_and_cache; negative or out-of-range slots write nothing to the caches): one
// launch for the rotary and the cache write of a layer.
cudaError_t launch_rotary_and_cache(const RotaryCacheArgs& args, cudaStream_t stream);

struct SiluAndMulArgs {
  ScalarType dtype;               // of both tensors
  void* out;                      // [num_tokens, intermediate_size], contiguous
  const void* x;                  // [num_tokens, 2 * intermediate_size]: gate, then up
  int64_t x_stride;
  int num_tokens;
  int intermediate_size;
};

// out = round(silu(gate)) * up, silu(g) = g / (1 + exp(-g)).
cudaError_t launch_silu_and_mul(const SiluAndMulArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// GEMV for one-token (batch 1) decode linears (gemv_kernels.cu).
// ---------------------------------------------------------------------------------------------

constexpr int kGemvMaxK = 16384;

// In-features the GEMV takes: whole 16-byte vectors of a 16-bit dtype, at most kGemvMaxK.
inline bool gemv_supports_k(int64_t k) { return k > 0 && k % 8 == 0 && k <= kGemvMaxK; }

struct GemvArgs {
  ScalarType dtype;               // of every tensor: float16 or bfloat16
  void* out;                      // [n], contiguous
  const void* x;                  // [k], contiguous, 16-byte aligned
  const void* weight;             // [n, k], contiguous, 16-byte aligned
  const void* bias;               // [n] or nullptr
  int64_t n;
  int k;                          // gemv_supports_k
  bool staged;                    // stream the weights through shared memory with bulk copies
                                  // (sm_90+; ignored elsewhere)
  int stage_rows;                 // set by the launcher
};

// out = weight @ x (+ bias), accumulated in float32 and rounded once.
cudaError_t launch_gemv(GemvArgs args, cudaStream_t stream);
#if defined(PL_GEMV_TRACE)
// Timing build (-DPL_GEMV_TRACE, CUDA only): every GEMV block records {weight, sm << 32 | block,
// entry, wait done, exit} (%globaltimer ns); copies up to max_records of them (5 int64 each) to
// host memory, sets *count to how many were recorded, and starts the record anew.
cudaError_t gemv_trace_take(int64_t* host, int64_t max_records, int64_t* count);
#endif

}  // namespace pagedllm
