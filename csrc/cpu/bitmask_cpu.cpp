// Guided decoding's token mask for the cpu backend, in place: logits[r, t] = -inf wherever bit
// t % 32 of bitmask[r, t / 32] is 0 (pagedllm/models/layers/ops.py: apply_token_bitmask, the
// torch reference, which unpacks every bit into a [rows, words, 32] tensor first: ~3 ms for
// 64 x 8192 logits on one Zen 4 core; this is one pass over the words, skipping all-ones words).
//
// logits [rows, vocab] float32 with a contiguous last dim (any row stride); bitmask [rows, words]
// int32, contiguous, words * 32 >= vocab (bits past vocab are ignored). Values are only ever
// replaced by -inf, never recomputed, so the result is bit-identical to the reference's.
//
// Registered as torch.ops.pagedllm_cpu.apply_token_bitmask (a fragment of the library
// paged_attention_cpu.cpp defines).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

// One row: n tokens, their mask words m[0 .. ceil(n / 32)).
void mask_row(float* x, const uint32_t* m, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full = n / 32;  // words whose 32 tokens all lie inside the row
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = m[w];
    if (bits == 0xffffffffu) continue;  // the common case in loose grammars: nothing banned
    float* t = x + w * 32;
    for (int j = 0; j < 32; ++j) t[j] = ((bits >> j) & 1u) ? t[j] : kNegInf;  // a vector blend
  }
  const uint32_t bits = full * 32 < n ? m[full] : 0xffffffffu;
  for (int64_t t = full * 32; t < n; ++t)
    if (!((bits >> (t - full * 32)) & 1u)) x[t] = kNegInf;
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat,
              "logits must be a float32 CPU tensor, got ", logits.scalar_type(), " on ",
              logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be [rows, vocab] with a contiguous last dim, got shape ",
              logits.sizes(), " strides ", logits.strides());
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt &&
                  bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [rows, words] CPU tensor, got ",
              bitmask.scalar_type(), " shape ", bitmask.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == rows && words * 32 >= vocab, "bitmask must be [", rows,
              ", >= ", (vocab + 31) / 32, "] for logits ", logits.sizes(), ", got ",
              bitmask.sizes());
  float* x = logits.data_ptr<float>();
  const auto* m = reinterpret_cast<const uint32_t*>(bitmask.const_data_ptr<int32_t>());
  const int64_t stride = logits.stride(0);
  // threads only for large batches: a 64 x 8192 mask takes tens of microseconds on one core
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) mask_row(x + r * stride, m + r * words, vocab);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
