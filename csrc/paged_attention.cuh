// Paged decode attention kernels (device code). Launchers: paged_attention.cu.
//
// Work decomposition
//   grid = (num_kv_heads * head_chunks, num_seqs, num_partitions); one thread block handles GQA
//   query heads that share one kv head (head_chunks = ceil(q_per_kv / GQA)), one sequence and one
//   partition of a.partition_size tokens (chosen per launch, at most kMaxPartitionSize). Every K/V element of the partition is loaded from global
//   memory exactly once per block and used for all GQA query heads.
//
//   Inside a block, each of the WARPS warps walks "chunks" of CHUNK consecutive tokens (warp w
//   takes chunks w, w + WARPS, ...). A token row (head_size elements) is read by a group of GROUP lanes with
//   16-byte loads: lane `glane` of the group owns the 16-byte vectors glane, glane + GROUP, ...
//   A warp therefore covers TOKENS_PER_STEP = WARP_SIZE / GROUP tokens per load and issues STEPS
//   loads per lane per chunk before using them, to keep enough bytes in flight.
//
//   Phase 1 (QK): logits[g][t] = scale * q_g . k_t, reduced over the GROUP lanes with shuffles,
//                 stored in shared memory; running max per head.
//   Phase 2:      block max and exp-sum per head; logits are overwritten by exp(logit - max).
//   Phase 3 (PV): each lane accumulates p * v for its vectors; lanes of different token slots are
//                 summed with shuffles, warps through shared memory.
//   Output:       one partition -> out = acc / sum directly; several partitions -> the normalized
//                 partial output, max logit and exp-sum go to the tmp buffers and
//                 paged_attention_reduce_kernel combines them.
//
// Sliding window (a.sliding_window > 0): tokens before window_start() are masked like tokens past
// the end (never loaded, logit -inf); partitions wholly before it exit at once and the reduce
// kernel skips them. Soft cap (a.soft_cap > 0): each logit becomes cap * tanh(logit / cap).
//
// Masking: tokens at or past the (effective) sequence length are never loaded; a block-table entry
// outside [0, num_blocks) masks its tokens (logit -inf, value never loaded), so a bad block table
// can not make the kernel read outside the cache. A sequence with no valid token yields zeros.
#pragma once

#include <cmath>

#include "dtype_convert.cuh"
#include "ops.h"

