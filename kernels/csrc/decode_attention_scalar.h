// The scalar loop of cpu_paged_decode_attention.cpp, for head sizes without a vector path:
// one task per request, every head. That file includes this one inside its anonymous
// namespace, after Decode, walk_blocks, softmax_block and the standard headers; it is not a
// header to include anywhere else.

#pragma once

template <typename scalar_t, typename cache_t>
void decode_scalar(const Decode<scalar_t, cache_t>& p) {
  const int64_t num_heads = p.num_heads, D = p.head_dim, block_size = p.block_size;
  const int64_t num_kv_heads = p.num_kv_heads, group = p.group, row_stride = p.row_stride;

  baton::parallel_for(0, p.num_reqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * D), acc(num_heads * D), run_max(num_heads), run_sum(num_heads);
    std::vector<float> scores(num_heads * block_size);  // this block's, then its softmax weights
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = static_cast<float>(p.q[r * num_heads * D + i]) * p.scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      walk_blocks(p, r, 0, row_stride * sizeof(cache_t), [&](int64_t n, int64_t base, NextRows& next_k,
                                                             NextRows& next_v) {
        // scores[hq * block_size + t] = q_hq . k_t
        for (int64_t t = 0; t < n; ++t) {
          next_k.step();
          const cache_t* k_row = p.k_cache + base + t * row_stride;
          for (int64_t h = 0, hq = 0; h < num_kv_heads; ++h) {
            const cache_t* __restrict__ k = k_row + h * D;
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
          next_v.step();
          const cache_t* v_row = p.v_cache + base + t * row_stride;
          for (int64_t h = 0, hq = 0; h < num_kv_heads; ++h) {
            const cache_t* __restrict__ v = v_row + h * D;
            for (int64_t g = 0; g < group; ++g, ++hq) {
              const float w = scores[hq * block_size + t];
              float* __restrict__ a = acc.data() + hq * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(v[d]);
            }
          }
        }
      });
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        const float inv = run_sum[hq] > 0.f ? 1.f / run_sum[hq] : 0.f;
        scalar_t* o = p.out + (r * num_heads + hq) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[hq * D + d] * inv);
      }
    }
  });
}
