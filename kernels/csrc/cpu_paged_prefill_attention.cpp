// Causal prefill attention on the CPU over the paged KV cache, in place.
//
// The same contract as `prefill_attention_ref` (kernels/reference.py): each request's query
// chunk (tokens [query_start_loc[r], query_start_loc[r + 1]) of `query`) sits at the end of
// its context of seq_lens[r] tokens, whose K/V (earlier chunks, prefix-cache hits, and the
// chunk's own, already written) are read through the block table; query i of Q sees positions
// 0 .. L - Q + i. The reference gathers each request's context and calls torch's flash
// attention, which ran at 44-82 GFLOP/s here (an AMD EPYC, 2 threads, float32).
//
// A task is one (request, KV head, one to four tiles of tokens). A tile's vector lanes (16
// with AVX-512, 8 with AVX2) are its rows, (token, query head) pairs of the query heads
// sharing that KV head (GQA), so every score, the online softmax and the weighted values are
// lane-wise: for each chunk of as many keys as lanes,
//
//     S[t]   = sum_d qT[d] * k[t][d]                     (a vector of rows per key t)
//     P[t]   = exp(S[t] - m_new), 0 where key t is in a row's future
//     accT[d] = accT[d] * exp(m - m_new) + sum_t P[t] * v[t][d]
//
// with k[t][d] and v[t][d] broadcast from a float32 copy of the chunk's rows, gathered
// through the block table (so any block size works): no transposed copies of K, no
// reductions across lanes. The next chunk's rows are prefetched into L2 meanwhile (their
// blocks lie anywhere in the cache). The queries are transposed once per task (qT [D][lanes] per
// tile) and the results once at the end; a task stops at its last row's position. Threads
// take tasks from a shared counter, heaviest (request, KV head) first and its tiles one
// after another, so a long request starts early, one request's K/V of a head stays in cache
// while its tiles go by, and a preempted thread leaves its work to the other.
//
// Head sizes 64, 128 and 256 with up to a vector's lanes of query heads per KV head; ops.py
// keeps the reference for the rest, and for builds with neither AVX-512 nor AVX2 and FMA
// (cpu_ops.prefill_attention_supported).
// Built on first use by kernels/cpu_ops.py, joining the baton_cpu library.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "op_library.h"
#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define BATON_PREFILL_KERNEL 1
#endif

namespace {

#include "prefill_attention_vectors.h"

#if defined(BATON_PREFILL_KERNEL)

struct Task {
  int32_t request, kv_head, first_token, num_tokens, num_keys;  // tokens within the request's chunk
};

struct Problem {
  const void* query;  // [T, H, D]
  const void* key_cache;  // [num_blocks, block_size, H_kv, D]
  const void* value_cache;
  const int32_t* block_tables;  // [R, max_blocks]
  const int32_t* query_start_loc;  // [R + 1]
  const int32_t* seq_lens;  // [R]
  void* out;  // [T, H, D]
  int64_t num_heads, num_kv_heads, group, block_size, max_blocks;
  int64_t q_token_stride, q_head_stride;  // query's strides (elements)
  float scale;
};

// One cache row as float32. float32 rows are copied a vector at a time in place: GCC turns
// the element loop into a call of memmove per row, and the calls took a quarter of the
// kernel's time at head size 64 (an AVX2 EPYC).
template <typename scalar_t, int D>
inline void row_to_float(const baton_cpu::raw_t<scalar_t>* src, float* dst) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int d = 0; d < D; d += kLanes) vstore(dst + d, vloadu(src + d));
  } else {
    for (int d = 0; d < D; ++d) dst[d] = baton_cpu::to_float<scalar_t>(src[d]);
  }
}

