// Launchers of the paged decode attention kernels (kernels: paged_attention.cuh).
// Dispatch: dtype (enum) -> head size -> query heads per block (GQA in {1, 4, 8}).
#include "ops.h"
#include "paged_attention.cuh"

namespace pagedllm {
namespace {

int log2_exact(int x) {  // x is a power of two
  int shift = 0;
  while ((1 << shift) < x) ++shift;
  return shift;
}

template <typename T, int HEAD_SIZE, int GQA>
void launch_decode(const PagedAttentionArgs& a, int block_shift, int q_per_kv, int num_partitions,
                   cudaStream_t stream) {
  const int chunks_per_kv = (q_per_kv + GQA - 1) / GQA;
  const dim3 grid(a.num_kv_heads * chunks_per_kv, a.num_seqs, num_partitions);
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  const bool narrow = a.warps == 0 ? paged_attention_narrow_blocks(blocks, a.partition_size)
                                   : a.warps == kAttnWarpsNarrow;
  if (narrow) {
    launch_kernel(paged_attention_kernel<T, HEAD_SIZE, GQA, kAttnWarpsNarrow>, grid,
                  dim3(kAttnWarpsNarrow * WARP_SIZE), stream, a, block_shift, q_per_kv);
  } else {
    launch_kernel(paged_attention_kernel<T, HEAD_SIZE, GQA, kAttnWarps>, grid,
                  dim3(kAttnWarps * WARP_SIZE), stream, a, block_shift, q_per_kv);
  }
  if (num_partitions > 1) {
    const dim3 reduce_grid(a.num_heads, a.num_seqs);
    launch_kernel(paged_attention_reduce_kernel<T>, reduce_grid, dim3(kReduceThreads), stream, a,
                  block_shift, num_partitions);
  }
}

// Smallest compiled GQA that covers the kv group; groups larger than 8 take several blocks.
// (A group of 2 or 3 runs with GQA = 4 and idle head slots: the kernel is bound by K/V reads, and
// fewer variants keep the build short.)
template <typename T, int HEAD_SIZE>
void dispatch_gqa(const PagedAttentionArgs& a, int block_shift, int num_partitions,
                  cudaStream_t stream) {
  const int q_per_kv = a.num_heads / a.num_kv_heads;
  if (q_per_kv <= 1) {
    launch_decode<T, HEAD_SIZE, 1>(a, block_shift, q_per_kv, num_partitions, stream);
  } else if (q_per_kv <= 4) {
    launch_decode<T, HEAD_SIZE, 4>(a, block_shift, q_per_kv, num_partitions, stream);
  } else {
    launch_decode<T, HEAD_SIZE, 8>(a, block_shift, q_per_kv, num_partitions, stream);
  }
}

template <typename T>
bool dispatch_head_size(const PagedAttentionArgs& a, int block_shift, int num_partitions,
                        cudaStream_t stream) {
  switch (a.head_size) {
    case 64: dispatch_gqa<T, 64>(a, block_shift, num_partitions, stream); return true;
    case 80: dispatch_gqa<T, 80>(a, block_shift, num_partitions, stream); return true;
    case 96: dispatch_gqa<T, 96>(a, block_shift, num_partitions, stream); return true;
    case 112: dispatch_gqa<T, 112>(a, block_shift, num_partitions, stream); return true;
    case 128: dispatch_gqa<T, 128>(a, block_shift, num_partitions, stream); return true;
    case 256: dispatch_gqa<T, 256>(a, block_shift, num_partitions, stream); return true;
    default: return false;
  }
}

}  // namespace

cudaError_t launch_paged_attention(const PagedAttentionArgs& a, cudaStream_t stream) {
  if (a.num_seqs == 0 || a.num_heads == 0) return cudaSuccess;
  if (a.num_seqs < 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 ||
      a.num_seqs > 65535 || !paged_attention_supports_head_size(a.head_size) ||
      !paged_attention_supports_block_size(a.block_size)) {
    return cudaErrorInvalidValue;
  }
  if (!paged_attention_supports_partition_size(a.partition_size)) return cudaErrorInvalidValue;
  if (a.warps != 0 && a.warps != kAttnWarps && a.warps != kAttnWarpsNarrow) {
    return cudaErrorInvalidValue;
  }
  const int num_partitions = paged_attention_num_partitions(a.max_seq_len, a.partition_size);
  if (num_partitions > 1 && (a.tmp_out == nullptr || a.exp_sums == nullptr || a.max_logits == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int block_shift = log2_exact(a.block_size);
  bool launched = false;
  switch (a.dtype) {
    case ScalarType::kFloat32: launched = dispatch_head_size<float>(a, block_shift, num_partitions, stream); break;
    case ScalarType::kFloat16: launched = dispatch_head_size<pl_half>(a, block_shift, num_partitions, stream); break;
    case ScalarType::kBFloat16: launched = dispatch_head_size<pl_bf16>(a, block_shift, num_partitions, stream); break;
  }
  if (!launched) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace pagedllm
