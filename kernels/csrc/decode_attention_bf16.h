// The bfloat16 path of cpu_paged_decode_attention.cpp for CPUs with AVX512-BF16. That file
// includes this one inside its anonymous namespace, after vfloat, block_scores and
// softmax_block (and <immintrin.h> before the namespace); it is not a header to include
// anywhere else.
//
// vdpbf16ps multiplies 16 pairs of bfloat16 and adds both products of a pair to one float32
// lane, so the cache's rows are multiplied as they are stored, with no widening:
// - Q.K: a 64-byte load of K is 32 values; one instruction per query head takes its dot
//   products with the query's same 32 values (raw bfloat16, unscaled; the scale multiplies the
//   scores), and the lane sums reduce as in the float32-widening path. Each product is exact
//   in float32, as when both sides are widened.
// - P.V: the weights of tokens t and t + 1 round to bfloat16 and pair up in each 32-bit lane,
//   and the two rows of V interleave (vpunpck{l,h}wd) into the same pairs, so one instruction
//   adds p_t v_t + p_t+1 v_t+1 for 16 head dims. Rounding P to bfloat16 before P.V is what
//   FlashAttention and Baton's Triton kernel do on GPUs; the tests' bfloat16 tolerance is
//   set for it (tests/kernels/conftest.py).
// The unpacks interleave within 128-bit lanes, so an accumulator holds the head dims in a
// fixed shuffled order (`pv_dim`), put back in order when the outputs are written. A
// context's odd last token pairs with zeros, not with the row after it, which is never read.
//
// On Zen 4 (bench/decode_attention.py: the bench model's heads, 32 requests, contexts
// 300-800, 2 threads) the widening path took 1.62x this one's time with the cache in L3 and
// 1.55x with it in memory.

#pragma once

// The head dim that lane `lane` of P.V accumulator `a` holds (two accumulators per 32 dims).
constexpr int pv_dim(int a, int lane) { return a / 2 * 32 + lane / 4 * 8 + a % 2 * 4 + lane % 4; }

template <int P>
inline void load_bf16_row(const uint16_t* p, __m512i (&row)[P]) {
  for (int j = 0; j < P; ++j) row[j] = _mm512_loadu_si512(p + j * 32);
}

// C query heads of one request (q: their raw bfloat16 queries, sharing KV head h) against the
// whole context; their C * D / 16 accumulators stay in registers. Writes the normalized
// outputs to out.
template <typename scalar_t, typename cache_t, int D, int C>
void attend_heads(const at::BFloat16* q_heads, const Decode<at::BFloat16>& p, int64_t r, int64_t h, vfloat* dots,
                  float* scores, uint16_t* probs, float* out) {
  static_assert(kLanes == 16 && D % 32 == 0, "the bfloat16 dot path is AVX-512's");
  constexpr int P = D / 32;   // 64-byte loads per row
  constexpr int A = D / 16;   // accumulators per head
  const auto* q = reinterpret_cast<const uint16_t*>(q_heads);
  const auto* k_cache = reinterpret_cast<const uint16_t*>(p.k_cache);
  const auto* v_cache = reinterpret_cast<const uint16_t*>(p.v_cache);
  const int64_t padded = (p.block_size + kLanes - 1) / kLanes * kLanes, row_stride = p.row_stride;
  __m512bh qv[C][P];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < P; ++j) qv[c][j] = (__m512bh)_mm512_loadu_si512(q + c * D + j * 32);
  __m512 acc[C][A];
  for (int c = 0; c < C; ++c)
    for (int a = 0; a < A; ++a) acc[c][a] = _mm512_setzero_ps();
  float run_max[C], run_sum[C];
  for (int c = 0; c < C; ++c) run_max[c] = -std::numeric_limits<float>::infinity(), run_sum[c] = 0.f;
  walk_blocks(p, r, h * D, D * sizeof(uint16_t), [&](int64_t n, int64_t base, NextRows& next_k, NextRows& next_v)
                                                      __attribute__((always_inline)) {
    // scores[c][t] = scale * q_c . k_t
    for (int64_t t = 0; t < n; ++t) {
      next_k.step();
      __m512i kr[P];
      load_bf16_row<P>(k_cache + base + t * row_stride, kr);
      for (int c = 0; c < C; ++c) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[c][0], (__m512bh)kr[0]);
        for (int j = 1; j < P; ++j) dot = _mm512_dpbf16_ps(dot, qv[c][j], (__m512bh)kr[j]);
        dots[c * padded + t] = dot;
      }
    }
    block_scores(dots, scores, C, n, padded, p.scale);
    // online softmax, then the weights as bfloat16 (zeros past the context's end)
    for (int c = 0; c < C; ++c) {
      float* s = scores + c * padded;
      const __m512 corr = broadcast(softmax_block(s, n, run_max[c], run_sum[c]));
      for (int a = 0; a < A; ++a) acc[c][a] *= corr;
      for (int64_t t = n; t < padded; ++t) s[t] = 0.f;
      for (int64_t t = 0; t < n; t += kLanes)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + c * padded + t),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
    }
    // acc_c += p_c,t v_t + p_c,t+1 v_t+1
    for (int64_t t = 0; t < n; t += 2) {
      next_v.step();
      next_v.step();
      __m512i v0[P], v1[P];
      load_bf16_row<P>(v_cache + base + t * row_stride, v0);
      if (t + 1 < n) {
        load_bf16_row<P>(v_cache + base + (t + 1) * row_stride, v1);
      } else {
        for (int j = 0; j < P; ++j) v1[j] = _mm512_setzero_si512();
      }
      __m512bh pairs[A];
      for (int j = 0; j < P; ++j) {
        pairs[2 * j] = (__m512bh)_mm512_unpacklo_epi16(v0[j], v1[j]);
        pairs[2 * j + 1] = (__m512bh)_mm512_unpackhi_epi16(v0[j], v1[j]);
      }
      for (int c = 0; c < C; ++c) {
        int32_t pair;
        std::memcpy(&pair, probs + c * padded + t, sizeof(pair));
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        for (int a = 0; a < A; ++a) acc[c][a] = _mm512_dpbf16_ps(acc[c][a], pairs[a], w);
      }
    }
  });
  for (int c = 0; c < C; ++c) {
    const float inv = run_sum[c] > 0.f ? 1.f / run_sum[c] : 0.f;
    for (int a = 0; a < A; ++a) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[c][a]);
      for (int lane = 0; lane < 16; ++lane) out[c * D + pv_dim(a, lane)] = lanes[lane] * inv;
    }
  }
}

// attend_heads for c (1 <= c <= C) heads, C fixed at compile time
template <typename scalar_t, typename cache_t, int D, int C, typename... Args>
void attend_chunk(int64_t c, const Args&... args) {
  if constexpr (C > 1) {
    if (c < C) return attend_chunk<scalar_t, cache_t, D, C - 1>(c, args...);
  }
  attend_heads<scalar_t, cache_t, D, C>(args...);
}
