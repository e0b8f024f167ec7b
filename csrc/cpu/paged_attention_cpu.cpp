// Paged decode attention for the cpu backend: one query token per sequence attends over that
// sequence's KV blocks, read in place through its block table (no gather into a padded tensor).
//
// Shapes (strides in elements; every tensor's last dim must be contiguous):
//   out          [num_seqs, num_heads, head_size]   written; dtype of query
//   query        [num_seqs, num_heads, head_size]   may be a strided view (e.g. of the qkv output)
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_size]   K = [0], V = [1]; same
//                dtype as query (float32, bfloat16 or float16)
//   block_tables [num_seqs, max_blocks] int32       row i: the blocks of sequence i, in order
//   seq_lens     [num_seqs] int32                   tokens of sequence i in the cache, >= 1
//
// Work split: a task is one sequence and a run of its kv heads (all of them unless there are too
// few sequences to keep every thread busy). Query head h reads kv head h / group, so a task owns
// whole GQA groups and reads each K/V row once for all the query heads of its group; with all kv
// heads in one task, a slot's K (and V) rows are one contiguous span. Tasks run on torch's
// intra-op pool (at::parallel_for), so torch.set_num_threads applies.
//
// Math: out = softmax(scale * q K^T) V in float32, the row max subtracted before exp (as SDPA);
// optionally over the last `sliding_window` tokens only, and with the scaled scores soft-capped
// (soft_cap * tanh(score / soft_cap)) before the softmax.
// Every argument is checked before any task starts, so bad block ids or lengths raise instead of
// reading outside the cache.
//
// Vectors: at::vec::Vectorized<float> (AVX2 when built with -DCPU_CAPABILITY_AVX2 -mavx2 -mfma,
// ATen's generic 8-lane version otherwise) plus one AVX2 intrinsic helper, lane_sums.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_args.h"
#include "attention_vec.h"

namespace {

// ---------------------------------------------------------------------------------------------
// the kernel
// ---------------------------------------------------------------------------------------------

// The shared geometry (attention_args.h; a "token" is a sequence here) and the work split.
struct Layout : AttentionGeometry {
  int64_t num_seqs;
  int64_t kv_heads_per_task;  // the last task of a sequence may get fewer
};

// One thread's buffers, sized for the longest sequence and reused by its tasks. A task's "rows"
// are its query heads: (kv heads of the task) * group of them.
struct Scratch {
  std::vector<float> query;      // [rows, head_size]: scale * the query rows, as floats
  std::vector<float> logits;     // [rows, max_len]: scores, then exp(score - max)
  std::vector<float> ones;       // [kRowBlock]: accumulate_block's correction factors (none)
  std::vector<int64_t> slots;    // [max_len]: token t's slot, as an offset into K (or V)
  std::vector<const float*> kv;  // [max_len]: K or V rows of one kv head, as floats
  std::vector<float> widened;    // [max_len, head_size]: those rows widened from 16 bits

  Scratch(const Layout& l, int64_t max_len, bool widen)
      : query(l.kv_heads_per_task * l.group * l.head_size),
        logits(l.kv_heads_per_task * l.group * max_len),
        ones(kRowBlock, 1.f),
        slots(max_len),
        kv(max_len),
        widened(widen ? max_len * l.head_size : 0) {}
};

// Points s.kv[t] at the row `base` + s.slots[t] as floats, for t in [t0, t1) of the task's n
// tokens: float rows in place, 16-bit rows widened into s.widened.
// The rows are scattered over the cache's blocks (and far beyond the caches at large batches), so
// the row kPrefetchAhead tokens on is prefetched while this one is read: a decode step is bound
// by these loads' latency otherwise.
constexpr int64_t kPrefetchAhead = 16;

template <typename scalar_t>
void rows_as_float(const scalar_t* base, int64_t t0, int64_t t1, int64_t n, int64_t d,
                   Scratch& s) {
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetchAhead < n) {
      const char* ahead = reinterpret_cast<const char*>(base + s.slots[t + kPrefetchAhead]);
      for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
        __builtin_prefetch(ahead + b, 0, 3);
      }
    }
    if constexpr (std::is_same_v<scalar_t, float>) {
      s.kv[t] = base + s.slots[t];
    } else {
      float* row = s.widened.data() + t * d;
      for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(base[s.slots[t] + i]);
      s.kv[t] = row;
    }
  }
}

