// Paged decode attention on the CPU, reading the KV cache in place.
//
// One query token per request against its whole paged context, like the Triton kernel and
// the torch reference (kernels/reference.py), without gathering the context first. A
// request is one task of at::parallel_for: it walks its block table once, block by block;
// a block of the cache ([block_size, H_kv, D]) is contiguous, so each block is one run of
// memory for K and one for V, and the next block's runs are prefetched while this one is
// computed (blocks sit anywhere in the cache: the hardware prefetcher does not follow the
// table). Each query head keeps an online softmax (running max, running sum, weighted
// values) in float32, whatever the cache dtype. Query heads h * G .. h * G + G - 1 share
// KV head h (GQA), so a K/V row is loaded once for its G query heads.
//
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension) and registered as
// torch.ops.baton_cpu.paged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// kHeadDim > 0 fixes the head size at compile time (fully unrolled vector loops); 0 reads
// it from the tensors.
template <typename scalar_t, int64_t kHeadDim>
void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_reqs = query.size(0), num_heads = query.size(1);
  const int64_t D = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_stride = num_kv_heads * D;  // one token's K (or V), every KV head
  const int64_t block_stride = block_size * row_stride;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k_cache = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_cache = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * D), acc(num_heads * D), run_max(num_heads), run_sum(num_heads);
    std::vector<float> scores(num_heads * block_size);  // this block's, then its softmax weights
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = lens[r];
      const int32_t* table = tables + r * max_blocks;
      for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = static_cast<float>(q[r * num_heads * D + i]) * fscale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      for (int64_t first = 0, blk = 0; first < len; first += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - first);
        const int64_t base = static_cast<int64_t>(table[blk]) * block_stride;
        if (first + block_size < len) {
          const int64_t next = static_cast<int64_t>(table[blk + 1]) * block_stride;
          const int64_t bytes =
              std::min(block_size, len - first - block_size) * row_stride * static_cast<int64_t>(sizeof(scalar_t));
          const char* next_k = reinterpret_cast<const char*>(k_cache + next);
          const char* next_v = reinterpret_cast<const char*>(v_cache + next);
          for (int64_t offset = 0; offset < bytes; offset += 64) {
            __builtin_prefetch(next_k + offset);
            __builtin_prefetch(next_v + offset);
          }
        }
        // scores[hq * block_size + t] = q_hq . k_t
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* k_row = k_cache + base + t * row_stride;
          for (int64_t h = 0, hq = 0; h < num_kv_heads; ++h) {
            const scalar_t* __restrict__ k = k_row + h * D;
            for (int64_t g = 0; g < group; ++g, ++hq) {
              const float* __restrict__ qh = qf.data() + hq * D;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(k[d]);
              scores[hq * block_size + t] = dot;
            }
          }
        }
        // online softmax: rescale what came before to the new running max
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          float* __restrict__ s = scores.data() + hq * block_size;
          float new_max = run_max[hq];
          for (int64_t t = 0; t < n; ++t) new_max = std::max(new_max, s[t]);
          const float correction = std::exp(run_max[hq] - new_max);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - new_max);
            sum += s[t];
          }
          run_max[hq] = new_max;
          run_sum[hq] = run_sum[hq] * correction + sum;
          float* __restrict__ a = acc.data() + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
        }
        // acc_hq += sum_t p_hq,t v_t
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* v_row = v_cache + base + t * row_stride;
          for (int64_t h = 0, hq = 0; h < num_kv_heads; ++h) {
            const scalar_t* __restrict__ v = v_row + h * D;
            for (int64_t g = 0; g < group; ++g, ++hq) {
              const float p = scores[hq * block_size + t];
              float* __restrict__ a = acc.data() + hq * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
            }
          }
        }
      }
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        const float inv = run_sum[hq] > 0.f ? 1.f / run_sum[hq] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[(r * num_heads + hq) * D + d] = static_cast<scalar_t>(acc[hq * D + d] * inv);
      }
    }
  });
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
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query head size ", query.size(2), " != cache head size ",
              key_cache.size(3));
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, query.size(1), " query heads do not divide into ",
              key_cache.size(2), " KV heads");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "block_tables and seq_lens need one row per request");
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode_attention", [&] {
    switch (query.size(2)) {
      case 64: decode<scalar_t, 64>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
      case 128: decode<scalar_t, 128>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
      default: decode<scalar_t, 0>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(baton_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