namespace pagedllm {

#ifndef PAGEDLLM_ATTN_WARPS  // warps per thread block (a tuning knob, like the partition size)
#define PAGEDLLM_ATTN_WARPS 4
#endif
// Two block widths are compiled: PAGEDLLM_ATTN_WARPS, and 2 warps for short partitions in large
// grids; each launch picks one (paged_attention_narrow_blocks in ops.h).
constexpr int kAttnWarps = PAGEDLLM_ATTN_WARPS;
constexpr int kAttnWarpsNarrow = 2;
#ifndef PAGEDLLM_ATTN_LOADS  // 16-byte loads in flight per lane (a tuning knob)
#define PAGEDLLM_ATTN_LOADS 8
#endif
#ifndef PAGEDLLM_ATTN_MAX_GROUP  // most lanes that share one token row (a tuning knob)
#define PAGEDLLM_ATTN_MAX_GROUP 8  // H200, bf16 d128 GQA 4: 8 lanes 77.6% of copy BW, 16 lanes 60%
#endif
constexpr int kReduceThreads = 128;

__host__ __device__ constexpr int ceil_pow2(int x) { return x <= 1 ? 1 : 2 * ceil_pow2((x + 1) / 2); }
__host__ __device__ constexpr int const_min(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int const_max(int a, int b) { return a > b ? a : b; }

// Thread layout of the decode kernel for one dtype, head size and GQA (see the header comment).
// A row group is at most PAGEDLLM_ATTN_MAX_GROUP lanes (fewer lanes per token mean fewer shuffle
// rounds per token) but wide enough that a lane holds at most kQFloats query floats and
// a row takes at most PAGEDLLM_ATTN_LOADS loads per lane.
template <typename T, int HEAD_SIZE, int GQA>
struct DecodeLayout {
  static constexpr int kVec = Vec16<T>::kElems;                       // elements per 16 B load
  static constexpr int kNumVecs = HEAD_SIZE / kVec;                   // 16 B vectors per row
  static constexpr int kQFloats = 64;
  static constexpr int kGroup = const_min(
      const_min(ceil_pow2(kNumVecs), WARP_SIZE),
      const_max(const_max(PAGEDLLM_ATTN_MAX_GROUP, ceil_pow2(GQA * HEAD_SIZE / kQFloats)),
                ceil_pow2(kNumVecs) / PAGEDLLM_ATTN_LOADS));
  // a power of two, so that it divides PAGEDLLM_ATTN_LOADS
  static constexpr int kVecsPerLane = ceil_pow2((kNumVecs + kGroup - 1) / kGroup);
  static constexpr int kTokensPerStep = WARP_SIZE / kGroup;           // tokens per warp load
  static constexpr int kSteps = PAGEDLLM_ATTN_LOADS / kVecsPerLane;    // loads in flight per lane
  static constexpr int kChunk = kTokensPerStep * kSteps;              // tokens per warp chunk
  static_assert(HEAD_SIZE % kVec == 0, "head_size * sizeof(T) must be a multiple of 16 bytes");
  static_assert(kSteps >= 1 && PAGEDLLM_ATTN_LOADS % kVecsPerLane == 0, "unsupported head size");
  static_assert(kMinPartitionSize % kChunk == 0, "a partition must be a whole number of chunks");
};

// Tokens of sequence `seq` the kernels look at: seq_lens[seq] clamped to what the block table and
// the launched partitions can hold (so a seq_len larger than max_seq_len can not read past them).
PL_DEVICE int effective_seq_len(const PagedAttentionArgs& a, int seq, int block_shift,
                                int num_partitions) {
  int64_t len = a.seq_lens[seq];
  const int64_t table_tokens = static_cast<int64_t>(a.max_num_blocks_per_seq) << block_shift;
  const int64_t part_tokens = static_cast<int64_t>(num_partitions) * a.partition_size;
  len = len < table_tokens ? len : table_tokens;
  len = len < part_tokens ? len : part_tokens;
  return len < 0 ? 0 : static_cast<int>(len);
}

// First token the query of a sequence of seq_len tokens sees: seq_len - window (0 without one).
PL_DEVICE int window_start(const PagedAttentionArgs& a, int seq_len) {
  return (a.sliding_window > 0 && seq_len > a.sliding_window) ? seq_len - a.sliding_window : 0;
}

PL_DEVICE uint4 load16(const void* ptr) { return *reinterpret_cast<const uint4*>(ptr); }

// Warp-wide reductions (every lane gets the result).
PL_DEVICE float warp_max(float v) {
#pragma unroll
  for (int off = WARP_SIZE / 2; off > 0; off /= 2) v = fmaxf(v, pl_shfl_xor(v, off));
  return v;
}
PL_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int off = WARP_SIZE / 2; off > 0; off /= 2) v += pl_shfl_xor(v, off);
  return v;
}

// Loads STEPS x VPL 16-byte vectors of one chunk of K or V rows into registers. Vectors of masked
// tokens (before first_tok, past part_end or in a block outside the cache) and padding vectors are
// zero.
// valid[s] tells whether token chunk + s * TOKENS_PER_STEP + slot is a real token.
template <typename T, int HEAD_SIZE, int GQA>
PL_DEVICE void load_chunk(const T* __restrict__ cache, int64_t block_stride, int64_t token_stride,
                          int64_t head_offset, const int32_t* __restrict__ block_table,
                          int block_shift, int num_blocks, int chunk, int first_tok,
                          int part_end, int slot,
                          int glane, uint4 (&raw)[DecodeLayout<T, HEAD_SIZE, GQA>::kSteps]
                                                 [DecodeLayout<T, HEAD_SIZE, GQA>::kVecsPerLane],
                          bool (&valid)[DecodeLayout<T, HEAD_SIZE, GQA>::kSteps]) {
  using L = DecodeLayout<T, HEAD_SIZE, GQA>;
  const int block_mask = (1 << block_shift) - 1;
#pragma unroll
  for (int s = 0; s < L::kSteps; ++s) {
    const int tok = chunk + s * L::kTokensPerStep + slot;
    int physical_block = -1;
    const bool in_range = tok >= first_tok && tok < part_end;
    if (in_range) physical_block = block_table[tok >> block_shift];
    valid[s] = in_range && physical_block >= 0 && physical_block < num_blocks;
    const T* row = cache + physical_block * block_stride + (tok & block_mask) * token_stride +
                   head_offset;
#pragma unroll
    for (int i = 0; i < L::kVecsPerLane; ++i) {
      const int vi = glane + i * L::kGroup;
      raw[s][i] = make_uint4(0u, 0u, 0u, 0u);
      if (valid[s] && vi < L::kNumVecs) raw[s][i] = load16(row + vi * L::kVec);
    }
  }
}

