// KV-cache maintenance kernels: reshape_and_cache (write new K/V by slot), copy_blocks (copy-on-write
// for every layer in one launch) and swap_blocks (device <-> host block copies).
//
// The copies are dtype-agnostic: they move bytes in units of CopyT (16-byte uint4 when every
// pointer and stride is 16-byte aligned, else one element), so one kernel serves every dtype.
#include "cuda_compat.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int kCopyThreads = 256;

// Byte strides of one [tokens/blocks, ..., heads, head_size] operand.
struct RowAddr {
  int64_t outer;   // per token (or per block)
  int64_t token;   // per token within a block (cache only)
  int64_t head;    // per kv head
};

// grid = (num_tokens); copies the num_kv_heads rows of key and value of one token into its slot.
template <typename CopyT>
__global__ void PL_LAUNCH_BOUNDS(kCopyThreads)
    reshape_and_cache_kernel(const char* __restrict__ key, const char* __restrict__ value,
                             char* __restrict__ key_cache, char* __restrict__ value_cache,
                             const int64_t* __restrict__ slot_mapping, RowAddr key_addr,
                             RowAddr value_addr, RowAddr kc_addr, RowAddr vc_addr,
                             int num_kv_heads, int units_per_row, int block_size,
                             int64_t num_slots) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // padding (negative) or out of range: skipped
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const int total = num_kv_heads * units_per_row;
  for (int idx = static_cast<int>(threadIdx.x); idx < total; idx += kCopyThreads) {
    const int head = idx / units_per_row;
    const int64_t unit_bytes = static_cast<int64_t>(idx % units_per_row) * sizeof(CopyT);
    const char* k_src = key + token * key_addr.outer + head * key_addr.head + unit_bytes;
    const char* v_src = value + token * value_addr.outer + head * value_addr.head + unit_bytes;
    char* k_dst = key_cache + block * kc_addr.outer + offset * kc_addr.token + head * kc_addr.head +
                  unit_bytes;
    char* v_dst = value_cache + block * vc_addr.outer + offset * vc_addr.token +
                  head * vc_addr.head + unit_bytes;
    *reinterpret_cast<CopyT*>(k_dst) = *reinterpret_cast<const CopyT*>(k_src);
    *reinterpret_cast<CopyT*>(v_dst) = *reinterpret_cast<const CopyT*>(v_src);
  }
}

