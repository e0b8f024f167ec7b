// The attention phases of the one-launch decode step (decode_step_kernel.cu): one thread block per
// (kv head, context partition), then the partitions combined.
#pragma once

#include "decode_step_common.cuh"

namespace pagedllm {
namespace decode_step_detail {

// ---- attention ----------------------------------------------------------------------------------

// What the step's attention covers, the same for every block.
struct Plan {
  int len;         // tokens attended (the new one included)
  int partitions;  // P
  int part_size;   // tokens per partition, a multiple of kTokenSlots
  int64_t position;
  int64_t slot;    // -1: the new token's k / v are not written
};

PL_DEVICE Plan plan_of(const DecodeStepArgs& a) {
  Plan p{};
  int64_t len = *a.seq_len;
  const int64_t table = static_cast<int64_t>(a.max_blocks_per_seq) << a.block_shift;
  const int64_t room = static_cast<int64_t>(a.max_partitions) * a.max_partition_size;
  len = len < table ? len : table;
  len = len < room ? len : room;
  p.len = len < 0 ? 0 : static_cast<int>(len);
  const int wanted = (p.len + kDecodeStepPartitionTokens - 1) / kDecodeStepPartitionTokens;
  p.partitions = max(1, min(a.max_partitions, wanted));
  const int per = (p.len + p.partitions - 1) / p.partitions;
  p.part_size = (per + kTokenSlots - 1) / kTokenSlots * kTokenSlots;
  int64_t pos = *a.position;
  p.position = pos < 0 ? 0 : (pos >= a.max_positions ? a.max_positions - 1 : pos);
  const int64_t slot = *a.slot;
  p.slot = slot >= 0 && slot < (a.num_cache_blocks << a.block_shift) ? slot : -1;
  return p;
}

// Rotates the pair (i, i + 64) of a head as rotate_pairs in layer_kernels.cu does.
template <typename T>
PL_DEVICE void rotate_pair(const T* x, const T* cos, const T* sin, int i, float& o1, float& o2) {
  const float x1 = load_scalar_coherent(x + i), x2 = load_scalar_coherent(x + kHead / 2 + i);
  const float c1 = load_scalar(cos + i), c2 = load_scalar(cos + kHead / 2 + i);
  const float s1 = load_scalar(sin + i), s2 = load_scalar(sin + kHead / 2 + i);
  o1 = round_to<T>(pl_fadd_rn(round_to<T>(pl_fmul_rn(x1, c1)), round_to<T>(pl_fmul_rn(-x2, s1))));
  o2 = round_to<T>(pl_fadd_rn(round_to<T>(pl_fmul_rn(x2, c2)), round_to<T>(pl_fmul_rn(x1, s2))));
}

// The cache row (block * block_size + offset) of token t, or -1 for a token outside [0, end) or in
// a block outside the cache.
PL_DEVICE int64_t cache_row(const DecodeStepArgs& a, int t, int end) {
  if (t >= end) return -1;
  const int block = a.block_table[t >> a.block_shift];
  if (block < 0 || block >= a.num_cache_blocks) return -1;
  return (static_cast<int64_t>(block) << a.block_shift) + (t & ((1 << a.block_shift) - 1));
}

// This block's attention unit: kv head `head`, tokens [t0, t1) of the context.
struct Unit {
  bool active;
  int head;
  int part;
  int t0;
  int t1;
};

PL_DEVICE Unit unit_of(const DecodeStepArgs& a, const Plan& plan) {
  Unit u{};
  const int unit = static_cast<int>(blockIdx.x);
  u.active = unit < a.num_kv_heads * plan.partitions;
  u.head = unit / plan.partitions;
  u.part = unit % plan.partitions;
  u.t0 = u.part * plan.part_size;
  u.t1 = min(plan.len, u.t0 + plan.part_size);
  return u;
}

// One pass over a unit's tokens: thread (sub, rl) holds the 16-byte vector rl of the K and V rows of
// tokens base + u * kTokenSlots + sub. ok is false for tokens without a row in the cache, among them
// the new token (its k and v come from the qkv output).
struct KvPass {
  uint4 k[kAttnUnroll];
  uint4 v[kAttnUnroll];
  bool ok[kAttnUnroll];
};

template <typename T>
PL_DEVICE void load_pass(const DecodeStepArgs& a, const DecodeStepLayer& layer, const Unit& unit,
                         const Plan& plan, int base, KvPass& kv) {
  const int sub = static_cast<int>(threadIdx.x) / kRowLanes, rl = static_cast<int>(threadIdx.x) % kRowLanes;
  const int cached_end = min(unit.t1, plan.len - 1);  // the new token is not in the cache yet
#pragma unroll
  for (int u = 0; u < kAttnUnroll; ++u) {
    const int64_t row = cache_row(a, base + u * kTokenSlots + sub, cached_end);
    kv.ok[u] = row >= 0;
    kv.k[u] = kv.v[u] = make_uint4(0u, 0u, 0u, 0u);
    if (kv.ok[u]) {
      const int64_t at = (row * a.num_kv_heads + unit.head) * kHead + rl * kVec;
      kv.k[u] = *reinterpret_cast<const uint4*>(static_cast<const T*>(layer.key_cache) + at);
      kv.v[u] = *reinterpret_cast<const uint4*>(static_cast<const T*>(layer.value_cache) + at);
    }
  }
}

// The K/V vectors of pass `pass` over the unit's tokens (the prefetched first pass, or loaded now);
// returns the pass's first token.
template <typename T>
PL_DEVICE int pass_vectors(const DecodeStepArgs& a, const DecodeStepLayer& layer, const Unit& unit,
                           const Plan& plan, const KvPass& first, int pass, KvPass& kv) {
  const int base = unit.t0 + pass * kTokenSlots * kAttnUnroll;
  if (pass == 0) {
    kv = first;
  } else {
    load_pass<T>(a, layer, unit, plan, base, kv);
  }
  return base;
}

// The unit's first pass, loaded before the qkv barrier (the cache rows do not depend on this step).
template <typename T>
PL_DEVICE void prefetch_attention(const DecodeStepArgs& a, const DecodeStepLayer& layer,
                                  const Plan& plan, KvPass& first) {
  const Unit unit = unit_of(a, plan);
  if (unit.active) load_pass<T>(a, layer, unit, plan, unit.t0, first);
}

// The unit's attention (see the header), `first` holding its first pass. smem: q [gqa][128], the new
// token's k and v [2][128], scores [gqa][max_partition_size], sums [kWarps][gqa][128].
template <typename T>
PL_DEVICE void attention(const DecodeStepArgs& a, const DecodeStepLayer& layer, const Plan& plan,
                         const KvPass& first, float* smem) {
  const Unit unit = unit_of(a, plan);
  if (!unit.active) return;
  const int gqa = a.num_heads / a.num_kv_heads;
  const int head = unit.head, t0 = unit.t0, t1 = unit.t1, fresh = plan.len - 1;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
  const int sub = tid / kRowLanes, rl = tid % kRowLanes;
  const int stride = a.max_partition_size;
  float* qs = smem;
  float* new_k = qs + gqa * kHead;
  float* new_v = new_k + kHead;
  float* scores = new_v + kHead;
  float* sums = scores + gqa * stride;
  __shared__ float head_max[kMaxGqa], head_sum[kMaxGqa];

  const T* qkv = static_cast<const T*>(a.qkv_out);
  const T* cos = static_cast<const T*>(a.cos) + plan.position * kHead;
  const T* sin = static_cast<const T*>(a.sin) + plan.position * kHead;
  for (int idx = tid; idx < gqa * (kHead / 2); idx += kThreads) {
    const int r = idx / (kHead / 2), i = idx % (kHead / 2);
    rotate_pair(qkv + (head * gqa + r) * kHead, cos, sin, i, qs[r * kHead + i],
                qs[r * kHead + kHead / 2 + i]);
  }
  const bool last = t1 == plan.len;  // this unit attends the new token
  if (last) {
    const T* k = qkv + (a.num_heads + head) * kHead;
    const T* v = qkv + (a.num_heads + a.num_kv_heads + head) * kHead;
    T* kc = nullptr;
    T* vc = nullptr;
    if (plan.slot >= 0) {
      const int64_t row = plan.slot * a.num_kv_heads + head;
      kc = static_cast<T*>(layer.key_cache) + row * kHead;
      vc = static_cast<T*>(layer.value_cache) + row * kHead;
    }
    if (tid < kHead / 2) {
      rotate_pair(k, cos, sin, tid, new_k[tid], new_k[kHead / 2 + tid]);
      if (kc != nullptr) {
        store_from_float(kc + tid, new_k[tid]);
        store_from_float(kc + kHead / 2 + tid, new_k[kHead / 2 + tid]);
      }
    } else if (tid < kHead / 2 + kHead) {
      const int i = tid - kHead / 2;
      const unsigned short bits = pl_load_coherent_u16(v + i);
      new_v[i] = to_float<T>(bits);
      if (vc != nullptr) *reinterpret_cast<unsigned short*>(vc + i) = bits;
    }
  }
  __syncthreads();  // q and the new token's k / v in shared memory

  const int passes = (t1 - t0 + kTokenSlots * kAttnUnroll - 1) / (kTokenSlots * kAttnUnroll);
#pragma unroll 1
  for (int pass = 0; pass < passes; ++pass) {
    KvPass kv;
    const int base = pass_vectors<T>(a, layer, unit, plan, first, pass, kv);
#pragma unroll
    for (int u = 0; u < kAttnUnroll; ++u) {
      const int t = base + u * kTokenSlots + sub;
      float kf[kVec];
      vec16_to_float<T>(kv.k[u], kf);
      if (t == fresh) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) kf[e] = new_k[rl * kVec + e];
      }
      const bool valid = kv.ok[u] || t == fresh;
#pragma unroll 1
      for (int r = 0; r < gqa; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) d += qs[r * kHead + rl * kVec + e] * kf[e];
#pragma unroll
        for (int off = kRowLanes / 2; off > 0; off /= 2) d += pl_shfl_xor(d, off);
        if (rl == 0 && t < t1) scores[r * stride + t - t0] = valid ? d * a.scale : -INFINITY;
      }
    }
  }
  __syncthreads();

  const int n = t1 - t0;
  for (int r = warp; r < gqa; r += kWarps) {
    float m = -INFINITY;
    for (int t = lane; t < n; t += WARP_SIZE) m = fmaxf(m, scores[r * stride + t]);
    m = warp_max(m);
    const float base = m == -INFINITY ? 0.f : m;  // no valid token: every weight is 0
    float sum = 0.f;
    for (int t = lane; t < n; t += WARP_SIZE) {
      const float p = expf(scores[r * stride + t] - base);
      scores[r * stride + t] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      head_max[r] = m;
      head_sum[r] = sum;
    }
  }
  __syncthreads();

  // p V, one query head at a time (a loop, not unrolled: the code must stay small)