template <typename T, int HEAD_SIZE, int GQA, int WARPS>
__global__ void PL_LAUNCH_BOUNDS(WARPS * WARP_SIZE)
    paged_attention_kernel(const PagedAttentionArgs a, int block_shift, int q_per_kv) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  constexpr int kThreads = WARPS * WARP_SIZE;
  using L = DecodeLayout<T, HEAD_SIZE, GQA>;
  constexpr int VEC = L::kVec;
  constexpr int GROUP = L::kGroup;
  constexpr int VPL = L::kVecsPerLane;
  constexpr int STEPS = L::kSteps;
  constexpr int CHUNK = L::kChunk;
  constexpr int kLogitFloats = GQA * kMaxPartitionSize;          // logits[GQA][kMaxPartitionSize]
  constexpr int kReduceFloats = WARPS * GQA * HEAD_SIZE;    // red_out[warps][GQA][HEAD_SIZE]
  __shared__ float smem[kLogitFloats > kReduceFloats ? kLogitFloats : kReduceFloats];
  __shared__ float red_max[WARPS][GQA];
  __shared__ float red_sum[WARPS][GQA];

  const int tid = threadIdx.x;
  const int head_chunk = blockIdx.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int num_partitions = gridDim.z;
  const int chunks_per_kv = (q_per_kv + GQA - 1) / GQA;
  const int kv_head = head_chunk / chunks_per_kv;
  const int first_in_group = (head_chunk % chunks_per_kv) * GQA;  // within the kv group
  const int head0 = kv_head * q_per_kv + first_in_group;          // query heads head0 + g
  const int num_valid_heads = const_min(GQA, q_per_kv - first_in_group);

  const int seq_len = effective_seq_len(a, seq, block_shift, num_partitions);
  const int part_start = partition * a.partition_size;
  const int first_tok = window_start(a, seq_len);  // tokens [first_tok, seq_len) are visible
  if (part_start + a.partition_size <= first_tok) return;  // before the window: never reduced
  if (part_start >= seq_len) {
    // Only an empty sequence gets here with one partition: its output is zero.
    if (num_partitions == 1) {
      T* out = static_cast<T*>(a.out) + seq * a.out_seq_stride;
      for (int idx = tid; idx < num_valid_heads * HEAD_SIZE; idx += kThreads) {
        store_from_float(out + (head0 + idx / HEAD_SIZE) * a.out_head_stride + idx % HEAD_SIZE, 0.f);
      }
    }
    return;  // uniform over the block
  }
  const int part_end = const_min(part_start + a.partition_size, seq_len);
  const int part_tokens = part_end - part_start;

  const int warp = tid / WARP_SIZE;
  const int lane = tid % WARP_SIZE;
  const int slot = lane / GROUP;    // token slot of this lane within a warp step
  const int glane = lane % GROUP;   // lane within the token group; owns vectors glane + i * GROUP

  const int32_t* __restrict__ block_table = a.block_tables + seq * a.block_tables_stride;
  const T* __restrict__ key_cache = static_cast<const T*>(a.key_cache);
  const T* __restrict__ value_cache = static_cast<const T*>(a.value_cache);

  // q[g][i][e]: scaled query head head0 + g, elements (glane + i * GROUP) * VEC + e.
  float q[GQA][VPL][VEC];
  {
    const T* q_seq = static_cast<const T*>(a.query) + seq * a.q_seq_stride;
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const int vi = glane + i * GROUP;
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        if (g < num_valid_heads && vi < L::kNumVecs) {
          raw = load16(q_seq + (head0 + g) * a.q_head_stride + vi * VEC);
        }
        vec16_to_float<T>(raw, q[g][i]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[g][i][e] *= a.scale;
      }
    }
  }

  // ---- Phase 1: logits ----------------------------------------------------------------------
  float* logits = smem;  // [GQA][kMaxPartitionSize], index t = token - part_start
  float qk_max[GQA];
