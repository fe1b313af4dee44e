// The AVX2 tiles of cpu_blocked_linear.cpp: float32, and bfloat16 widened to float32, for
// CPUs without AVX-512. That file includes this one inside its anonymous namespace, after
// kBlock, Problem and the standard headers (none are included here, inside a namespace);
// it is not a header to include anywhere else.

#pragma once
// AVX2: a block is two ymm of 8 channels, and 16 registers hold 12 accumulators: 1 block x up
// to 6 rows (2 loads and 6 broadcasts per 12 FMAs), 2 blocks x 2 rows, or 4 blocks x 1 row
// (8 independent sums, enough to hide the FMA latency).
//
// bfloat16 without bfloat16 arithmetic: x and the bias arrive as float32 (x padded to the
// pairs' even K), the tiles multiply in float32, and y is rounded to bfloat16 as it is
// stored. A 32-bit lane of a k-pair line holds (k, k + 1) of one channel, so one shift or one
// mask widens either half to float32 exactly. Fewer than kWidenRows rows (a decode step)
// widen in registers and read half of float32's bytes, in tiles of up to 4 rows (a block's
// k-pair widens into 4 registers beside the 8 accumulators); more rows widen each block once
// per work item into a float32 copy in cache, which the float32 tiles then read, so a
// prefill runs at float32's speed. Without this the CPU ran torch's bfloat16 matmul (oneDNN
// has no bfloat16 kernel without AVX-512): 2-10x this kernel's time on the bench model.

// Operands as the tiles read them: float32 x [M, ldx]; weights of W (float32 blocks [K][16],
// or bfloat16 pair blocks [ceil(K / 2)][16][2] as raw bits), passed to each tile; a float32
// bias or null; y of Y [M, N].
template <typename W, typename Y>
struct Operands {
  const float* x;
  int64_t ldx;
  int64_t K;
  const float* bias;
  Y* y;
  int64_t N;
};

// The two ways are level at 12-16 rows (bench model's layers, this file's AVX2 tiles); in
// registers takes 0.79x the widened time at 3-4 rows, widened 0.86x in-register's at 32.
constexpr int64_t kWidenRows = 16;

// A one-block tile (3-6 rows) prefetches this many bytes ahead in its block's stream. With the
// weights in memory, as in a decode step, the bench model's layers took 0.84-0.90x the time at
// 3-16 rows in float32 (64 rows 0.98x, 256 the same) and 0.81-0.91x at 3-12 in bfloat16 widened
// in registers (Zen 3, 2 threads; 2 KB did as well). The 2- and 4-block tiles of 1-2 rows read
// 2-4 streams at once: a prefetch for each made 1 row 1.10-1.13x slower, so they have none.
#ifndef BATON_BLOCKED_PREFETCH
#define BATON_BLOCKED_PREFETCH 4096
#endif

template <typename W>
constexpr int64_t block_elems(int64_t K) {
  return std::is_same_v<W, float> ? K * kBlock : (K + 1) / 2 * 2 * kBlock;
}

