// The vector path of cpu_paged_decode_attention.cpp (head sizes 64, 128 and 256). That file
// includes this one inside its anonymous namespace, after Decode, NextRows, vfloat, load_row,
// block_scores, softmax_block and kMaxHeads; it is not a header to include anywhere else.
//
// A task is a range of one request's KV heads (all of them unless the batch is small), and
// it walks the context a block at a time. In each block, each KV head's query heads compute
// all their scores first (Q.K), then add the block's weighted values (P.V), both in register
// tiles; the weighted values accumulate in L1 between blocks. The next block's rows of the
// range are prefetched a slice per token of these loops, in the order they sit in memory
// (NextRows): a task of all four KV heads of the bench model reads each block as one 16 KB
// stretch, which a one-task-per-KV-head walk read as four strided quarters (a /tmp loop that
// only reads: 15 GB/s that way, 22-28 in memory order, Zen 3). Against one task per (request,
// KV head) with the accumulators held in registers, both prefetching a row at a time, this
// took 0.78-0.90x the time over a float32 cache in memory and 0.85-0.89x over a bfloat16 one
// (8-64 requests and 32-64; 2 threads). Where the cache sits in L3 or L2 it takes 1.01-1.16x:
// the tiles store and reload what the old loop kept in registers, and the prefetches bring
// nothing.

#pragma once

// Unaligned vector loads and stores of floats. A memcpy into a vector variable compiled to two
// 16-byte copies through the stack here, whose 32-byte reload then missed store forwarding.
typedef float vfloat_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));
inline vfloat load_vec(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }
inline void store_vec(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }

// The tiles take CT query heads at once (two share each row vector of K or V loaded, one
// takes an odd head left over) and J vectors of the head dims: CT * J accumulators, the few
// broadcasts and one row vector fit AVX2's 16 registers.
constexpr int kTileVectors = kLanes == 16 ? 16 : 8;

// dots[c][t] (+)= q_c[j0 .. j0 + J) . k_t[j0 .. j0 + J), lane-wise partial sums for CT heads
// (q, k: the first dims of the range; `first`: the range starts at dim 0). Steps `next` (when
// given) once a token.
template <int CT, int J, typename cache_t>
__attribute__((always_inline)) inline void qk_tile(const float* q, int64_t D, const cache_t* k, int64_t row_stride,
                                                   int64_t n, vfloat* dots, int64_t padded, bool first,
                                                   NextRows* next) {
  vfloat qv[CT][J];
  for (int c = 0; c < CT; ++c)
    for (int j = 0; j < J; ++j) qv[c][j] = load_vec(q + c * D + j * kLanes);
  NextRows pf = next ? *next : NextRows{nullptr, 0, 0, 1, 0};  // a copy the loop keeps in registers
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    const cache_t* kt = k + t * row_stride;
    vfloat d[CT];
    for (int c = 0; c < CT; ++c) d[c] = first ? vfloat{} : dots[c * padded + t];
    for (int j = 0; j < J; ++j) {
      const vfloat kv = load_row(kt + j * kLanes);
      for (int c = 0; c < CT; ++c) d[c] += qv[c][j] * kv;
    }
    for (int c = 0; c < CT; ++c) dots[c * padded + t] = d[c];
  }
  if (next) *next = pf;
}

// acc_c[j0 .. j0 + J) = corr_c * acc_c[...] + sum_t p_c,t v_t[j0 .. j0 + J) for CT heads.
// Steps `next` (when given) once a token.
template <int CT, int J, typename cache_t>
__attribute__((always_inline)) inline void pv_tile(float* acc, int64_t D, const float* corr, const cache_t* v,
                                                   int64_t row_stride, int64_t n, const float* probs,
                                                   int64_t padded, NextRows* next) {
  vfloat a[CT][J];
  for (int c = 0; c < CT; ++c)
    for (int j = 0; j < J; ++j) a[c][j] = load_vec(acc + c * D + j * kLanes) * corr[c];
  NextRows pf = next ? *next : NextRows{nullptr, 0, 0, 1, 0};
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    const cache_t* vt = v + t * row_stride;
    vfloat w[CT];
    for (int c = 0; c < CT; ++c) w[c] = broadcast(probs[c * padded + t]);
    for (int j = 0; j < J; ++j) {
      const vfloat vv = load_row(vt + j * kLanes);
      for (int c = 0; c < CT; ++c) a[c][j] += w[c] * vv;
    }
  }
  for (int c = 0; c < CT; ++c)
    for (int j = 0; j < J; ++j) store_vec(acc + c * D + j * kLanes, a[c][j]);
  if (next) *next = pf;
}

