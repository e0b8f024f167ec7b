// y = x W^T (+ b) for a few rows of float32 (1 <= M <= 8): the cpu backend's route for the
// linears of a model that runs a handful of rows per call (a speculative proposer's draft
// passes; LayerContext.few_rows, backends/cpu/few_rows.py).
//
// Why: oneDNN's packed GEMM pays a fixed ~25-40 us per call at one to five rows on a two-core
// VM (its primitive dispatch and thread team, whatever the layer's size), and streams weights
// at ~12-18 GB/s when they come from memory, against ~28 GB/s the cores read
// (benchmarks/RESULTS.md, issue 43). Here each thread streams its own contiguous column blocks
// once: the weight is packed [ceil(out / B)][in][B] (B = 4 vectors of columns; zero padding
// past ``out``), so a block is one contiguous run of in * B floats, and each row's B outputs
// accumulate in registers (M x 4 vectors) over a broadcast of x[m][i] — no horizontal sums.
//
// Weights are packed as float32 or bfloat16 (the caller packs bf16 where every weight is exactly
// a bf16 value, as a bf16 checkpoint's are in a float32 model: half the bytes, no rounding);
// bf16 columns are widened to float32 in registers.
//
// Arithmetic: float32 fused multiply-adds in input order i = 0, 1, ...: not the rounding of
// oneDNN's or torch's GEMMs (their blocked sums), so results agree to float32 accumulation
// error, not bit for bit. The route is for proposers, whose outputs only propose tokens (the
// target verifies them), never for a target's linears.
//
// Registered as torch.ops.pagedllm_cpu.{few_rows_linear_pack, few_rows_linear,
// few_rows_linear_block} (a fragment of the library paged_attention_cpu.cpp defines).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<at::BFloat16>;  // 2 x Vec::size() lanes
constexpr int64_t kVecs = 4;        // vectors of columns per packed block
constexpr int64_t kMaxRows = 8;

int64_t block_width() { return kVecs * static_cast<int64_t>(Vec::size()); }

at::Tensor few_rows_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "few_rows_linear_pack: weight must be [out, in], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "few_rows_linear_pack: weight must be float32 or bfloat16, got ",
              weight.scalar_type());
  const int64_t out = weight.size(0), in = weight.size(1), b = block_width();
  const int64_t blocks = (out + b - 1) / b;
  at::Tensor padded = at::zeros({blocks * b, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({blocks, b, in}).transpose(1, 2).contiguous();  // [blocks, in, B]
}

// V float vectors of weight columns at ``p``.
template <int V>
inline void load_columns(const float* p, Vec* out) {
  for (int v = 0; v < V; ++v) out[v] = Vec::loadu(p + v * Vec::size());
}

template <int V>
inline void load_columns(const at::BFloat16* p, Vec* out) {
  static_assert(V % 2 == 0, "bf16 columns widen two float vectors at a time");
  for (int v = 0; v < V; v += 2) {
    auto wide = at::vec::convert_to_float<at::BFloat16>(BVec::loadu(p + v * Vec::size()));
    out[v] = std::get<0>(wide);
    out[v + 1] = std::get<1>(wide);
  }
}

// One packed block's columns [col, col + cols) for all M rows. V vectors of the block at a
// time (V = kVecs for few rows; fewer where M rows x V accumulators would not fit registers).
template <typename W, int M, int V>
void block_rows(const float* __restrict x, int64_t in, const W* __restrict w,
                const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols) {
  constexpr int64_t L = Vec::size();
  const int64_t b = block_width();
  for (int64_t v0 = 0; v0 < kVecs; v0 += V) {
    if (v0 * L >= cols) break;
    Vec acc[M][V];
    for (int v = 0; v < V; ++v) {
      const int64_t c = (v0 + v) * L;
      Vec init = Vec(0.f);
      if (bias != nullptr && c < cols) init = Vec::loadu(bias + c, std::min<int64_t>(L, cols - c));
      for (int m = 0; m < M; ++m) acc[m][v] = init;
    }
    const W* wp = w + v0 * L;
    for (int64_t i = 0; i < in; ++i, wp += b) {
      Vec wv[V];
      load_columns<V>(wp, wv);
      for (int m = 0; m < M; ++m) {
        const Vec xv = Vec(x[m * in + i]);
        for (int v = 0; v < V; ++v) acc[m][v] = at::vec::fmadd(xv, wv[v], acc[m][v]);
      }
    }
    for (int v = 0; v < V; ++v) {
      const int64_t c = (v0 + v) * L;
      if (c >= cols) break;
      const int64_t n = std::min<int64_t>(L, cols - c);
      for (int m = 0; m < M; ++m) {
        if (n == L) acc[m][v].store(y + m * ldy + c);
        else acc[m][v].store(y + m * ldy + c, n);
      }
    }
  }
}

template <typename W, int M>
void run_rows(const float* x, int64_t in, const W* packed, const float* bias, float* y,
              int64_t out) {
  // M x V accumulators + V weights + one broadcast stay in 32 (AVX-512) or 16 (AVX2) registers
  // (V even: bf16 columns widen in pairs)
  constexpr int V = (M <= 5 && Vec::size() == 16) ? 4 : (M <= 3 ? 4 : 2);
  const int64_t b = block_width();
  const int64_t blocks = (out + b - 1) / b;
  // a grain of blocks worth ~64 KiB of weights: a small layer stays on one thread
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, in * b * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t col = k * b;
      block_rows<W, M, V>(x, in, packed + k * in * b, bias ? bias + col : nullptr, y + col, out,
                          std::min(b, out - col));
    }
  });
}

