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
// all of them. Keys stream in tiles of kKeyTile (widened to float once per tile for 16-bit
// caches). Threads of torch's pool pull tasks, the heaviest (most keys x rows) first, from one
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
constexpr int64_t kKeyTile = 32;    // keys per online-softmax step (a multiple of kTile)

using PrefillLayout = AttentionGeometry;  // attention_args.h

struct Task {
  int64_t seq, kv_head, first, last;  // queries [first, last) of the sequence (0-based in chunk)
  int64_t cost;
};

// One thread's buffers, reused by its tasks.
struct PrefillScratch {
  std::vector<float> query, acc;          // [kQueryTile * group, head_size]
  std::vector<float> row_max, row_sum;    // [kQueryTile * group]
  std::vector<float> scores, partial;     // [kKeyTile], [head_size]
  std::vector<const float*> k, v;         // [kKeyTile] rows as floats
  std::vector<float> k_wide, v_wide;      // [kKeyTile, head_size] for 16-bit caches

  PrefillScratch(const PrefillLayout& l, bool widen)
      : query(kQueryTile * l.group * l.head_size),
        acc(kQueryTile * l.group * l.head_size),
        row_max(kQueryTile * l.group),
        row_sum(kQueryTile * l.group),
        scores(kKeyTile),
        partial(l.head_size),
        k(kKeyTile),
        v(kKeyTile),
        k_wide(widen ? kKeyTile * l.head_size : 0),
        v_wide(widen ? kKeyTile * l.head_size : 0) {}
};

// rows[t] = the cache row of key position k0 + t (t < n) for kv head `head`, as floats.
template <typename scalar_t>
void key_rows(const PrefillLayout& l, const scalar_t* base, const int32_t* blocks, int64_t k0,
              int64_t n, std::vector<const float*>& rows, std::vector<float>& wide) {
  const int64_t d = l.head_size;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = k0 + t;
    const scalar_t* row = base + blocks[pos / l.block_size] * l.c_block +
                          (pos % l.block_size) * l.c_slot;
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[t] = row;
    } else {
      float* w = wide.data() + t * d;
      for (int64_t i = 0; i < d; ++i) w[i] = static_cast<float>(row[i]);
      rows[t] = w;
    }
  }
}

template <typename scalar_t>
void prefill_task(const PrefillLayout& l, const Task& task, scalar_t* out, const scalar_t* query,
                  const scalar_t* cache, const int32_t* tables, int64_t q_start, int64_t context,
                  PrefillScratch& s) {
  const int64_t d = l.head_size, group = l.group;
  const int64_t tokens = task.last - task.first, rows = tokens * group;
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
  std::fill(s.acc.begin(), s.acc.begin() + rows * d, 0.f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.f);

  const int64_t first_pos = context + task.first, last_pos = context + task.last - 1;
  const int64_t k_end = last_pos + 1;  // causal: no key past the tile's last query
  const int64_t k_begin = l.window > 0 ? std::max<int64_t>(0, first_pos - l.window + 1) : 0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, k_end - k0);
    key_rows(l, k_base, blocks, k0, n, s.k, s.k_wide);
    key_rows(l, v_base, blocks, k0, n, s.v, s.v_wide);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / group;
      // the keys of this tile the row sees: [a, b) relative to k0
      const int64_t a = l.window > 0 ? std::max<int64_t>(0, pos - l.window + 1 - k0) : 0;
      const int64_t b = std::min(n, pos + 1 - k0);
      if (a >= b) continue;
      const float* q = s.query.data() + r * d;
      float* x = s.scores.data() + a;
      const int64_t m = b - a;
      int64_t j = 0;
      for (; j + kTile <= m; j += kTile) dot_tile(q, s.k.data() + a + j, d, x + j);
      for (; j < m; ++j) x[j] = dot(q, s.k[a + j], d);
      if (l.soft_cap > 0.f) soft_cap_logits(x, m, l.soft_cap);
      float tile_max = x[0];
      for (j = 1; j < m; ++j) tile_max = std::max(tile_max, x[j]);
      const float new_max = std::max(s.row_max[r], tile_max);
      const float correction = std::exp(s.row_max[r] - new_max);  // 0 on the row's first tile
      s.row_max[r] = new_max;
      const VecF shift(new_max);
      float sum = 0.f;
      j = 0;
      VecF vsum(0.f);
      for (; j + kLanes <= m; j += kLanes) {
        const VecF e = (VecF::loadu(x + j) - shift).exp();
        e.store(x + j);
        vsum = vsum + e;
      }
      sum = reduce_add(vsum);
      for (; j < m; ++j) {
        x[j] = std::exp(x[j] - new_max);
        sum += x[j];
      }
      s.row_sum[r] = s.row_sum[r] * correction + sum;
      weighted_sum(x, s.v.data() + a, m, d, s.partial.data());
      float* acc = s.acc.data() + r * d;
      const VecF c(correction);
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        (VecF::loadu(acc + i) * c + VecF::loadu(s.partial.data() + i)).store(acc + i);
      }
      for (; i < d; ++i) acc[i] = acc[i] * correction + s.partial[i];
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