// One block (n tokens from k and v, one KV head's dims) for C <= kMaxHeads query heads sharing
// that KV head (qf: their scaled queries): folds the block into their online softmax and adds
// its weighted values to acc (C * D floats). The first tile of each loop steps next_k and
// next_v (when given) once a token.
template <typename cache_t, int D>
__attribute__((always_inline)) inline void attend_block(const float* qf, int64_t C, const cache_t* k, const cache_t* v,
                                                        int64_t row_stride, int64_t n, int64_t padded,
                                                        NextRows* next_k, NextRows* next_v, vfloat* dots,
                                                        float* scores, float* acc, float* run_max, float* run_sum) {
  constexpr int V = D / kLanes;
  constexpr int J2 = std::min(V, kTileVectors / 2), J1 = std::min(V, kTileVectors);
  float corr[kMaxHeads];
  int64_t c = 0;
  for (; c + 2 <= C; c += 2)
    for (int j = 0; j < V; j += J2)
      qk_tile<2, J2>(qf + c * D + j * kLanes, D, k + j * kLanes, row_stride, n, dots + c * padded, padded, j == 0,
                     c == 0 && j == 0 ? next_k : nullptr);
  if (c < C)
    for (int j = 0; j < V; j += J1)
      qk_tile<1, J1>(qf + c * D + j * kLanes, D, k + j * kLanes, row_stride, n, dots + c * padded, padded, j == 0,
                     c == 0 && j == 0 ? next_k : nullptr);
  block_scores(dots, scores, C, n, padded, 1.f);  // the scale is in qf
  for (c = 0; c < C; ++c) corr[c] = softmax_block(scores + c * padded, n, run_max[c], run_sum[c]);
  for (c = 0; c + 2 <= C; c += 2)
    for (int j = 0; j < V; j += J2)
      pv_tile<2, J2>(acc + c * D + j * kLanes, D, corr + c, v + j * kLanes, row_stride, n, scores + c * padded, padded,
                     c == 0 && j == 0 ? next_v : nullptr);
  if (c < C)
    for (int j = 0; j < V; j += J1)
      pv_tile<1, J1>(acc + c * D + j * kLanes, D, corr + c, v + j * kLanes, row_stride, n, scores + c * padded, padded,
                     c == 0 && j == 0 ? next_v : nullptr);
}

// KV heads h0 .. h1 - 1 of request r with all their query heads (qf: those heads' scaled
// queries) against the whole context; acc, run_max and run_sum hold the running softmax of
// each query head. Writes the normalized outputs of those query heads to out.
template <typename scalar_t, typename cache_t, int D>
void attend_range(const float* qf, const Decode<scalar_t, cache_t>& p, int64_t r, int64_t h0, int64_t h1,
                  vfloat* dots, float* scores, float* acc, float* run_max, float* run_sum, float* out) {
  const int64_t group = p.group, heads = (h1 - h0) * group;
  const int64_t padded = (p.block_size + kLanes - 1) / kLanes * kLanes;
  std::fill(acc, acc + heads * D, 0.f);
  for (int64_t c = 0; c < heads; ++c) run_max[c] = -std::numeric_limits<float>::infinity(), run_sum[c] = 0.f;
  const int32_t* table = p.tables + r * p.max_blocks;
  const int64_t len = p.lens[r], block_size = p.block_size;
  for (int64_t first = 0, blk = 0; first < len; first += block_size, ++blk) {
    const int64_t n = std::min(block_size, len - first);
    const int64_t base = static_cast<int64_t>(table[blk]) * p.block_stride;
    // the next block's rows of heads h0 .. h1 - 1, a head's slice each step: one pass of each
    // loop over the range's heads steps through them all
    const int64_t rows = std::clamp<int64_t>(len - first - block_size, 0, block_size);
    const int64_t next = rows ? static_cast<int64_t>(table[blk + 1]) * p.block_stride : 0;
    auto [next_k, next_v] = next_rows(p, next + h0 * D, rows, h1 - h0, D * static_cast<int64_t>(sizeof(cache_t)));
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t c0 = (h - h0) * group;
      for (int64_t g = 0; g < group; g += kMaxHeads)
        attend_block<cache_t, D>(qf + (c0 + g) * D, std::min<int64_t>(kMaxHeads, group - g), p.k_cache + base + h * D,
                                 p.v_cache + base + h * D, p.row_stride, n, padded, g == 0 ? &next_k : nullptr,
                                 g == 0 ? &next_v : nullptr, dots, scores, acc + (c0 + g) * D, run_max + c0 + g,
                                 run_sum + c0 + g);
    }
  }
  for (int64_t c = 0; c < heads; ++c) {
    const float inv = run_sum[c] > 0.f ? 1.f / run_sum[c] : 0.f;
    for (int64_t i = 0; i < D; ++i) out[c * D + i] = acc[c * D + i] * inv;
  }
}
