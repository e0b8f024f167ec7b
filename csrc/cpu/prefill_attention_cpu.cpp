// Paged prefill attention for the cpu backend, flash style: each prompt chunk's queries attend
// causally over the sequence's keys read in place from the paged cache (cached context from
// prefix caching or earlier chunks included), with an online softmax, so no [P, H, Q, L] score
// tensor, padding, gather or mask is ever built.
//
// Shapes (strides in elements; every tensor's last dim must be contiguous):
//   out             [num_tokens, num_heads, head_size]  written; dtype of query
//   query           [num_tokens, num_heads, head_size]  may be a strided view of the qkv output
//   kv_cache        [2, num_blocks, block_size, num_kv_heads, head_size]  this step's keys and
//                   values already written; same dtype as query (float32, bfloat16 or float16)
//   block_tables    [num_seqs, max_blocks] int32
//   query_start_loc [num_seqs + 1] int32   sequence i's queries are rows [start[i], start[i+1])
//   seq_lens        [num_seqs] int32       tokens of sequence i in the cache, queries included;
//                                          its context (tokens before the queries) is
//                                          seq_len - query_len, query j sits at context + j
//
// Masking: query at position p sees the keys at positions k <= p, and k > p - sliding_window when
// sliding_window > 0. Scores are scale * q.k, soft-capped (soft_cap * tanh(s / soft_cap)) when
// soft_cap > 0, then softmax in float32.
//
// Work split: a task is (sequence, kv head, tile of kQueryTile queries); its rows are the tile's
// tokens times the kv head's GQA group of query heads, so each K/V row read from the cache serves
// all of them. Keys stream in tiles of kKeyTile, read once per tile into float scratch (the keys
// transposed, [head_size, kKeyTile], so that scores come out kLanes keys per vector with no
// horizontal sums); kRowBlock rows at a time share every K and V vector load (register blocking:
// scores and the output update are small outer-product loops on accumulators held in
// registers). Threads of torch's pool pull tasks, the heaviest (most keys x rows) first, from one
// atomic counter: a long prompt's late tiles cost more than its early ones, so a static split
// would leave a thread idle. Every argument is checked before any task starts.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "attention_args.h"
#include "attention_vec.h"

namespace {

constexpr int64_t kQueryTile = 16;  // query tokens per task
constexpr int64_t kKeyTile = 32;    // keys per online-softmax step
static_assert(kKeyTile % kBlockKeys == 0, "a key tile is whole key sub-blocks");

using PrefillLayout = AttentionGeometry;  // attention_args.h

struct Task {
  int64_t seq, kv_head, first, last;  // queries [first, last) of the sequence (0-based in chunk)
  int64_t cost;
};

// One thread's buffers, reused by its tasks. Rows are padded to whole row blocks: the padding
// rows have zero queries and their outputs are never written back.
struct PrefillScratch {
  int64_t padded_rows;
  std::vector<float> query, acc;          // [padded_rows, head_size]: scale * q; output sums
  std::vector<float> row_max, row_sum;    // [padded_rows]
  std::vector<float> correction;          // [padded_rows]: this tile's exp(old max - new max)
  std::vector<float> scores;              // [padded_rows, kKeyTile]: scores, then exp(s - max)
  std::vector<float> k_t;                 // [head_size, kKeyTile]: the key tile, transposed
  std::vector<const float*> v;            // [kKeyTile] value rows as floats
  std::vector<float> v_wide;              // [kKeyTile, head_size] for 16-bit caches

  PrefillScratch(const PrefillLayout& l, bool widen)
      : padded_rows((kQueryTile * l.group + kRowBlock - 1) / kRowBlock * kRowBlock),
        query(padded_rows * l.head_size),
        acc(padded_rows * l.head_size),
        row_max(padded_rows),
        row_sum(padded_rows),
        correction(padded_rows),
        scores(padded_rows * kKeyTile),
        k_t(l.head_size * kKeyTile),
        v(kKeyTile),
        v_wide(widen ? kKeyTile * l.head_size : 0) {}
};

inline const void* cache_row(const PrefillLayout& l, const void* base, size_t elem,
                             const int32_t* blocks, int64_t pos) {
  return static_cast<const char*>(base) +
         elem * (blocks[pos / l.block_size] * l.c_block + (pos % l.block_size) * l.c_slot);
}

// k_t[i, t] = key t of the tile (position k0 + t) at dim i, as floats; keys t >= n are 0.
template <typename scalar_t>
void transposed_keys(const PrefillLayout& l, const scalar_t* base, const int32_t* blocks,
                     int64_t k0, int64_t n, float* k_t) {
  const int64_t d = l.head_size;
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* row = static_cast<const scalar_t*>(
        cache_row(l, base, sizeof(scalar_t), blocks, k0 + t));
    for (int64_t i = 0; i < d; ++i) k_t[i * kKeyTile + t] = static_cast<float>(row[i]);
  }
  for (int64_t i = 0; i < d; ++i) {
    std::fill(k_t + i * kKeyTile + n, k_t + (i + 1) * kKeyTile, 0.f);
  }
}