#pragma unroll 1
  for (int r = 0; r < gqa; ++r) {
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
#pragma unroll 1
    for (int pass = 0; pass < passes; ++pass) {
      KvPass kv;
      const int base = pass_vectors<T>(a, layer, unit, plan, first, pass, kv);
#pragma unroll
      for (int u = 0; u < kAttnUnroll; ++u) {
        const int t = base + u * kTokenSlots + sub;
        if ((!kv.ok[u] && t != fresh) || t >= t1) continue;
        float vf[kVec];
        vec16_to_float<T>(kv.v[u], vf);
        if (t == fresh) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) vf[e] = new_v[rl * kVec + e];
        }
        const float p = scores[r * stride + t - t0];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += p * vf[e];
      }
    }
    // the token slots of a warp, then the warps through shared memory
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
#pragma unroll
      for (int off = kRowLanes; off < WARP_SIZE; off *= 2) acc[e] += pl_shfl_xor(acc[e], off);
    }
    if (lane < kRowLanes) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) sums[(warp * gqa + r) * kHead + rl * kVec + e] = acc[e];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < gqa * kHead; idx += kThreads) {
    const int r = idx / kHead, d = idx % kHead;
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += sums[(w * gqa + r) * kHead + d];
    const int q_head = head * gqa + r;
    if (plan.partitions == 1) {
      const float s = head_sum[r];
      store_from_float(static_cast<T*>(a.attn_out) + q_head * kHead + d, s > 0.f ? total / s : 0.f);
    } else {
      const int64_t at = static_cast<int64_t>(unit.part) * a.num_heads + q_head;
      a.part_acc[at * kHead + d] = total;
      if (d == 0) {
        a.part_max[at] = head_max[r];
        a.part_sum[at] = head_sum[r];
      }
    }
  }
}