#pragma unroll
  for (int g = 0; g < GQA; ++g) qk_max[g] = -INFINITY;

  const int64_t k_head_offset = kv_head * a.k_head_stride;
#pragma unroll 1
  for (int chunk = part_start + warp * CHUNK; chunk < part_end; chunk += WARPS * CHUNK) {
    uint4 raw[STEPS][VPL];
    bool valid[STEPS];
    load_chunk<T, HEAD_SIZE, GQA>(key_cache, a.k_block_stride, a.k_token_stride,
                                  k_head_offset, block_table, block_shift, a.num_blocks, chunk,
                                  first_tok, part_end, slot, glane, raw, valid);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      float dot[GQA];
#pragma unroll
      for (int g = 0; g < GQA; ++g) dot[g] = 0.f;
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        float k[VEC];
        vec16_to_float<T>(raw[s][i], k);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] += q[g][i][e] * k[e];
        }
      }
      // Sum over the GROUP lanes of the token (all lanes of the warp take part).
#pragma unroll
      for (int g = 0; g < GQA; ++g) {
#pragma unroll
        for (int off = GROUP / 2; off > 0; off /= 2) dot[g] += pl_shfl_xor(dot[g], off, GROUP);
      }
      const int tok = chunk + s * L::kTokensPerStep + slot;
      if (glane == 0 && tok < part_end) {
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
          float logit = dot[g];
          if (a.soft_cap > 0.f) logit = a.soft_cap * tanhf(logit / a.soft_cap);
          logit = valid[s] ? logit : -INFINITY;
          logits[g * kMaxPartitionSize + (tok - part_start)] = logit;
          qk_max[g] = fmaxf(qk_max[g], logit);
        }
      }
    }
  }

  // ---- Phase 2: softmax statistics ----------------------------------------------------------
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    const float m = warp_max(qk_max[g]);
    if (lane == 0) red_max[warp][g] = m;
  }
  __syncthreads();  // logits and red_max complete
  float block_max[GQA];
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    block_max[g] = red_max[0][g];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) block_max[g] = fmaxf(block_max[g], red_max[w][g]);
  }
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    float local_sum = 0.f;
    for (int t = tid; t < part_tokens; t += kThreads) {
      float* logit = logits + g * kMaxPartitionSize + t;
      const float p = block_max[g] == -INFINITY ? 0.f : expf(*logit - block_max[g]);
      *logit = p;
      local_sum += p;
    }
    local_sum = warp_sum(local_sum);
    if (lane == 0) red_sum[warp][g] = local_sum;
  }
  __syncthreads();  // probabilities and red_sum complete

  // ---- Phase 3: probabilities x V -----------------------------------------------------------
  float acc[GQA][VPL][VEC];
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][i][e] = 0.f;
    }
  }
  const int64_t v_head_offset = kv_head * a.v_head_stride;
