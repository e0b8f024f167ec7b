// The linears of the one-launch decode step (decode_step_kernel.cu): the weight ring each thread
// block streams its rows through, the GEMV phase, and the residual add / rms_norm / silu_and_mul that
// produce a GEMV's input.
#pragma once

#include "bulk_copy.cuh"
#include "decode_step_common.cuh"
#include "gemv_stage.cuh"

namespace pagedllm {
namespace decode_step_detail {

struct Linear {
  const unsigned char* weight;  // this block's first row
  const void* bias;             // whole bias, or nullptr
  void* out;                    // whole output
  int64_t row0;                 // this block's first row
  int rows;
  int k;
  int stage_rows;
  int stages;
  bool f32_out;                 // the lm_head: float32 logits of the dtype-rounded sums
};

// Linear `index` of the step: layer * 4 + (0 qkv, 1 o_proj, 2 gate_up, 3 down); num_layers * 4 is
// the lm_head. Rows are split over the blocks as the GEMV kernel splits them.
template <typename T>
__device__ __noinline__ Linear linear_of(const DecodeStepArgs& a, int index) {
  const int layer = index / kLinearsPerLayer;
  const void* weight;
  const void* bias = nullptr;
  void* out;
  int64_t n;
  int k = a.hidden_size;
  Linear l{};
  if (layer >= a.num_layers) {
    weight = a.lm_head;
    out = a.logits;
    n = a.vocab_size;
    l.f32_out = true;
  } else {
    const DecodeStepLayer& w = a.layers[layer];
    switch (index % kLinearsPerLayer) {
      case 0:
        weight = w.qkv_weight;
        bias = w.qkv_bias;
        out = a.qkv_out;
        n = static_cast<int64_t>(a.num_heads + 2 * a.num_kv_heads) * kHead;
        break;
      case 1:
        weight = w.o_weight;
        out = a.o_out;
        n = a.hidden_size;
        k = a.num_heads * kHead;
        break;
      case 2:
        weight = w.gate_up_weight;
        out = a.gate_up_out;
        n = 2 * static_cast<int64_t>(a.intermediate_size);
        break;
      default:
        weight = w.down_weight;
        out = a.down_out;
        n = a.hidden_size;
        k = a.intermediate_size;
        break;
    }
  }
  l.row0 = static_cast<int64_t>(blockIdx.x) * n / gridDim.x;
  l.rows = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * n / gridDim.x - l.row0);
  l.k = k;
  l.stage_rows = gemv_stage_rows(k);
  l.stages = (l.rows + l.stage_rows - 1) / l.stage_rows;
  l.weight = static_cast<const unsigned char*>(weight) + l.row0 * k * static_cast<int64_t>(sizeof(T));
  l.bias = bias;
  l.out = out;
  return l;
}

// The block's weight ring: every thread counts the stages consumed; thread 0 alone issues the
// copies, walking the step's linears in order (its cursor, Producer, lives in shared memory).
struct Ring {
  unsigned char* buffers;
  uint64_t* arrived;
  int slots;
  uint32_t consumed;
};

struct Producer {
  uint32_t issued;
  int next_linear;
  int next_stage;
  int num_linears;
  Linear next;  // linear next_linear: an issue costs no table lookups or divisions
};

#if defined(PL_BULK_COPY)
// Thread 0: queues the next stage of the step into the next slot (nothing once all are queued).
// Not inlined (nor is linear_of): the kernel's code must stay small enough for the SM's instruction
// cache, since every layer runs all of it once.
template <typename T>
__device__ __noinline__ void issue_next(const DecodeStepArgs& a, Producer* p, const Ring ring) {
  while (p->next_linear < p->num_linears) {
    const Linear& l = p->next;
    if (p->next_stage < l.stages) {
      const int slot = static_cast<int>(p->issued % ring.slots);
      const int r0 = p->next_stage * l.stage_rows;
      const int n = min(l.stage_rows, l.rows - r0);
      bulk_load(ring.buffers + slot * kStageBytes, l.weight + static_cast<int64_t>(r0) * l.k * 2,
                static_cast<uint32_t>(n * l.k * 2), &ring.arrived[slot]);
      ++p->next_stage;
      ++p->issued;
      return;
    }
    ++p->next_linear;
    p->next_stage = 0;
    if (p->next_linear < p->num_linears) p->next = linear_of<T>(a, p->next_linear);
  }
}
#endif

// ---- the GEMV phases -------------------------------------------------------------------------------

// A GEMV's input x lives in shared memory, packed in T: thread t owns the 16-byte vectors
// xs[t + 256 j] = elements (t + 256 j) * 8 ... (so no other thread touches them), j < kMaxVecs.

// out = W x for this block's rows of linear `index`; returns the ring's new consumed count. The
// arithmetic is gemv_kernels.cu's, stage for stage. Not inlined (one copy per vector count), like
// every phase that runs once per layer: the whole kernel runs once per layer and must stay small
// enough for the SM's instruction cache.
template <typename T, int KV>
__device__ __noinline__ uint32_t run_linear(const DecodeStepArgs& a, const Ring ring,
                                            Producer* producer, int index, const uint4* xs,
                                            float (*partial)[kMaxStageRows][kWarps]) {
  const Linear l = linear_of<T>(a, index);
  const int tid = static_cast<int>(threadIdx.x);
  float x[KV][kVec];
#pragma unroll
  for (int j = 0; j < KV; ++j) vec16_to_float<T>(xs[tid + j * kThreads], x[j]);
  uint32_t consumed = ring.consumed;
#if defined(PL_BULK_COPY)
  int slot = static_cast<int>(consumed % ring.slots);  // divisions once per linear, not per stage
  uint32_t phase = (consumed / ring.slots) & 1u;
#else
  (void)producer;
#endif
#pragma unroll 1
  for (int s = 0; s < l.stages; ++s) {
    const int r0 = s * l.stage_rows;
    const int nr = min(l.stage_rows, l.rows - r0);
    const T* src = reinterpret_cast<const T*>(l.weight) + static_cast<int64_t>(r0) * l.k;
#if defined(PL_BULK_COPY)
    barrier_wait(&ring.arrived[slot], phase);
    src = reinterpret_cast<const T*>(ring.buffers + slot * kStageBytes);
#endif
    gemv_stage_partials<T, KV, kMaxStageRows, kThreads>(src, l.k, nr, x, partial[consumed & 1u]);
    __syncthreads();  // the stage's buffer is read and its partial sums are written
#if defined(PL_BULK_COPY)
    if (tid == 0) {
      bulk_fence_before_reuse();
      issue_next<T>(a, producer, ring);
    }
#endif
    if (tid < nr) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[consumed & 1u][tid][w];
      const int64_t row = l.row0 + r0 + tid;
      if (l.bias != nullptr) sum += load_scalar(static_cast<const T*>(l.bias) + row);
      if (l.f32_out) {
        static_cast<float*>(l.out)[row] = round_to<T>(sum);
      } else {
        store_from_float(static_cast<T*>(l.out) + row, sum);
      }
    }
    ++consumed;
#if defined(PL_BULK_COPY)
    if (++slot == ring.slots) {
      slot = 0;
      phase ^= 1u;
    }
#endif
  }
  return consumed;
}