// One task: kv heads [h0, h0 + nh) of sequence `seq` (`len` tokens, blocks `blocks`), i.e.
// query heads [h0 * group, (h0 + nh) * group); row r of the task is query head h0 * group + r.
// With a sliding window only the last min(len, window) tokens are read: below, token t of the
// task is the sequence's token first + t.
// kHeadSize > 0 fixes head_size at compile time, so the inlined row loops unroll.
template <typename scalar_t, int64_t kHeadSize>
void decode_task(const Layout& l, scalar_t* out, const scalar_t* query, const scalar_t* cache,
                 const int32_t* blocks, int64_t len, int64_t seq, int64_t h0, int64_t nh,
                 Scratch& s) {
  const int64_t d = kHeadSize > 0 ? kHeadSize : l.head_size;
  const int64_t group = l.group, rows = nh * group;
  const scalar_t* k_base = cache + h0 * l.c_head;  // kv head h0 of slot 0 of block 0
  const scalar_t* v_base = k_base + l.c_kv;
  const int64_t first = l.window > 0 ? std::max<int64_t>(0, len - l.window) : 0;
  len -= first;  // from here on: the tokens the query sees
  for (int64_t t = 0; t < len; ++t) {
    const int64_t pos = first + t;
    s.slots[t] = blocks[pos / l.block_size] * l.c_block + (pos % l.block_size) * l.c_slot;
  }

  const scalar_t* q_rows = query + seq * l.q_tok + h0 * group * l.q_head;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < d; ++i) {
      s.query[r * d + i] = static_cast<float>(q_rows[r * l.q_head + i]) * l.scale;
    }
  }

  // scores: logits[r, t] = (scale * q_r) . k_t, for kTile tokens at a time and all the task's
  // kv heads, so that the cache is read slot after slot (one contiguous span per slot when the
  // task has all kv heads)
  float* logits = s.logits.data();
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int64_t t1 = std::min(t0 + kTile, len);
    for (int64_t h = 0; h < nh; ++h) {
      rows_as_float(k_base + h * l.c_head, t0, t1, len, d, s);
      const float* const* k = s.kv.data() + t0;
      for (int64_t r = h * group; r < (h + 1) * group; ++r) {
        const float* q = s.query.data() + r * d;
        float* x = logits + r * len + t0;
        if (t1 - t0 == kTile) {
          dot_tile(q, k, d, x);
        } else {
          for (int64_t j = 0; j < t1 - t0; ++j) x[j] = dot(q, k[j], d);
        }
      }
    }
  }

  // out_r = sum_t exp(logit[r, t] - max) * v_t / sum_t exp(logit[r, t] - max)
  scalar_t* out_rows = out + seq * l.o_tok + h0 * group * l.o_head;
  float* acc = s.query.data();  // the scaled query rows are not needed any more
  for (int64_t h = 0; h < nh; ++h) {
    rows_as_float(v_base + h * l.c_head, 0, len, len, d, s);
    // blocks of up to kRowBlock rows of this kv head share every V vector load; a lone row
    // takes weighted_sum (all of its head dims in registers in one pass)
    for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += kRowBlock) {
      const int64_t n_rows = std::min(kRowBlock, (h + 1) * group - r0);
      float inv_sum[kRowBlock];
      for (int64_t r = 0; r < n_rows; ++r) {
        float* p = logits + (r0 + r) * len;
        if (l.soft_cap > 0.f) soft_cap_logits(p, len, l.soft_cap);
        inv_sum[r] = 1.f / softmax_numerators(p, len);
      }
      const float* p = logits + r0 * len;
      if (n_rows == 1) {
        weighted_sum(p, s.kv.data(), len, d, acc);
      } else {
        std::fill(acc, acc + n_rows * d, 0.f);
        const float* ones = s.ones.data();
        if (n_rows == 4) accumulate_block<4>(p, len, s.kv.data(), len, d, ones, acc);
        if (n_rows == 3) accumulate_block<3>(p, len, s.kv.data(), len, d, ones, acc);
        if (n_rows == 2) accumulate_block<2>(p, len, s.kv.data(), len, d, ones, acc);
      }
      for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t i = 0; i < d; ++i) {
          out_rows[(r0 + r) * l.o_head + i] = static_cast<scalar_t>(acc[r * d + i] * inv_sum[r]);
        }
      }
    }
  }
}

// Every task of the batch, split over torch's intra-op threads. Task i covers sequence
// i / tasks_per_seq, kv heads from (i % tasks_per_seq) * kv_heads_per_task on.
template <typename scalar_t, int64_t kHeadSize>
void run_tasks(const Layout& l, scalar_t* out, const scalar_t* query, const scalar_t* cache,
               const int32_t* tables, const int32_t* lens, int64_t lens_stride,
               int64_t max_len) {
  const int64_t per_task = l.kv_heads_per_task;
  const int64_t tasks_per_seq = (l.num_kv_heads + per_task - 1) / per_task;
  at::parallel_for(0, l.num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(l, max_len, !std::is_same_v<scalar_t, float>);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, h0 = (task % tasks_per_seq) * per_task;
      decode_task<scalar_t, kHeadSize>(l, out, query, cache, tables + seq * l.table_stride,
                                       lens[seq * lens_stride], seq, h0,
                                       std::min(per_task, l.num_kv_heads - h0), scratch);
    }
  });
}

