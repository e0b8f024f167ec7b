// The one-token decode step of a Llama-family model (batch 1) in one kernel launch.
//
// At batch 1 a step is ~130 weight-bound GEMVs with latency-bound work between them (norms,
// rotary, attention, SiLU). As separate kernels, every boundary leaves the memory system idle: a
// GEMV's blocks take an SM only when the previous GEMV's blocks leave it, and then wait for their
// first weights. Here one thread block per SM runs the whole step and streams every weight row it
// owns, layer after layer, through one ring of 32 KB shared-memory stages (bulk copies, sm_90+):
// weights never depend on activations, so the copies for the next linear layer are in flight while
// the block waits for the activations of the current one.
//
// Phases; every block takes part in each, a grid barrier separates them:
//   per layer  residual add + input rms_norm (every block, in registers: thread t keeps the 8-element
//              vectors t, t + 256, ... of the residual stream for the whole step)
//              qkv GEMV (rows split over the blocks)                              | barrier
//              attention: block u < num_kv_heads * P takes kv head u / P and context partition
//              u % P: rotary of its q heads from the qkv output, softmax(q K^T) V over its tokens;
//              the last partition's block first writes the new token's rotated k and v into the
//              cache                                                              | barrier
//              P > 1: partitions combined, one thread per output element          | barrier
//              o_proj GEMV                                                        | barrier
//              residual add + post rms_norm; gate_up GEMV                         | barrier
//              silu_and_mul (every block, for its own x vectors); down GEMV       | barrier
//   then       residual add + final norm; lm_head GEMV -> float32 logits.
//
// Numerics: residual adds, norms, rotary, silu_and_mul and the GEMVs round where the separate
// kernels round (layer_kernels.cu, gemv_kernels.cu), with the same thread layout and summation
// order, so each is bit-identical to them; only the attention sums in its own order.
//
// Grid barriers spin on one counter (barrier i waits for i * gridDim.x arrivals); the last block to
// leave the kernel resets it. So every block must be resident at once: the launcher checks that
// one block fits an SM and launches exactly one per SM, without programmatic dependent launch (a
// dependent kernel scheduled early could take the SM a block still needs).
#include "decode_step_attention.cuh"
#include "decode_step_linear.cuh"