// grid = (num_pairs, num_layers); copies one block (block_units CopyT's, contiguous) of the key and
// the value cache of one layer.
template <typename CopyT>
__global__ void PL_LAUNCH_BOUNDS(kCopyThreads)
    copy_blocks_kernel(const int64_t* __restrict__ key_cache_ptrs,
                       const int64_t* __restrict__ value_cache_ptrs,
                       const int64_t* __restrict__ block_mapping, int64_t block_stride_bytes,
                       int64_t block_units, int64_t num_blocks) {
  pl_release_and_wait();  // inputs may come from the previous kernel (cuda_compat.h)
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  char* key_cache = reinterpret_cast<char*>(key_cache_ptrs[layer]);
  char* value_cache = reinterpret_cast<char*>(value_cache_ptrs[layer]);
  const CopyT* k_src = reinterpret_cast<const CopyT*>(key_cache + src * block_stride_bytes);
  CopyT* k_dst = reinterpret_cast<CopyT*>(key_cache + dst * block_stride_bytes);
  const CopyT* v_src = reinterpret_cast<const CopyT*>(value_cache + src * block_stride_bytes);
  CopyT* v_dst = reinterpret_cast<CopyT*>(value_cache + dst * block_stride_bytes);
  for (int64_t i = threadIdx.x; i < block_units; i += kCopyThreads) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

RowAddr row_addr(int64_t outer, int64_t token, int64_t head, int64_t elem_size) {
  return RowAddr{outer * elem_size, token * elem_size, head * elem_size};
}

bool rows_aligned16(const RowAddr& r) {
  return r.outer % 16 == 0 && r.token % 16 == 0 && r.head % 16 == 0;
}

template <typename CopyT>
void launch_reshape(const ReshapeAndCacheArgs& a, RowAddr k, RowAddr v, RowAddr kc, RowAddr vc,
                    int row_bytes, cudaStream_t stream) {
  const int units_per_row = row_bytes / static_cast<int>(sizeof(CopyT));
  launch_kernel(reshape_and_cache_kernel<CopyT>, dim3(a.num_tokens), dim3(kCopyThreads), stream,
                static_cast<const char*>(a.key), static_cast<const char*>(a.value),
                static_cast<char*>(a.cache.key_cache), static_cast<char*>(a.cache.value_cache),
                a.cache.slot_mapping, k, v, kc, vc, a.num_kv_heads, units_per_row,
                a.cache.block_size, a.cache.num_blocks * a.cache.block_size);
}

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens < 0 || a.cache.block_size <= 0 || a.num_kv_heads <= 0 || a.head_size <= 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t es = scalar_type_size(a.dtype);
  const RowAddr k = row_addr(a.key_token_stride, 0, a.key_head_stride, es);
  const RowAddr v = row_addr(a.value_token_stride, 0, a.value_head_stride, es);
  const CacheSlots& c = a.cache;
  const RowAddr kc = row_addr(c.kc_block_stride, c.kc_token_stride, c.kc_head_stride, es);
  const RowAddr vc = row_addr(c.vc_block_stride, c.vc_token_stride, c.vc_head_stride, es);
  const int row_bytes = a.head_size * static_cast<int>(es);
  const bool vec16 = row_bytes % 16 == 0 && aligned16(a.key) && aligned16(a.value) &&
                     aligned16(c.key_cache) && aligned16(c.value_cache) && rows_aligned16(k) &&
                     rows_aligned16(v) && rows_aligned16(kc) && rows_aligned16(vc);
  if (vec16) {
    launch_reshape<uint4>(a, k, v, kc, vc, row_bytes, stream);
  } else if (es == 4) {
    launch_reshape<uint32_t>(a, k, v, kc, vc, row_bytes, stream);
  } else {
    launch_reshape<uint16_t>(a, k, v, kc, vc, row_bytes, stream);
  }
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(const CopyBlocksArgs& a, cudaStream_t stream) {
  if (a.num_layers == 0 || a.num_pairs == 0 || a.block_bytes == 0) return cudaSuccess;
  if (a.num_layers < 0 || a.num_layers > 65535 || a.num_pairs < 0 || a.block_bytes < 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(a.num_pairs), a.num_layers);
  const auto divides = [&](int64_t unit) {
    return a.block_bytes % unit == 0 && a.block_stride_bytes % unit == 0 && a.ptr_alignment % unit == 0;
  };
  if (divides(16)) {
    launch_kernel(copy_blocks_kernel<uint4>, grid, dim3(kCopyThreads), stream, a.key_cache_ptrs,
                  a.value_cache_ptrs, a.block_mapping, a.block_stride_bytes, a.block_bytes / 16,
                  a.num_blocks);
  } else if (divides(2)) {
    launch_kernel(copy_blocks_kernel<uint16_t>, grid, dim3(kCopyThreads), stream, a.key_cache_ptrs,
                  a.value_cache_ptrs, a.block_mapping, a.block_stride_bytes, a.block_bytes / 2,
                  a.num_blocks);
  } else {
    launch_kernel(copy_blocks_kernel<uint8_t>, grid, dim3(kCopyThreads), stream, a.key_cache_ptrs,
                  a.value_cache_ptrs, a.block_mapping, a.block_stride_bytes, a.block_bytes,
                  a.num_blocks);
  }
  return cudaGetLastError();
}

cudaError_t launch_swap_blocks(const void* src, void* dst, int64_t src_block_stride_bytes,
                               int64_t dst_block_stride_bytes, int64_t block_bytes,
                               const int64_t* block_mapping, int64_t num_pairs, cudaMemcpyKind kind,
                               cudaStream_t stream) {
  const char* src_bytes = static_cast<const char*>(src);
  char* dst_bytes = static_cast<char*>(dst);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src_block = block_mapping[2 * i];
    const int64_t dst_block = block_mapping[2 * i + 1];
    const cudaError_t err = cudaMemcpyAsync(dst_bytes + dst_block * dst_block_stride_bytes,
                                            src_bytes + src_block * src_block_stride_bytes,
                                            static_cast<size_t>(block_bytes), kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace pagedllm