// attn_out from the partitions' partial results, one thread per output element.
template <typename T>
PL_DEVICE void combine(const DecodeStepArgs& a, int partitions) {
  const int total = a.num_heads * kHead;
  for (int i = static_cast<int>(blockIdx.x * kThreads + threadIdx.x); i < total;
       i += static_cast<int>(gridDim.x) * kThreads) {
    const int q_head = i / kHead;
    float m = -INFINITY;
    for (int p = 0; p < partitions; ++p) {
      m = fmaxf(m, pl_load_coherent(a.part_max + static_cast<int64_t>(p) * a.num_heads + q_head));
    }
    float sum = 0.f, out = 0.f;
    for (int p = 0; p < partitions; ++p) {
      const int64_t at = static_cast<int64_t>(p) * a.num_heads + q_head;
      const float pm = pl_load_coherent(a.part_max + at);
      const float w = pm == -INFINITY ? 0.f : expf(pm - m);
      sum += pl_load_coherent(a.part_sum + at) * w;
      out += pl_load_coherent(a.part_acc + at * kHead + i % kHead) * w;
    }
    store_from_float(static_cast<T*>(a.attn_out) + i, sum > 0.f ? out / sum : 0.f);
  }
}

}  // namespace decode_step_detail
}  // namespace pagedllm
