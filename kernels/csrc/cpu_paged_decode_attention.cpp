// Paged decode attention on the CPU, reading the KV cache in place.
//
// One query token per request against its whole paged context, like the Triton kernel and
// the torch reference (kernels/reference.py), without gathering the context first. The query
// heads h * G .. h * G + G - 1 that share KV head h (GQA) take each block together, so each
// K/V row is loaded once for all of them. Threads take tasks from a shared counter, so
// requests of very different lengths still keep both cores busy. Blocks sit anywhere in the
// cache, where the hardware prefetcher does not follow, so the next block's rows are
// prefetched into L2 while this one is computed (NextRows). Each query head keeps an online
// softmax (running max, running sum, weighted values) in float32, whatever the cache dtype.
//
// Head sizes 64, 128 and 256 run a vector path (decode_attention_vector.h; GCC vector types
// as wide as the x86 vector registers: 16 lanes with AVX-512, 8 without): a task is a range of
// a request's KV heads, the block's dot products are reduced a vector's lanes at a time by a
// transposing tree of adds, and the softmax's exp is vec_math.h's. 16-lane vectors on AVX2
// ran as register pairs and spilled: 8 lanes there took 0.82 ms where they took 1.25 (12
// requests, context 280, cold cache; 2 threads). Other head sizes run a scalar loop over
// whole requests (decode_attention_scalar.h). bfloat16 queries on CPUs with AVX512-BF16
// multiply the cache's rows without widening them, a task per (request, KV head)
// (decode_attention_bf16.h).
//
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension) and registered as
// torch.ops.baton_cpu.paged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "op_library.h"
#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// One block of the online softmax for one query head: turns the block's n scores s into
// exp(s - new max) in place, folds their sum into run_sum and returns the factor that
// rescales what came before to the new running max.
inline float softmax_block(float* __restrict__ s, int64_t n, float& run_max, float& run_sum) {
  float new_max = run_max;
  for (int64_t t = 0; t < n; ++t) new_max = std::max(new_max, s[t]);
  const float correction = std::exp(run_max - new_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = baton_cpu::exp_approx(s[t] - new_max);
    sum += s[t];
  }
  run_max = new_max;
  run_sum = run_sum * correction + sum;
  return correction;
}

// One call's shapes and raw pointers, read by every path. The query and output are
// scalar_t, the cache cache_t: the same, or bfloat16 under a float32 model (a cache of half
// the bytes, kv_cache_dtype "bfloat16").
template <typename scalar_t, typename cache_t = scalar_t>
struct Decode {
  int64_t num_reqs, num_heads, head_dim, block_size, num_kv_heads, group, max_blocks;
  int64_t row_stride;    // one token's K (or V), every KV head
  int64_t block_stride;  // one block of K (or V)
  const scalar_t* q;
  const cache_t *k_cache, *v_cache;
  const int32_t *tables, *lens;
  scalar_t* out;
  float scale;

  Decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale_, at::Tensor& out_)
      : num_reqs(query.size(0)),
        num_heads(query.size(1)),
        head_dim(query.size(2)),
        block_size(key_cache.size(1)),
        num_kv_heads(key_cache.size(2)),
        group(num_heads / num_kv_heads),
        max_blocks(block_tables.size(1)),
        row_stride(num_kv_heads * head_dim),
        block_stride(block_size * row_stride),
        q(query.data_ptr<scalar_t>()),
        k_cache(key_cache.data_ptr<cache_t>()),
        v_cache(value_cache.data_ptr<cache_t>()),
        tables(block_tables.data_ptr<int32_t>()),
        lens(seq_lens.data_ptr<int32_t>()),
        out(out_.data_ptr<scalar_t>()),
        scale(static_cast<float>(scale_)) {}
};

#ifndef BATON_PREFETCH_LOCALITY
#define BATON_PREFETCH_LOCALITY 1
#endif

// The next block's rows of K (or V) for a task's KV heads, each row in `parts` slices of
// `slice` bytes. Each step() of the block's loops prefetches the next slice, one prefetch per
// 64 B line, into L2, so the next block arrives spread over this block's work and its lines
// are first touched in the order they sit in memory. The whole next block prefetched at once
// (64-128 lines of one KV head) filled the core's miss buffers, and the block's own loads
// waited behind them: spread a row at a time, the kernel took 0.81-0.91x the time over a
// float32 cache in memory (8-64 requests, Zen 3, 2 threads) and 0.70-0.74x over a bfloat16
// one (32-64 requests; 0.91-0.95x at 8, whose bfloat16 caches fit in L3). One prefetch per
// 128 B (line pairs) left the second line of a bfloat16 row of 64 to a demand miss (1.15x the
// time, Zen 3). Into L1 (BATON_PREFETCH_LOCALITY=3) makes no difference once spread
// (0.96-1.05x, Zen 3); with the whole block at once, float32 took 1.15-1.26x the time that way
// on Zen 4 (bench/decode_attention.py). The AVX512-BF16 path steps its prefetches the same
// way, not measured on a CPU that runs it.
struct NextRows {
  const char* row;  // the next slice's row
  int64_t rows, row_stride, parts, slice, part = 0;