template <typename W>
void dispatch_rows(int64_t rows, const float* x, int64_t in, const W* w, const float* bias,
                   float* y, int64_t out) {
  switch (rows) {
    case 1: run_rows<W, 1>(x, in, w, bias, y, out); break;
    case 2: run_rows<W, 2>(x, in, w, bias, y, out); break;
    case 3: run_rows<W, 3>(x, in, w, bias, y, out); break;
    case 4: run_rows<W, 4>(x, in, w, bias, y, out); break;
    case 5: run_rows<W, 5>(x, in, w, bias, y, out); break;
    case 6: run_rows<W, 6>(x, in, w, bias, y, out); break;
    case 7: run_rows<W, 7>(x, in, w, bias, y, out); break;
    default: run_rows<W, 8>(x, in, w, bias, y, out); break;
  }
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& packed,
                           const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "few_rows_linear: x must be a contiguous float32 [rows, in], got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t rows = x.size(0), in = x.size(1), b = block_width();
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "few_rows_linear: rows=", rows,
              " is outside 1..", kMaxRows, " (larger batches take the GEMM)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == in && packed.size(2) == b &&
                  (packed.scalar_type() == at::kFloat ||
                   packed.scalar_type() == at::kBFloat16) && packed.is_contiguous(),
              "few_rows_linear: packed must be few_rows_linear_pack's [blocks, ", in, ", ", b,
              "] float32 or bfloat16, got ", packed.sizes(), " ", packed.scalar_type());
  TORCH_CHECK(out_features >= 1 && out_features <= packed.size(0) * b &&
                  out_features > (packed.size(0) - 1) * b,
              "few_rows_linear: out_features=", out_features, " does not match the packing (",
              packed.size(0), " blocks of ", b, ")");
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->scalar_type() == at::kFloat,
                "few_rows_linear: bias must be float32 [", out_features, "]");
    bias_c = bias->contiguous();
    bias_ptr = bias_c.data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16) {
    dispatch_rows(rows, xp, in, packed.data_ptr<at::BFloat16>(), bias_ptr, yp, out_features);
  } else {
    dispatch_rows(rows, xp, in, packed.data_ptr<float>(), bias_ptr, yp, out_features);
  }
  return y;
}

int64_t few_rows_linear_block() { return block_width(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("few_rows_linear_pack(Tensor weight) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("few_rows_linear_block() -> int");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("few_rows_linear_pack", &few_rows_linear_pack);
  m.impl("few_rows_linear", &few_rows_linear);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CompositeExplicitAutograd, m) {
  m.impl("few_rows_linear_block", &few_rows_linear_block);
}