#pragma unroll 1
  for (int chunk = part_start + warp * CHUNK; chunk < part_end; chunk += WARPS * CHUNK) {
    uint4 raw[STEPS][VPL];
    bool valid[STEPS];
    load_chunk<T, HEAD_SIZE, GQA>(value_cache, a.v_block_stride, a.v_token_stride,
                                  v_head_offset, block_table, block_shift, a.num_blocks, chunk,
                                  first_tok, part_end, slot, glane, raw, valid);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      if (!valid[s]) continue;  // p is 0 (or the token is past the end); its row was not loaded
      const int t = chunk + s * L::kTokensPerStep + slot - part_start;
      float p[GQA];
#pragma unroll
      for (int g = 0; g < GQA; ++g) p[g] = logits[g * kMaxPartitionSize + t];
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        float v[VEC];
        vec16_to_float<T>(raw[s][i], v);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][i][e] += p[g] * v[e];
        }
      }
    }
  }
  // Sum the token slots of the warp: lanes with equal glane hold the same vectors.
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
#pragma unroll
        for (int off = GROUP; off < WARP_SIZE; off *= 2) acc[g][i][e] += pl_shfl_xor(acc[g][i][e], off);
      }
    }
  }
  __syncthreads();  // every warp is done reading logits: smem is reused below
  float* red_out = smem;  // [WARPS][GQA][HEAD_SIZE]
  if (slot == 0) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const int vi = glane + i * GROUP;
        if (vi < L::kNumVecs) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) red_out[(warp * GQA + g) * HEAD_SIZE + vi * VEC + e] = acc[g][i][e];
        }
      }
    }
  }
  __syncthreads();

  // ---- Output ---------------------------------------------------------------------------------
  const int64_t row0 = static_cast<int64_t>(seq) * a.num_heads + head0;  // (seq, head0) row
  for (int idx = tid; idx < num_valid_heads * HEAD_SIZE; idx += kThreads) {
    const int g = idx / HEAD_SIZE;
    const int d = idx % HEAD_SIZE;
    float sum = 0.f;
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      sum += red_sum[w][g];
      value += red_out[(w * GQA + g) * HEAD_SIZE + d];
    }
    value = sum > 0.f ? value / sum : 0.f;
    if (num_partitions == 1) {
      T* out = static_cast<T*>(a.out) + seq * a.out_seq_stride + (head0 + g) * a.out_head_stride;
      store_from_float(out + d, value);
    } else {
      a.tmp_out[((row0 + g) * num_partitions + partition) * HEAD_SIZE + d] = value;
    }
  }
  if (num_partitions > 1 && tid < num_valid_heads) {
    const int g = tid;
    float sum = 0.f;
    float max_logit = -INFINITY;
    for (int w = 0; w < WARPS; ++w) {
      sum += red_sum[w][g];
      max_logit = fmaxf(max_logit, red_max[w][g]);
    }
    a.exp_sums[(row0 + g) * num_partitions + partition] = sum;
    a.max_logits[(row0 + g) * num_partitions + partition] = max_logit;
  }
}

// Combines the partitions of one (sequence, head): grid (num_heads, num_seqs).
// out = sum_p w_p * tmp_out_p / sum_p w_p with w_p = exp_sum_p * exp(max_logit_p - global_max);
// tmp_out_p is already normalized by its own exp_sum.
template <typename T>
__global__ void PL_LAUNCH_BOUNDS(kReduceThreads)
    paged_attention_reduce_kernel(const PagedAttentionArgs a, int block_shift, int num_partitions) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int tid = threadIdx.x;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  T* out = static_cast<T*>(a.out) + seq * a.out_seq_stride + head * a.out_head_stride;
  const int seq_len = effective_seq_len(a, seq, block_shift, num_partitions);
  const int used = (seq_len + a.partition_size - 1) / a.partition_size;  // partitions written
  const int first = window_start(a, seq_len) / a.partition_size;  // earlier ones: before the window
  const int64_t row = static_cast<int64_t>(seq) * a.num_heads + head;
  const float* max_logits = a.max_logits + row * num_partitions;
  const float* exp_sums = a.exp_sums + row * num_partitions;
  const float* tmp_out = a.tmp_out + row * num_partitions * a.head_size;

  float global_max = -INFINITY;
  for (int p = first; p < used; ++p) global_max = fmaxf(global_max, max_logits[p]);
  float weight_sum = 0.f;
  if (global_max != -INFINITY) {
    for (int p = first; p < used; ++p) weight_sum += exp_sums[p] * expf(max_logits[p] - global_max);
  }
  const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
  for (int d = tid; d < a.head_size; d += kReduceThreads) {
    float value = 0.f;
    if (inv > 0.f) {
      for (int p = first; p < used; ++p) {
        value += exp_sums[p] * expf(max_logits[p] - global_max) * tmp_out[p * a.head_size + d];
      }
    }
    store_from_float(out + d, value * inv);
  }
}

}  // namespace pagedllm