// The chunk's scores for keys k0 .. k0 + kLanes / NT: sbuf[i][k][lanes] = qT[i] . key k, a
// vector of kLanes rows per tile and key. This and weighted_values are functions of their
// own, apart from the task's loop: inlined there, their loops' register allocation changed
// with unrelated edits around them (the kernel took 1.25x as long after one such edit).
template <int D, int NT>
__attribute__((noinline)) void scores(const float* qT, const float* kbuf, float* sbuf, int k0) {
  constexpr int kKeysPerPass = kLanes / NT;  // NT * kKeysPerPass accumulators
  vfloat s[NT][kKeysPerPass];
  for (int i = 0; i < NT; ++i)
    for (int t = 0; t < kKeysPerPass; ++t) s[i][t] = vzero();
  for (int d = 0; d < D; ++d) {
    vfloat qd[NT];
    for (int i = 0; i < NT; ++i) {
      qd[i] = vload(qT + (i * D + d) * kLanes);
      in_register(qd[i]);
    }
    for (int t = 0; t < kKeysPerPass; ++t) {
      const vfloat k = vset(kbuf[(k0 + t) * D + d]);
      for (int i = 0; i < NT; ++i) s[i][t] = vfma(qd[i], k, s[i][t]);
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int t = 0; t < kKeysPerPass; ++t) vstore(sbuf + (i * kLanes + k0 + t) * kLanes, s[i][t]);
}

// accT[i] = accT[i] * correction[i] + sum_t P[i][t] * v[t], kColumns / NT output columns of
// each tile at a time (NT * that many accumulators).
template <int D, int NT>
__attribute__((noinline)) void weighted_values(const float* sbuf, const float* vbuf, const vfloat* correction,
                                               float* accT) {
  constexpr int kColumnsPerTile = kColumns / NT;
  for (int d0 = 0; d0 < D; d0 += kColumnsPerTile) {
    vfloat acc[NT][kColumnsPerTile];
    for (int i = 0; i < NT; ++i)
      for (int j = 0; j < kColumnsPerTile; ++j) acc[i][j] = vload(accT + (i * D + d0 + j) * kLanes) * correction[i];
    for (int t = 0; t < kLanes; ++t) {
      vfloat pt[NT];
      for (int i = 0; i < NT; ++i) {
        pt[i] = vload(sbuf + (i * kLanes + t) * kLanes);
        in_register(pt[i]);
      }
      for (int j = 0; j < kColumnsPerTile; ++j) {
        const vfloat v = vset(vbuf[t * D + d0 + j]);
        for (int i = 0; i < NT; ++i) acc[i][j] = vfma(pt[i], v, acc[i][j]);
      }
    }
    for (int i = 0; i < NT; ++i)
      for (int j = 0; j < kColumnsPerTile; ++j) vstore(accT + (i * D + d0 + j) * kLanes, acc[i][j]);
  }
}

// One task's NT tiles of rows (NT = 1, 2 or 4) against one chunk of keys after another. The
// tiles share each gathered chunk and each broadcast key or value element, which divides the
// gathering and the broadcasts per FMA by NT; a chunk too short for four tiles takes two or
// one, so few lanes go to waste. kColumns / NT output columns per pass of the weighted-values
// loop (and kLanes / NT keys per pass of the score loop) keep enough independent
// accumulators to cover the FMA latency (one column at a time makes a chain as long as the
// chunk, each FMA waiting for the last: the kernel 8% slower on an AVX2 EPYC).
template <typename scalar_t, typename cache_t, int D, int NT>
void run_task(const Problem& p, const Task& task, float* scratch) {
  static_assert(D % kLanes == 0 && D % kColumns == 0 && kColumns % NT == 0 && kLanes % NT == 0,
                "rows are copied and summed in whole vectors");
  using raw = baton_cpu::raw_t<scalar_t>;
  using cache_raw = baton_cpu::raw_t<cache_t>;
  float* qT = scratch;                   // [NT][D][kLanes]
  float* accT = qT + NT * D * kLanes;    // [NT][D][kLanes]
  float* kbuf = accT + NT * D * kLanes;  // [kLanes][D]: one chunk's keys as float32
  float* vbuf = kbuf + kLanes * D;       // [kLanes][D]: and its values
  float* sbuf = vbuf + kLanes * D;       // [NT][kLanes keys][kLanes rows]: the chunk's scores
  const int64_t r = task.request, h = task.kv_head, G = p.group;
  const int64_t seq_len = p.seq_lens[r];
  const int64_t num_queries = p.query_start_loc[r + 1] - p.query_start_loc[r];
  const int64_t first_pos = seq_len - num_queries;  // the chunk's first query position
  const int32_t* table = p.block_tables + r * p.max_blocks;
  const raw* q = baton_cpu::raw(static_cast<const scalar_t*>(p.query));
  const cache_raw* kc = baton_cpu::raw(static_cast<const cache_t*>(p.key_cache));
  const cache_raw* vc = baton_cpu::raw(static_cast<const cache_t*>(p.value_cache));
  const int64_t row_stride = p.num_kv_heads * D, block_stride = p.block_size * row_stride;
  const int64_t tokens_per_tile = std::max<int64_t>(1, kLanes / G);

  // Tile i's lanes: (token i * tokens_per_tile + lane / G, head lane % G); lanes past the
  // tile's rows copy its first row's position and a zero query, so they stay finite (their
  // results are never written).
  int64_t rows[NT];
  vint positions[NT];
  for (int i = 0; i < NT; ++i) {
    const int64_t first_token = task.first_token + i * tokens_per_tile;
    rows[i] = std::clamp<int64_t>(task.num_tokens - i * tokens_per_tile, 0, tokens_per_tile) * G;
    alignas(64) int32_t qpos[kLanes];
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const bool real = lane < rows[i];
      const int64_t t = first_token + (real ? lane / G : 0);
      qpos[lane] = static_cast<int32_t>(first_pos + t);
      const raw* qrow =
          q + (p.query_start_loc[r] + t) * p.q_token_stride + (h * G + (real ? lane % G : 0)) * p.q_head_stride;
      for (int d = 0; d < D; ++d)
        qT[(i * D + d) * kLanes + lane] = real ? baton_cpu::to_float<scalar_t>(qrow[d]) * p.scale : 0.f;
    }
    positions[i] = vload_int(qpos);
  }
  for (int d = 0; d < NT * D; ++d) vstore(accT + d * kLanes, vzero());
  vfloat run_max[NT], run_sum[NT];
  for (int i = 0; i < NT; ++i) {
    run_max[i] = vset(-std::numeric_limits<float>::infinity());
    run_sum[i] = vzero();
  }

  for (int64_t p0 = 0; p0 < task.num_keys; p0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, task.num_keys - p0);
    // The chunk's keys and values, gathered through the block table as float32: the products
    // below broadcast them from one base address, where pointers into the cache cost a load of
    // the pointer per broadcast (16 pointers do not stay in registers: 1.3x slower, float32 and
    // bfloat16 alike).
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = p0 + t;
      const int64_t at = table[pos / p.block_size] * block_stride + (pos % p.block_size) * row_stride + h * D;
      row_to_float<cache_t, D>(kc + at, kbuf + t * D);
      row_to_float<cache_t, D>(vc + at, vbuf + t * D);
    }
    for (int64_t t = 0; t < std::min<int64_t>(kLanes, task.num_keys - p0 - kLanes); ++t) {
      const int64_t pos = p0 + kLanes + t;
      const int64_t at = table[pos / p.block_size] * block_stride + (pos % p.block_size) * row_stride + h * D;
      for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(cache_raw)); byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + at) + byte, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vc + at) + byte, _MM_HINT_T1);
      }
    }
    for (int64_t t = n; t < kLanes; ++t)  // masked below; zeros keep them finite
      for (int d = 0; d < D; ++d) kbuf[t * D + d] = vbuf[t * D + d] = 0.f;
    for (int k0 = 0; k0 < kLanes; k0 += kLanes / NT) scores<D, NT>(qT, kbuf, sbuf, k0);
    // online softmax, per tile: key p0 + t is visible to the rows whose position is at least p0 + t
    vfloat correction[NT];
    for (int i = 0; i < NT; ++i) {
      float* si = sbuf + i * kLanes * kLanes;
      vmask visible[kLanes];
      vfloat chunk_max = run_max[i];
      for (int t = 0; t < kLanes; ++t) {
        visible[t] = t < n ? at_least(positions[i], static_cast<int32_t>(p0 + t)) : no_lanes();
        chunk_max = max_where(visible[t], chunk_max, vload(si + t * kLanes));
      }
      correction[i] = vexp(run_max[i] - chunk_max);
      run_max[i] = chunk_max;
      vfloat sum = vzero();
      for (int t = 0; t < kLanes; ++t) {
        const vfloat e = zero_unless(visible[t], vexp(vload(si + t * kLanes) - chunk_max));
        vstore(si + t * kLanes, e);
        sum = sum + e;
      }
      run_sum[i] = vfma(run_sum[i], correction[i], sum);
    }
    weighted_values<D, NT>(sbuf, vbuf, correction, accT);
  }

  raw* out = baton_cpu::raw(static_cast<scalar_t*>(p.out));
  for (int i = 0; i < NT; ++i) {
    alignas(64) float inv[kLanes];
    vstore(inv, vset(1.f) / run_sum[i]);  // every row sees key 0: sum > 0
    for (int64_t lane = 0; lane < rows[i]; ++lane) {
      const int64_t t = task.first_token + i * tokens_per_tile + lane / G, g = lane % G;
      raw* orow = out + ((p.query_start_loc[r] + t) * p.num_heads + h * G + g) * D;
      for (int d = 0; d < D; ++d)
        orow[d] = baton_cpu::from_float<scalar_t>(accT[(i * D + d) * kLanes + lane] * inv[lane]);
    }
  }
}