namespace pagedllm {
namespace {

using namespace decode_step_detail;

// ---- the kernel ---------------------------------------------------------------------------------

template <typename T, int HV, int IV>
__global__ void PL_LAUNCH_BOUNDS(kThreads) decode_step_kernel(const PL_GRID_CONSTANT DecodeStepArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t arrived[kDecodeStepMaxRingSlots];
  __shared__ float partial[2][kMaxStageRows][kWarps];
  __shared__ float slots[kWarps + 1];
  __shared__ Producer producer;
  Ring ring{smem, arrived, a.ring_slots, 0u};
#if defined(PL_BULK_COPY)
  if (threadIdx.x == 0) {
    producer.issued = 0u;
    producer.next_linear = 0;
    producer.next_stage = 0;
    producer.num_linears = a.num_layers * kLinearsPerLayer + 1;
    producer.next = linear_of<T>(a, 0);
    for (int s = 0; s < ring.slots; ++s) barrier_init(&arrived[s]);
    barrier_init_fence();
    for (int s = 0; s < ring.slots; ++s) issue_next<T>(a, &producer, ring);
  }
  __syncthreads();
#endif
  float* attn_smem = reinterpret_cast<float*>(smem + a.ring_slots * kStageBytes);
  const Plan plan = plan_of(a);
  unsigned barriers = 0;
  uint4 h[HV];  // the residual stream
  // the linears' input, in the shared memory the attention phase also uses (grid barriers between)
  uint4* xs = reinterpret_cast<uint4*>(attn_smem);

  int64_t token = *a.token;
  token = token < 0 ? 0 : (token >= a.vocab_size ? a.vocab_size - 1 : token);
  const T* embedding = static_cast<const T*>(a.embed) + token * a.hidden_size;
  for (int layer = 0; layer < a.num_layers; ++layer) {
    const DecodeStepLayer& w = a.layers[layer];
    const int first = layer * kLinearsPerLayer;
    add_and_norm<T>(a, layer == 0 ? embedding : static_cast<const T*>(a.down_out), layer > 0,
                    w.input_norm, h, xs, slots);
    ring.consumed = run_linear<T, HV>(a, ring, &producer, first, xs, partial);
    KvPass kv_first;
    prefetch_attention<T>(a, w, plan, kv_first);
    grid_sync(a.counters, barriers);
    attention<T>(a, w, plan, kv_first, attn_smem);
    grid_sync(a.counters, barriers);
    if (plan.partitions > 1) {
      combine<T>(a, plan.partitions);
      grid_sync(a.counters, barriers);
    }
    load_x<T, HV>(static_cast<const T*>(a.attn_out), a.num_heads * kHead, xs);
    ring.consumed = run_linear<T, HV>(a, ring, &producer, first + 1, xs, partial);
    grid_sync(a.counters, barriers);
    add_and_norm<T>(a, static_cast<const T*>(a.o_out), true, w.post_norm, h, xs, slots);
    ring.consumed = run_linear<T, HV>(a, ring, &producer, first + 2, xs, partial);
    grid_sync(a.counters, barriers);
    silu_x<T, IV>(a, xs);
    ring.consumed = run_linear<T, IV>(a, ring, &producer, first + 3, xs, partial);
    grid_sync(a.counters, barriers);
  }
  add_and_norm<T>(a, static_cast<const T*>(a.down_out), a.num_layers > 0, a.final_norm, h, xs,
                  slots);
  ring.consumed = run_linear<T, HV>(a, ring, &producer, a.num_layers * kLinearsPerLayer, xs, partial);

  // Every block has passed its last barrier once it gets here: the last one resets the counters.
  if (threadIdx.x == 0 && atomicAdd(a.counters + 1, 1u) == gridDim.x - 1) {
    a.counters[0] = 0u;
    a.counters[1] = 0u;
    __threadfence();
  }
}

// The compiled vector counts: hidden (and q) sizes up to 2048, 4096, 8192; intermediate sizes up to
// 4096, 8192, 14336, 16384.
constexpr int kHiddenVecs[] = {1, 2, 4};
constexpr int kInterVecs[] = {2, 4, 7, 8};

inline int vecs_for(int k) { return (k / kVec + kThreads - 1) / kThreads; }

bool supported(const DecodeStepArgs& a) {
  const auto mult8 = [](int64_t v) { return v > 0 && v % kVec == 0; };
  return a.dtype != ScalarType::kFloat32 && a.num_layers >= 0 && a.num_kv_heads > 0 &&
         a.num_heads % a.num_kv_heads == 0 && a.num_heads / a.num_kv_heads <= kMaxGqa &&
         mult8(a.hidden_size) && a.hidden_size <= kDecodeStepMaxHidden &&
         mult8(a.intermediate_size) && a.intermediate_size <= kMaxVecs * kThreads * kVec &&
         vecs_for(a.num_heads * kHead) <= vecs_for(a.hidden_size) && a.vocab_size > 0 &&
         a.max_partitions >= 1 && a.max_partition_size >= kTokenSlots &&
         a.max_partition_size % kTokenSlots == 0 && a.ring_slots >= 2 &&
         a.ring_slots <= kDecodeStepMaxRingSlots && a.block_shift >= 0 && a.block_shift < 16 &&
         a.max_positions > 0;
}

int multiprocessors() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return count;
}

template <typename T, int HV, int IV>
cudaError_t launch_for(const DecodeStepArgs& a, cudaStream_t stream) {
  const auto kernel = decode_step_kernel<T, HV, IV>;
  const int smem = decode_step_shared_bytes(a);
  static int configured = 0;  // the dynamic shared memory the kernel was last allowed
  if (smem > configured) {
#if !defined(USE_ROCM)
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               static_cast<int>(cudaSharedmemCarveoutMaxShared));
    }
    if (e != cudaSuccess) return e;
#endif
    int resident = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, smem) !=
            cudaSuccess ||
        resident < 1) {
      return cudaErrorInvalidValue;
    }
    configured = smem;
  }
  const int sms = multiprocessors();
  if (sms <= 0) return cudaErrorInvalidValue;
  // a plain launch: see the header on why not programmatic
  kernel<<<dim3(sms), dim3(kThreads), smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int HV>
cudaError_t launch_inter(const DecodeStepArgs& a, cudaStream_t stream) {
  const int iv = vecs_for(a.intermediate_size);
  if (iv <= kInterVecs[0]) return launch_for<T, HV, kInterVecs[0]>(a, stream);
  if (iv <= kInterVecs[1]) return launch_for<T, HV, kInterVecs[1]>(a, stream);
  if (iv <= kInterVecs[2]) return launch_for<T, HV, kInterVecs[2]>(a, stream);
  return launch_for<T, HV, kInterVecs[3]>(a, stream);
}

template <typename T>
cudaError_t launch_hidden(const DecodeStepArgs& a, cudaStream_t stream) {
  const int hv = vecs_for(a.hidden_size);
  if (hv <= kHiddenVecs[0]) return launch_inter<T, kHiddenVecs[0]>(a, stream);
  if (hv <= kHiddenVecs[1]) return launch_inter<T, kHiddenVecs[1]>(a, stream);
  return launch_inter<T, kHiddenVecs[2]>(a, stream);
}

}  // namespace

cudaError_t launch_decode_step(const DecodeStepArgs& a, cudaStream_t stream) {
  if (!supported(a)) return cudaErrorInvalidValue;
  return a.dtype == ScalarType::kFloat16 ? launch_hidden<pl_half>(a, stream)
                                         : launch_hidden<pl_bf16>(a, stream);
}

}  // namespace pagedllm