// The common head sizes get an unrolled instantiation each; others run the generic one.
template <typename scalar_t>
void run_for_head_size(const Layout& l, at::Tensor& out, const at::Tensor& query,
                       const at::Tensor& kv_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, int64_t max_len) {
  auto run = [&](auto head_size) {
    run_tasks<scalar_t, decltype(head_size)::value>(
        l, out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
        kv_cache.const_data_ptr<scalar_t>(), block_tables.const_data_ptr<int32_t>(),
        seq_lens.const_data_ptr<int32_t>(), seq_lens.stride(0), max_len);
  };
  switch (l.head_size) {
    case 64: return run(std::integral_constant<int64_t, 64>());
    case 128: return run(std::integral_constant<int64_t, 128>());
    default: return run(std::integral_constant<int64_t, 0>());
  }
}

// KV heads per task: all of them, halved while there would be fewer than two tasks per thread.
int64_t kv_heads_per_task(int64_t num_seqs, int64_t num_kv_heads) {
  const int64_t wanted_tasks = 2 * static_cast<int64_t>(at::get_num_threads());
  int64_t per_task = num_kv_heads;
  while (per_task > 1 && num_seqs * ((num_kv_heads + per_task - 1) / per_task) < wanted_tasks) {
    per_task = (per_task + 1) / 2;
  }
  return per_task;
}

// ---------------------------------------------------------------------------------------------
// argument checks (all before any task runs) and the entry point
// ---------------------------------------------------------------------------------------------

// What attention_args.h leaves to each kernel: one block-table row and one length per sequence.
void check_decode_args(const at::Tensor& query, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens) {
  const int64_t num_seqs = query.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must be int32 [num_seqs=",
              num_seqs, ", max_blocks], got ", block_tables.scalar_type(), " ",
              block_tables.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == num_seqs,
              "seq_lens must be int32 [num_seqs=", num_seqs, "], got ", seq_lens.scalar_type(),
              " ", seq_lens.sizes());
}

// Every length in [1, max_blocks * block_size], every block id it uses in [0, num_blocks).
// Returns the longest length.
int64_t check_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     int64_t num_blocks, int64_t block_size) {
  const auto tables = block_tables.accessor<int32_t, 2>();
  const auto lens = seq_lens.accessor<int32_t, 1>();
  const int64_t max_blocks = block_tables.size(1);
  int64_t max_len = 0;
  for (int64_t i = 0; i < lens.size(0); ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "seq_lens[", i, "]=", len,
                " must be in [1, max_blocks * block_size = ", max_blocks * block_size, "]");
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j) {
      const int64_t block = tables[i][j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", i, "][", j, "]=", block,
                  " is outside the cache's blocks [0, ", num_blocks, ")");
    }
    max_len = std::max(max_len, len);
  }
  return max_len;
}

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, double soft_cap) {
  Layout l;
  static_cast<AttentionGeometry&>(l) = check_attention_args(
      "paged_attention_decode", out, query, kv_cache, block_tables, scale, sliding_window,
      soft_cap, {&seq_lens});
  check_decode_args(query, block_tables, seq_lens);
  l.num_seqs = query.size(0);
  l.kv_heads_per_task = kv_heads_per_task(l.num_seqs, l.num_kv_heads);
  const int64_t max_len = check_tables(block_tables, seq_lens, kv_cache.size(1), l.block_size);
  if (l.num_seqs == 0 || l.num_heads == 0 || l.head_size == 0) return;

  switch (query.scalar_type()) {
    case at::kFloat:
      return run_for_head_size<float>(l, out, query, kv_cache, block_tables, seq_lens, max_len);
    case at::kBFloat16:
      return run_for_head_size<c10::BFloat16>(l, out, query, kv_cache, block_tables, seq_lens,
                                              max_len);
    default:  // float16: check_attention_args allows nothing else
      return run_for_head_size<c10::Half>(l, out, query, kv_cache, block_tables, seq_lens,
                                          max_len);
  }
}

}  // namespace

// torch.ops.pagedllm_cpu.paged_attention_decode. Registered with the dispatcher instead of a
// pybind11 module: torch/library.h compiles in a third of the time of torch/extension.h.
TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window=0, "
        "float soft_cap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
}