// rows[t] = the value row of position k0 + t (t < n), as floats (16-bit rows widened).
template <typename scalar_t>
void value_rows(const PrefillLayout& l, const scalar_t* base, const int32_t* blocks, int64_t k0,
                int64_t n, std::vector<const float*>& rows, std::vector<float>& wide) {
  const int64_t d = l.head_size;
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* row = static_cast<const scalar_t*>(
        cache_row(l, base, sizeof(scalar_t), blocks, k0 + t));
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[t] = row;
    } else {
      float* w = wide.data() + t * d;
      for (int64_t i = 0; i < d; ++i) w[i] = static_cast<float>(row[i]);
      rows[t] = w;
    }
  }
}

// Turns row r's scores over the tile into exp(score - running max), keys outside [a, b) (not
// visible to the row) into 0, and updates its running max and sum; correction[r] is the factor
// its earlier sums must be scaled by. A row that sees no key of the tile gets p = 0, factor 1.
inline void online_softmax_row(float* x, int64_t a, int64_t b, float soft_cap, float& row_max,
                               float& row_sum, float& correction) {
  if (a >= b) {
    std::fill(x, x + kKeyTile, 0.f);
    correction = 1.f;
    return;
  }
  if (soft_cap > 0.f) soft_cap_logits(x + a, b - a, soft_cap);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(x, x + a, neg_inf);
  std::fill(x + b, x + kKeyTile, neg_inf);
  VecF vmax = VecF::loadu(x);
  for (int64_t j = kLanes; j < kKeyTile; j += kLanes) {
    vmax = at::vec::maximum(vmax, VecF::loadu(x + j));
  }
  const float new_max = std::max(row_max, at::vec::vec_reduce_all<float>(
      [](VecF& u, VecF& w) { return at::vec::maximum(u, w); }, vmax));
  correction = std::exp(row_max - new_max);  // 0 on the row's first tile (max was -inf)
  row_max = new_max;
  const VecF shift(new_max);
  VecF vsum(0.f);
  // exp_u20: ATen's polynomial exp (<= 20 ulp; 0 below ln(FLT_MIN), so 0 for the hidden keys)
  for (int64_t j = 0; j < kKeyTile; j += kLanes) {
    const VecF e = (VecF::loadu(x + j) - shift).exp_u20();
    e.store(x + j);
    vsum = vsum + e;
  }
  row_sum = row_sum * correction + reduce_add(vsum);
}

template <typename scalar_t>
void prefill_task(const PrefillLayout& l, const Task& task, scalar_t* out, const scalar_t* query,
                  const scalar_t* cache, const int32_t* tables, int64_t q_start, int64_t context,
                  PrefillScratch& s) {
  const int64_t d = l.head_size, group = l.group;
  const int64_t tokens = task.last - task.first, rows = tokens * group;
  const int64_t padded = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int32_t* blocks = tables + task.seq * l.table_stride;
  const scalar_t* k_base = cache + task.kv_head * l.c_head;
  const scalar_t* v_base = k_base + l.c_kv;
  // row r = token task.first + r / group, query head kv_head * group + r % group
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* q = query + (q_start + task.first + r / group) * l.q_tok +
                        (task.kv_head * group + r % group) * l.q_head;
    float* qs = s.query.data() + r * d;
    for (int64_t i = 0; i < d; ++i) qs[i] = static_cast<float>(q[i]) * l.scale;
  }
  std::fill(s.query.begin() + rows * d, s.query.begin() + padded * d, 0.f);
  std::fill(s.acc.begin(), s.acc.begin() + padded * d, 0.f);
  std::fill(s.row_max.begin(), s.row_max.begin() + padded,
            -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.begin() + padded, 0.f);

  const int64_t first_pos = context + task.first, last_pos = context + task.last - 1;
  const int64_t k_end = last_pos + 1;  // causal: no key past the tile's last query
  const int64_t k_begin = l.window > 0 ? std::max<int64_t>(0, first_pos - l.window + 1) : 0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, k_end - k0);
    // keys scored: whole score_block steps
    const int64_t m = (n + kBlockKeys - 1) / kBlockKeys * kBlockKeys;
    transposed_keys(l, k_base, blocks, k0, n, s.k_t.data());
    value_rows(l, v_base, blocks, k0, n, s.v, s.v_wide);
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      score_block(s.query.data() + r0 * d, d, s.k_t.data(), kKeyTile, m,
                  s.scores.data() + r0 * kKeyTile, kKeyTile);
    }
    for (int64_t r = 0; r < padded; ++r) {
      // the keys of this tile the row sees: [a, b) relative to k0 (none for padding rows)
      const int64_t pos = first_pos + r / group;
      const int64_t a = l.window > 0 ? std::max<int64_t>(0, pos - l.window + 1 - k0) : 0;
      const int64_t b = r < rows ? std::min(n, pos + 1 - k0) : 0;
      online_softmax_row(s.scores.data() + r * kKeyTile, a, b, l.soft_cap, s.row_max[r],
                         s.row_sum[r], s.correction[r]);
    }
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      accumulate_block(s.scores.data() + r0 * kKeyTile, kKeyTile, s.v.data(), n, d,
                       s.correction.data() + r0, s.acc.data() + r0 * d);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* o = out + (q_start + task.first + r / group) * l.o_tok +
                  (task.kv_head * group + r % group) * l.o_head;
    const float inv = 1.f / s.row_sum[r];  // > 0: every query sees its own key
    const float* acc = s.acc.data() + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<scalar_t>(acc[i] * inv);
  }
}