// round(in + h) per element, as rms_norm_kernel adds the residual (h: the residual stream).
template <typename T>
__device__ __noinline__ uint4 add_residual8(const uint4 in, const uint4 h) {
  float a[kVec], b[kVec];
  vec16_to_float<T>(in, a);
  vec16_to_float<T>(h, b);
#pragma unroll
  for (int e = 0; e < kVec; ++e) a[e] = a[e] + b[e];
  return pack<T>(a);
}

// weight * round(h * inv_rms), rounded, as rms_norm_kernel normalizes.
template <typename T>
__device__ __noinline__ uint4 normalize8(const uint4 h, const uint4 weight, float inv_rms) {
  float hv[kVec], wv[kVec];
  vec16_to_float<T>(h, hv);
  vec16_to_float<T>(weight, wv);
#pragma unroll
  for (int e = 0; e < kVec; ++e) hv[e] = pl_fmul_rn(wv[e], round_to<T>(pl_fmul_rn(hv[e], inv_rms)));
  return pack<T>(hv);
}

// silu(gate) * up, rounded, as silu_and_mul_kernel computes it.
template <typename T>
__device__ __noinline__ uint4 silu_and_mul8(const uint4 gate, const uint4 up) {
  float g[kVec], u[kVec];
  vec16_to_float<T>(gate, g);
  vec16_to_float<T>(up, u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) g[e] = pl_fmul_rn(round_to<T>(g[e] / (1.0f + expf(-g[e]))), u[e]);
  return pack<T>(g);
}

// h = input (+ h when add_residual), then x = weight * rmsnorm(h), the next GEMV's input. h holds
// the residual stream packed in T (its values are T-rounded); `input` was written by other blocks.
template <typename T, int HV>
PL_DEVICE void add_and_norm(const DecodeStepArgs& a, const T* input, bool add_residual,
                            const void* weight, uint4 (&h)[HV], uint4* xs, float* slots) {
  const int tid = static_cast<int>(threadIdx.x);
  const int units = a.hidden_size / kVec;
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < HV; ++j) {
    const int v = tid + j * kThreads;
    if (v < units) {
      const uint4 in = pl_load_coherent(input + v * kVec);
      h[j] = add_residual ? add_residual8<T>(in, h[j]) : in;
      float hv[kVec];
      vec16_to_float<T>(h[j], hv);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum_sq += hv[e] * hv[e];
    }
  }
  const float inv_rms =
      rsqrtf(block_sum(sum_sq, slots) / static_cast<float>(a.hidden_size) + a.eps);
  const T* w = static_cast<const T*>(weight);
#pragma unroll
  for (int j = 0; j < HV; ++j) {
    const int v = tid + j * kThreads;
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    if (v < units) out = normalize8<T>(h[j], *reinterpret_cast<const uint4*>(w + v * kVec), inv_rms);
    xs[v] = out;
  }
}

// x = the n-element vector src (written by other blocks), as the GEMV kernel loads its x.
template <typename T, int XV>
PL_DEVICE void load_x(const T* src, int n, uint4* xs) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int j = 0; j < XV; ++j) {
    const int v = tid + j * kThreads;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (v < n / kVec) raw = pl_load_coherent(src + v * kVec);
    xs[v] = raw;
  }
}

// x = silu(gate) * up from the gate_up output.
template <typename T, int XV>
PL_DEVICE void silu_x(const DecodeStepArgs& a, uint4* xs) {
  const int tid = static_cast<int>(threadIdx.x);
  const T* gate = static_cast<const T*>(a.gate_up_out);
  const int inter = a.intermediate_size;
#pragma unroll
  for (int j = 0; j < XV; ++j) {
    const int v = tid + j * kThreads;
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    if (v < inter / kVec) {
      out = silu_and_mul8<T>(pl_load_coherent(gate + v * kVec),
                             pl_load_coherent(gate + inter + v * kVec));
    }
    xs[v] = out;
  }
}

}  // namespace decode_step_detail
}  // namespace pagedllm