  __attribute__((always_inline)) void step() {
    if (rows <= 0) return;
    for (int64_t off = 0; off < slice; off += 64)
      __builtin_prefetch(row + part * slice + off, 0, BATON_PREFETCH_LOCALITY);
    if (++part == parts) part = 0, row += row_stride, --rows;
  }
};

// The next block's K and V rows from its offset (plus a head offset), `rows` of them, in
// `parts` slices of `slice` bytes each.
template <typename scalar_t, typename cache_t>
inline std::pair<NextRows, NextRows> next_rows(const Decode<scalar_t, cache_t>& p, int64_t offset, int64_t rows,
                                               int64_t parts, int64_t slice) {
  const int64_t stride = p.row_stride * static_cast<int64_t>(sizeof(cache_t));
  return {NextRows{reinterpret_cast<const char*>(p.k_cache + offset), rows, stride, parts, slice},
          NextRows{reinterpret_cast<const char*>(p.v_cache + offset), rows, stride, parts, slice}};
}

// Walks request r's context a block at a time: visit(n, base, next_k, next_v) gets the
// block's token count, the offset of its first row plus `head_offset` (h * D for one KV head,
// 0 for all), and the next block's rows (`row_bytes` of each) to step through, a row a token
// (none after the last block). Always inlined, visitor and all: a call would spill the
// accumulators (every vector register is caller-saved), which took the kernel 1.3x its time.
template <typename scalar_t, typename cache_t, typename Visit>
__attribute__((always_inline)) inline void walk_blocks(const Decode<scalar_t, cache_t>& p, int64_t r,
                                                       int64_t head_offset, int64_t row_bytes, Visit&& visit) {
  const int32_t* table = p.tables + r * p.max_blocks;
  const int64_t len = p.lens[r], block_size = p.block_size;
  for (int64_t first = 0, blk = 0; first < len; first += block_size, ++blk) {
    const int64_t rows = std::clamp<int64_t>(len - first - block_size, 0, block_size);
    const int64_t next = rows ? static_cast<int64_t>(table[blk + 1]) * p.block_stride + head_offset : 0;
    auto [next_k, next_v] = next_rows(p, next, rows, 1, row_bytes);
    visit(std::min(block_size, len - first), static_cast<int64_t>(table[blk]) * p.block_stride + head_offset, next_k,
          next_v);
  }
}

// ---- the vector path ----

// AVX-512 has 32 vector registers of 16 floats, AVX2 16 of 8 (the fallback elsewhere).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat broadcast(float x) { return vfloat{} + x; }

// kLanes consecutive values of the cache's dtype, as float32: a bfloat16 is the top half of
// a float32's bits; float16 converts one value at a time (the compiler vectorizes it where
// the CPU has F16C).
template <typename scalar_t>
inline vfloat load_row(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    vfloat v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    typedef uint16_t vu16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
    vu16 raw;
    std::memcpy(&raw, p, sizeof(raw));
    vint bits = __builtin_convertvector(raw, vint) << 16;
    vfloat v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  } else {
    float tmp[kLanes];
    for (int i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
    vfloat v;
    std::memcpy(&v, tmp, sizeof(v));
    return v;
  }
}