template <typename scalar_t, typename cache_t, int D>
void prefill(const Problem& p, int64_t num_reqs) {
  // Tasks: every request's chunk in fours of tiles of kLanes / G tokens, per KV head;
  // heaviest first.
  const int64_t tokens_per_tile = std::max<int64_t>(1, kLanes / p.group), tokens_per_task = 4 * tokens_per_tile;
  std::vector<Task> tasks;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t num_queries = p.query_start_loc[r + 1] - p.query_start_loc[r];
    const int64_t first_pos = p.seq_lens[r] - num_queries;
    for (int64_t i = 0; i < num_queries; i += tokens_per_task) {
      const int64_t n = std::min(tokens_per_task, num_queries - i);
      for (int64_t h = 0; h < p.num_kv_heads; ++h)
        tasks.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h), static_cast<int32_t>(i),
                         static_cast<int32_t>(n), static_cast<int32_t>(first_pos + i + n)});
    }
  }
  // Heaviest (request, KV head) first, and its tiles one after another, heaviest first: the
  // threads then share one request's K/V of that head while it sits in cache. Tiles ordered
  // by keys alone, all requests interleaved, read every request's K/V from memory again for
  // each tile (32 requests of 112 queries over 1,024 keys: 48 GFLOP/s, against 85 with the
  // K/V in cache).
  // A group's heaviest tile sees its request's whole context, seq_lens[r] keys.
  const int32_t* seq_lens = p.seq_lens;
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    if (seq_lens[a.request] != seq_lens[b.request]) return seq_lens[a.request] > seq_lens[b.request];
    if (a.request != b.request) return a.request < b.request;
    if (a.kv_head != b.kv_head) return a.kv_head < b.kv_head;
    return a.num_keys > b.num_keys;
  });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(num_tasks, 1));
  baton::run_on_threads(num_threads, [&] {
    // On the thread's stack (168 KB at most), not thread_local: GCC reaches a thread_local
    // through a TLS call inside the inner loops, which spills every accumulator around it.
    alignas(64) float scratch[10 * D * kLanes + 4 * kLanes * kLanes];
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) {
      const int64_t tiles = (tasks[t].num_tokens + tokens_per_tile - 1) / tokens_per_tile;
      if (tiles > 2)
        run_task<scalar_t, cache_t, D, 4>(p, tasks[t], scratch);
      else if (tiles == 2)
        run_task<scalar_t, cache_t, D, 2>(p, tasks[t], scratch);
      else
        run_task<scalar_t, cache_t, D, 1>(p, tasks[t], scratch);
    }
  });
}

