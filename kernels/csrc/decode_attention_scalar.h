// The scalar loop of cpu_paged_decode_attention.cpp, for head sizes without a vector path:
// one task per request, every head. That file includes this one inside its anonymous
// namespace, after softmax_block and the standard headers; it is not a header to include
// anywhere else.

#pragma once

template <typename scalar_t>
void decode_scalar(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_reqs = query.size(0), num_heads = query.size(1);
  const int64_t D = query.size(2);
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
          const float correction = softmax_block(scores.data() + hq * block_size, n, run_max[hq], run_sum[hq]);
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