template <typename scalar_t>
void run_prefill(const PrefillLayout& l, const std::vector<Task>& tasks, at::Tensor& out,
                 const at::Tensor& query, const at::Tensor& kv_cache,
                 const at::Tensor& block_tables, const std::vector<int64_t>& q_starts,
                 const std::vector<int64_t>& contexts) {
  scalar_t* out_p = out.data_ptr<scalar_t>();
  const scalar_t* q_p = query.const_data_ptr<scalar_t>();
  const scalar_t* c_p = kv_cache.const_data_ptr<scalar_t>();
  const int32_t* t_p = block_tables.const_data_ptr<int32_t>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    PrefillScratch scratch(l, !std::is_same_v<scalar_t, float>);
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& task = tasks[i];
      prefill_task<scalar_t>(l, task, out_p, q_p, c_p, t_p, q_starts[task.seq],
                             contexts[task.seq], scratch);
    }
  });
}

// What attention_args.h leaves to each kernel: the query offsets and lengths per sequence.
void check_prefill_args(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens) {
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1,
              "seq_lens must be int32 [num_seqs], got ", seq_lens.scalar_type(), " ",
              seq_lens.sizes());
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == num_seqs + 1,
              "query_start_loc must be int32 [num_seqs + 1 = ", num_seqs + 1, "], got ",
              query_start_loc.scalar_type(), " ", query_start_loc.sizes());
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must be int32 [num_seqs=",
              num_seqs, ", max_blocks], got ", block_tables.sizes());
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                             double soft_cap) {
  const PrefillLayout l = check_attention_args(
      "paged_attention_prefill", out, query, kv_cache, block_tables, scale, sliding_window,
      soft_cap, {&query_start_loc, &seq_lens});
  check_prefill_args(block_tables, query_start_loc, seq_lens);

  const auto starts = query_start_loc.accessor<int32_t, 1>();
  const auto lens = seq_lens.accessor<int32_t, 1>();
  const auto tables = block_tables.accessor<int32_t, 2>();
  const int64_t num_seqs = seq_lens.size(0), num_blocks = kv_cache.size(1);
  const int64_t max_len = block_tables.size(1) * l.block_size;
  TORCH_CHECK(num_seqs == 0 || (starts[0] == 0 && starts[num_seqs] == query.size(0)),
              "query_start_loc must run from 0 to num_tokens=", query.size(0), ", got ",
              num_seqs ? starts[0] : 0, " .. ", num_seqs ? starts[num_seqs] : 0);
  std::vector<int64_t> q_starts(num_seqs), contexts(num_seqs);
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i], len = lens[i];
    TORCH_CHECK(q_len >= 0 && len >= q_len && len <= max_len, "sequence ", i, ": ", q_len,
                " queries and seq_len ", len, " must satisfy 0 <= queries <= seq_len <= "
                "max_blocks * block_size = ", max_len);
    for (int64_t j = 0; j < (len + l.block_size - 1) / l.block_size; ++j) {
      TORCH_CHECK(tables[i][j] >= 0 && tables[i][j] < num_blocks, "block_tables[", i, "][", j,
                  "]=", tables[i][j], " is outside the cache's blocks [0, ", num_blocks, ")");
    }
    q_starts[i] = starts[i];
    contexts[i] = len - q_len;
    for (int64_t f = 0; f < q_len; f += kQueryTile) {
      const int64_t last = std::min(q_len, f + kQueryTile);
      const int64_t k_end = contexts[i] + last;
      const int64_t k_begin =
          l.window > 0 ? std::max<int64_t>(0, contexts[i] + f - l.window + 1) : 0;
      for (int64_t h = 0; h < l.num_kv_heads; ++h) {
        tasks.push_back({i, h, f, last, (k_end - k_begin) * (last - f)});
      }
    }
  }
  if (tasks.empty() || l.head_size == 0) return;
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  switch (query.scalar_type()) {
    case at::kFloat:
      return run_prefill<float>(l, tasks, out, query, kv_cache, block_tables, q_starts, contexts);
    case at::kBFloat16:
      return run_prefill<c10::BFloat16>(l, tasks, out, query, kv_cache, block_tables, q_starts,
                                        contexts);
    default:  // float16: check_attention_args allows nothing else
      return run_prefill<c10::Half>(l, tasks, out, query, kv_cache, block_tables, q_starts,
                                    contexts);
  }
}

}  // namespace

// torch.ops.pagedllm_cpu.paged_attention_prefill (the namespace is defined by
// paged_attention_cpu.cpp in the same library).
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor kv_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
        "int sliding_window=0, float soft_cap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention_prefill", &paged_attention_prefill);
}