template <typename scalar_t, typename cache_t>
void prefill_head_size(const Problem& p, int64_t num_reqs, int64_t head_dim) {
  if (head_dim == 64)
    prefill<scalar_t, cache_t, 64>(p, num_reqs);
  else if (head_dim == 128)
    prefill<scalar_t, cache_t, 128>(p, num_reqs);
  else
    prefill<scalar_t, cache_t, 256>(p, num_reqs);
}
#endif  // BATON_PREFILL_KERNEL

// The most query heads per KV head the kernel takes (a tile's lanes); 0: no kernel in this build.
int64_t prefill_attention_max_group() {
#if defined(BATON_PREFILL_KERNEL)
  return kLanes;
#else
  return 0;
#endif
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [T, H, D], its last dim contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "key_cache, value_cache: contiguous [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "the key and value caches differ in dtype");
  // a float32 model may keep a bfloat16 cache (kv_cache_dtype "bfloat16")
  const bool bf16_cache = query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() || bf16_cache, "the caches must have the query's dtype (",
              query.scalar_type(), ") or, for a float32 query, bfloat16; got ", key_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables, query_start_loc, seq_lens: contiguous int32");
  const int64_t num_heads = query.size(1), D = query.size(2), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && num_heads % num_kv_heads == 0, "heads or head size do not match the cache");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.size(0) == num_reqs,
              "one block table and seq_len per request, query_start_loc one longer");
  at::Tensor out = at::empty(query.sizes(), query.options());
#if defined(BATON_PREFILL_KERNEL)
  const int64_t group = num_heads / num_kv_heads;
  TORCH_CHECK(group <= kLanes && (D == 64 || D == 128 || D == 256), "head size ", D, " or ", group,
              " query heads per KV head have no kernel (64/128/256, up to ", kLanes, ")");
  const Problem p{query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr<int32_t>(),
                  query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr(), num_heads,
                  num_kv_heads, group, key_cache.size(1), block_tables.size(1), query.stride(0), query.stride(1),
                  static_cast<float>(scale)};
  if (bf16_cache) {
    prefill_head_size<float, at::BFloat16>(p, num_reqs, D);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_prefill_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 has no kernel");
    } else {
      prefill_head_size<scalar_t, scalar_t>(p, num_reqs, D);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has no prefill attention kernel (neither AVX-512 nor AVX2 with FMA)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BATON_CPU_LIB, m) {
  m.def(
      "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor");
  m.def("prefill_attention_max_group() -> int", &prefill_attention_max_group);
}

TORCH_LIBRARY_IMPL(BATON_CPU_LIB, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