// acc[r][j] = x[r] . channels 8j..8j+7 of the kBlocks float32 blocks at w. Not inlined into
// `tile`: there GCC kept the epilogue's lane and mask constants in two of the 16 ymm registers
// across the k loop and, one register short, loaded a weight line again for every FMA (13
// loads per 12 FMAs where 8 do; 5-14% slower at 8-2,048 rows on Zen 3). On its own the loop
// has every register; the accumulators cross the call through memory once per tile.
template <int kRows, int kBlocks>
__attribute__((noinline)) void accumulate(const float* x, int64_t ldx, const float* w, int64_t K,
                                          __m256 (&out)[kRows][2 * kBlocks]) {
  __m256 acc[kRows][2 * kBlocks];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * kBlocks; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#if BATON_BLOCKED_PREFETCH
    if constexpr (kBlocks == 1)
      _mm_prefetch(reinterpret_cast<const char*>(w + k * kBlock) + BATON_BLOCKED_PREFETCH, _MM_HINT_T0);
#endif
    __m256 wv[2 * kBlocks];
    for (int j = 0; j < 2 * kBlocks; ++j) wv[j] = _mm256_loadu_ps(w + ((j / 2) * K + k) * kBlock + 8 * (j % 2));
    for (int r = 0; r < kRows; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      for (int j = 0; j < 2 * kBlocks; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * kBlocks; ++j) out[r][j] = acc[r][j];
}

// acc[r][j] = x[r] . channels 8j..8j+7 of the kBlocks bfloat16 pair blocks at w, widened in
// registers (fewer than kWidenRows rows). Inlined into `tile`: moved out like the float32 one
// above, it measured the same or slower (within 5%) at 4-12 rows.
template <int kRows, int kBlocks>
inline void accumulate(const float* x, int64_t ldx, const uint16_t* w, int64_t K,
                       __m256 (&acc)[kRows][2 * kBlocks]) {
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 2 * kBlocks; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t num_pairs = (K + 1) / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto line = [&](int j, int64_t q, __m256& even, __m256& odd) {
    const uint16_t* p = w + ((j / 2) * num_pairs + q) * 2 * kBlock + 16 * (j % 2);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
  };
  for (int64_t q = 0; q < num_pairs; ++q) {
#if BATON_BLOCKED_PREFETCH
    if constexpr (kBlocks == 1)
      _mm_prefetch(reinterpret_cast<const char*>(w + q * 2 * kBlock) + BATON_BLOCKED_PREFETCH, _MM_HINT_T0);
#endif
    if constexpr (kRows <= 2) {  // few rows: widen one line at a time, x's pairs held
      __m256 xe[kRows], xo[kRows];
      for (int r = 0; r < kRows; ++r) {
        xe[r] = _mm256_broadcast_ss(x + r * ldx + 2 * q);
        xo[r] = _mm256_broadcast_ss(x + r * ldx + 2 * q + 1);
      }
      for (int j = 0; j < 2 * kBlocks; ++j) {
        __m256 even, odd;
        line(j, q, even, odd);
        for (int r = 0; r < kRows; ++r)
          acc[r][j] = _mm256_fmadd_ps(odd, xo[r], _mm256_fmadd_ps(even, xe[r], acc[r][j]));
      }
    } else {  // more rows: the lines held, one row's pair at a time
      __m256 even[2 * kBlocks], odd[2 * kBlocks];
      for (int j = 0; j < 2 * kBlocks; ++j) line(j, q, even[j], odd[j]);
      for (int r = 0; r < kRows; ++r) {
        const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * q);
        const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * q + 1);
        for (int j = 0; j < 2 * kBlocks; ++j)
          acc[r][j] = _mm256_fmadd_ps(odd[j], xo, _mm256_fmadd_ps(even[j], xe, acc[r][j]));
      }
    }
  }
}

inline void store8(float* y, __m256 v, __m256i mask, int64_t valid) {
  if (valid == 8) {
    _mm256_storeu_ps(y, v);
  } else {
    _mm256_maskstore_ps(y, mask, v);
  }
}
// Rounded as torch rounds (vec_math.h's from_float); once per output, off the k loop.
inline void store8(uint16_t* y, __m256 v, __m256i, int64_t valid) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
#pragma omp simd
  for (int64_t i = 0; i < valid; ++i) y[i] = baton_cpu::from_float<c10::BFloat16>(f[i]);
}

// Rows [m0, m0 + kRows) against the kBlocks blocks at w, whose first channel is n0.
template <int kRows, int kBlocks, typename W, typename Y>
void tile(const Operands<W, Y>& o, int64_t m0, const W* w, int64_t n0) {
  constexpr int kCols = 2 * kBlocks;  // ymm per row
  __m256 acc[kRows][kCols];
  accumulate<kRows, kBlocks>(o.x + m0 * o.ldx, o.ldx, w, o.K, acc);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 8
  for (int j = 0; j < kCols; ++j) {
    // Unrolled, with no early exit: constant indices keep the accumulators in registers.
    const int64_t n = n0 + 8 * j, valid = std::clamp<int64_t>(o.N - n, 0, 8);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lanes);
    const __m256 bias = o.bias ? _mm256_maskload_ps(o.bias + n, mask) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) store8(o.y + (m0 + r) * o.N + n, _mm256_add_ps(acc[r][j], bias), mask, valid);
  }
}