// The lane sums of v[0..kLanes-1], as one vector: a transposing tree of adds (kLanes - 1
// adds for kLanes sums, where reducing each vector alone costs log2(kLanes) dependent
// shuffle-adds per sum).
#if defined(__AVX512F__)
inline vfloat sum_lanes(const vfloat* v) {
  vfloat l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)
    l1[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    l3[i] = __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline vfloat sum_lanes(const vfloat* v) {
  vfloat l1[4], l2[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: half sums of v[2i], 4-7: of v[2i + 1]
    l1[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // pairs of quarter sums of v[4i], v[4i + 2], v[4i + 1], v[4i + 3]
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(l2[0], l2[1], 0, 4, 2, 6, 8, 12, 10, 14) +
         __builtin_shufflevector(l2[0], l2[1], 1, 5, 3, 7, 9, 13, 11, 15);
}
#endif

// A block's scores from its dot products' partial sums: scores[c][t] = scale * the lane sum of
// dots[c][t], for C heads and n tokens (rows padded to `padded`, the padding zeroed first).
__attribute__((always_inline)) inline void block_scores(vfloat* dots, float* scores, int64_t C, int64_t n,
                                                        int64_t padded, float scale) {
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t t = n; t < padded; ++t) dots[c * padded + t] = vfloat{};
    for (int64_t t = 0; t < n; t += kLanes) {
      const vfloat sums = sum_lanes(dots + c * padded + t) * scale;
      std::memcpy(scores + c * padded + t, &sums, sizeof(sums));
    }
  }
}

// Query heads of one KV head a block takes together (larger GQA groups take several passes).
constexpr int64_t kMaxHeads = 8;

#include "decode_attention_vector.h"

#if defined(__AVX512BF16__)
#include "decode_attention_bf16.h"
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif


template <typename scalar_t, typename cache_t, int D>
void decode_vector(const Decode<scalar_t, cache_t>& p) {
  // The bfloat16 dot path's query heads per pass: their accumulators take half of AVX-512's
  // registers.
  constexpr int kChunk = std::max(1, 16 * kLanes / D);
  const int64_t group = p.group, num_kv_heads = p.num_kv_heads, num_heads = p.num_heads;
  const int threads = at::get_num_threads();
  // A task is a request's KV heads, split into as many ranges as give each thread about four
  // tasks, so a small batch still spreads over the cores and requests of very different
  // lengths still balance.
  const int64_t splits = std::clamp<int64_t>((4 * threads + p.num_reqs - 1) / p.num_reqs, 1, num_kv_heads);
  const int64_t num_tasks = p.num_reqs * splits;
  std::atomic<int64_t> next_task{0};

  baton::run_on_threads(threads, [&] {
    const int64_t padded = (p.block_size + kLanes - 1) / kLanes * kLanes;
    const int64_t pass = std::max<int64_t>(kChunk, kMaxHeads);
    std::vector<float> qf(num_heads * D), res(num_heads * D), acc(num_heads * D), run_max(num_heads),
        run_sum(num_heads), scores(pass * padded);
    std::vector<vfloat> dots(pass * padded);
    std::vector<uint16_t> probs(kChunk * padded);  // the bfloat16 dot path's weights
    for (int64_t task = next_task.fetch_add(1); task < num_tasks; task = next_task.fetch_add(1)) {
      const int64_t r = task / splits, split = task % splits;
      const int64_t h0 = split * num_kv_heads / splits, h1 = (split + 1) * num_kv_heads / splits;
      const int64_t heads = (h1 - h0) * group;
      const scalar_t* qr = p.q + (r * num_heads + h0 * group) * D;
      if constexpr (kBf16Dot && std::is_same_v<scalar_t, at::BFloat16>) {
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t g = 0; g < group; g += kChunk) {
            const int64_t c0 = (h - h0) * group + g;
            attend_chunk<scalar_t, cache_t, D, kChunk>(std::min<int64_t>(kChunk, group - g), qr + c0 * D, p, r, h,
                                                       dots.data(), scores.data(), probs.data(), res.data() + c0 * D);
          }
      } else {
        for (int64_t i = 0; i < heads * D; ++i) qf[i] = static_cast<float>(qr[i]) * p.scale;
        attend_range<scalar_t, cache_t, D>(qf.data(), p, r, h0, h1, dots.data(), scores.data(), acc.data(),
                                           run_max.data(), run_sum.data(), res.data());
      }
      scalar_t* orow = p.out + (r * num_heads + h0 * group) * D;
      for (int64_t i = 0; i < heads * D; ++i) orow[i] = static_cast<scalar_t>(res[i]);
    }
  });
}

#include "decode_attention_scalar.h"

template <typename scalar_t, typename cache_t>
void decode(const Decode<scalar_t, cache_t>& p) {
  switch (p.head_dim) {
    case 64: decode_vector<scalar_t, cache_t, 64>(p); break;
    case 128: decode_vector<scalar_t, cache_t, 128>(p); break;
    case 256: decode_vector<scalar_t, cache_t, 256>(p); break;
    default: decode_scalar<scalar_t, cache_t>(p);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query must be [R, H, D] and the caches [N, B, H_kv, D]");
  TORCH_CHECK(query.device().is_cpu(), "the CPU kernel got a tensor on ", query.device());
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention needs contiguous tensors");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "the key and value caches differ in shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "the key and value caches differ in dtype");
  const bool bf16_cache = query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() || bf16_cache, "the caches must have the query's dtype (",
              query.scalar_type(), ") or, for a float32 query, bfloat16; got ", key_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query head size ", query.size(2), " != cache head size ",
              key_cache.size(3));
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, query.size(1), " query heads do not divide into ",
              key_cache.size(2), " KV heads");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "block_tables and seq_lens need one row per request");
  auto out = at::empty_like(query);
  if (bf16_cache) {
    const Decode<float, at::BFloat16> p(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
    decode(p);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode_attention", [&] {
    decode(Decode<scalar_t>(query, key_cache, value_cache, block_tables, seq_lens, scale, out));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(BATON_CPU_LIB, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(BATON_CPU_LIB, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