// Rows [m0, m1) against the num_blocks blocks at w, the first of which starts at channel n0.
template <typename W, typename Y>
void rows_against_blocks(const Operands<W, Y>& o, int64_t m0, int64_t m1, const W* w, int64_t n0,
                         int64_t num_blocks) {
  const int64_t stride = block_elems<W>(o.K), rows = m1 - m0;
  int64_t b = 0;
  if (rows == 1) {
    for (; b + 4 <= num_blocks; b += 4) tile<1, 4>(o, m0, w + b * stride, n0 + b * kBlock);
    for (; b < num_blocks; ++b) tile<1, 1>(o, m0, w + b * stride, n0 + b * kBlock);
    return;
  }
  if (rows == 2) {
    for (; b + 2 <= num_blocks; b += 2) tile<2, 2>(o, m0, w + b * stride, n0 + b * kBlock);
    for (; b < num_blocks; ++b) tile<2, 1>(o, m0, w + b * stride, n0 + b * kBlock);
    return;
  }
  constexpr int64_t kTall = std::is_same_v<W, float> ? 6 : 4;  // bfloat16: 8 accumulators + 4 widened
  for (; b < num_blocks; ++b) {
    const W* wb = w + b * stride;
    const int64_t nb = n0 + b * kBlock;
    for (int64_t m = m0; m < m1; m += kTall) {
      switch (std::min<int64_t>(kTall, m1 - m)) {
        case 1: tile<1, 1>(o, m, wb, nb); break;
        case 2: tile<2, 1>(o, m, wb, nb); break;
        case 3: tile<3, 1>(o, m, wb, nb); break;
        case 4: tile<4, 1>(o, m, wb, nb); break;
        case 5:
          if constexpr (kTall == 6) tile<5, 1>(o, m, wb, nb);
          break;
        default:
          if constexpr (kTall == 6) tile<6, 1>(o, m, wb, nb);
          break;
      }
    }
  }
}

void run_item(const Problem<float>& p, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const Operands<float, float> o{p.x, p.K, p.K, p.bias, p.y, p.N};
  rows_against_blocks(o, m0, m1, p.w + b0 * block_elems<float>(p.K), b0 * kBlock, b1 - b0);
}

// A bfloat16 layer on AVX2: x and the bias as float32 (x [M, 2 * ceil(K / 2)], the pad zero).
struct WidenedBf16 {
  const float* x;
  const uint16_t* w;
  const float* bias;
  uint16_t* y;
  int64_t M, K, N;
};

// One pair block widened to float32 blocks [2 * ceil(K / 2)][16].
inline void widen_block(const uint16_t* block, int64_t num_pairs, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t q = 0; q < num_pairs; ++q) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + q * 2 * kBlock + 16 * h));
      _mm256_storeu_ps(out + 2 * q * kBlock + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(out + (2 * q + 1) * kBlock + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
  }
}

void run_item(const WidenedBf16& p, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const int64_t num_pairs = (p.K + 1) / 2, ldx = 2 * num_pairs;
  if (p.M < kWidenRows) {
    const Operands<uint16_t, uint16_t> o{p.x, ldx, p.K, p.bias, p.y, p.N};
    rows_against_blocks(o, m0, m1, p.w + b0 * block_elems<uint16_t>(p.K), b0 * kBlock, b1 - b0);
    return;
  }
  thread_local std::vector<float> widened;  // kept across calls: no item allocates
  if (static_cast<int64_t>(widened.size()) < ldx * kBlock) widened.resize(ldx * kBlock);
  const Operands<float, uint16_t> o{p.x, ldx, ldx, p.bias, p.y, p.N};
  for (int64_t b = b0; b < b1; ++b) {
    widen_block(p.w + b * block_elems<uint16_t>(p.K), num_pairs, widened.data());
    rows_against_blocks(o, m0, m1, widened.data(), b * kBlock, 1);
  }
}
