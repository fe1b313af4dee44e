// Weight-only int8 linear for the CPU: y = (x W_q^T) * scale + bias, W_q int8 [N, K] with one
// float32 scale per output channel (services/model/int8_linear.py quantizes and packs it).
//
// The weight is packed in blocks of 32 output channels, k in pairs (AMX's VNNI order), K
// padded to a multiple of 32 and channels past N zero:
//
//     packed[nb][p][c][j] = W_q[nb * 32 + c][2 p + j]        (c < 32, j < 2)
//
// so one k-pair of a block is one 64-byte cache line, read front to back. Two paths read it:
//
// AVX-512 (few rows: decode). Each int8 weight is widened to float32 in registers (vpmovsxbd
// + vcvtdq2ps) and multiplied by float32 activations with FMAs; the scale multiplies the
// finished dot product once per output. A register tile is up to 6 rows x 32 channels or
// 12 rows x 16 (24 zmm accumulators, lanes alternating the pair's two k, summed at the end),
// so a decode batch of up to 12 rows widens each weight once. Memory-bound at one row: it
// reads a quarter of the float32 weight's bytes.
//
// AMX (from `amx_min_rows` rows: prefill, large decode batches). Each block is widened once per
// call into a bfloat16 copy (exact: int8 values fit bfloat16's 8-bit significand) and
// tdpbf16ps multiplies 16-row tiles of the activations, rounded to bfloat16 once per call, by
// it, accumulating float32. On the bench model bfloat16 activations moved the mean |logprob
// error| against float32 from 0.254 to 0.258 (the int8 weights are the error), and prefill
// runs ~3x faster than float32 instead of ~15% slower. Widening costs ~2 ms per decode step
// of the bench model, more than the AVX-512 path at 1-8 rows; hence the two.
//
// AVX2 (CPUs without AVX-512): the same layout and widening, 8 lanes at a time; with 16
// registers a tile is 1 row x 32 channels, 2 rows x 16 or up to 6 rows x 8.
//
// Blocks of channels are split across threads (thread_pool.h's parallel_for); rows are not.
// Builds with neither take the plain [N, K] values (layout 0) and an ATen matmul.
//
// Built on first use by kernels/cpu_ops.py with the other csrc files, joining their
// baton_cpu library.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "op_library.h"
#include "thread_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define BATON_INT8_AMX 1
#endif
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kBlock = 32;    // output channels per packed block
constexpr int64_t kPadK = 32;     // K is padded to this (an AMX tile's k)
constexpr int64_t kMaxRows = 12;  // rows per AVX-512 register tile
// From this many rows up (without AMX), a block is widened to float32 once per call rather
// than once per row tile.
constexpr int64_t kScratchRows = 2 * kMaxRows;

inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load_weights(const int8_t* p) { return widen(p); }
inline __m512 load_weights(const float* p) { return _mm512_loadu_ps(p); }

// Writes acc * scale + bias into y[n0, n0 + valid), valid <= 16.
inline void store16(__m512 acc, float* y, int64_t n0, int64_t valid, const float* scale, const float* bias) {
  const __mmask16 mask = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  _mm512_mask_storeu_ps(y + n0, mask, _mm512_fmadd_ps(acc, s, b));
}

// kRows rows (x rows kp apart) against 16 x kHalves channels of a block: `half` points at
// their first weight in the block's first pair line (a block of int8, or one widened to
// float32). kHalves 2 (both halves, 4 accumulators a row) for up to 6 rows, so each line is
// read once; 1 (8 more rows in 24 accumulators) above, each half its own pass.
template <typename Block, int kRows, int kHalves>
void tile(const float* x, int64_t kp, const Block* half, float* y, int64_t ldy, int64_t n0, int64_t valid,
          const float* scale, const float* bias) {
  constexpr int kAcc = 2 * kHalves;
  __m512 acc[kRows][kAcc];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kAcc; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp / 2; ++p) {
    const Block* w = half + p * 2 * kBlock;
    __m512 wv[kAcc];  // each 8 channels x (k, k + 1)
    for (int j = 0; j < kAcc; ++j) wv[j] = load_weights(w + 16 * j);
    for (int r = 0; r < kRows; ++r) {
      double pair;
      std::memcpy(&pair, x + r * kp + 2 * p, sizeof(pair));
      const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair));  // (x[k], x[k + 1]) in every lane pair
      for (int j = 0; j < kAcc; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHalves && 16 * h < valid; ++h) {
      const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(acc[r][2 * h], even, acc[r][2 * h + 1]),
                                       _mm512_permutex2var_ps(acc[r][2 * h], odd, acc[r][2 * h + 1]));
      store16(sum, y + r * ldy, n0 + 16 * h, std::min<int64_t>(16, valid - 16 * h), scale, bias);
    }
  }
}

template <typename Block, int kRows>
void rows_tile(const float* x, int64_t kp, const Block* block, float* y, int64_t ldy, int64_t n0, int64_t valid,
               const float* scale, const float* bias) {
  if constexpr (kRows <= 6) {
    tile<Block, kRows, 2>(x, kp, block, y, ldy, n0, valid, scale, bias);
  } else {
    for (int64_t h = 0; h < 2 && 16 * h < valid; ++h) {
      tile<Block, kRows, 1>(x, kp, block + 32 * h, y, ldy, n0 + 16 * h, std::min<int64_t>(16, valid - 16 * h), scale,
                            bias);
    }
  }
}

template <typename Block>
void rows_against_block(const float* x, int64_t M, int64_t kp, const Block* block, float* y, int64_t N, int64_t n0,
                        int64_t valid, const float* scale, const float* bias) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const float* xm = x + m * kp;
    float* ym = y + m * N;
    switch (std::min<int64_t>(kMaxRows, M - m)) {
      case 1: rows_tile<Block, 1>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 2: rows_tile<Block, 2>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 3: rows_tile<Block, 3>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 4: rows_tile<Block, 4>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 5: rows_tile<Block, 5>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 6: rows_tile<Block, 6>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 7: rows_tile<Block, 7>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 8: rows_tile<Block, 8>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 9: rows_tile<Block, 9>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 10: rows_tile<Block, 10>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      case 11: rows_tile<Block, 11>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
      default: rows_tile<Block, 12>(xm, kp, block, ym, N, n0, valid, scale, bias); break;
    }
  }
}

// A block's kp x 32 int8 weights as float32, in the same order.
inline void widen_block(const int8_t* block, int64_t kp, float* out) {
  for (int64_t i = 0; i < kp * kBlock; i += 16) _mm512_storeu_ps(out + i, widen(block + i));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define BATON_INT8_AVX2 1
constexpr int64_t kBlock = 32;
constexpr int64_t kPadK = 32;
constexpr int64_t kScratchRows = 24;
// The AVX2 tiles prefetch this many bytes ahead of the int8 line they read: with the weights
// in memory the bench model's shapes (the LM head's too) at 1-8 rows took 0.81-0.97x the time
// (4 KB 0.86-0.96x, 16 KB 0.82-0.96x; Zen 3, 2 threads).
#ifndef BATON_INT8_PREFETCH
#define BATON_INT8_PREFETCH 8192
#endif

// 8 weights (4 channels x a k-pair) as float32.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// kRows rows against kQuarters x 8 channels of a block, starting at `quarter` (a pointer to
// its first weight in the block's first pair line). Each ymm of weights is 4 channels x (k,
// k + 1), so a row's accumulators hold pair halves, added pairwise at the end.
template <typename Block, int kRows, int kQuarters>
void tile_avx2(const float* x, int64_t kp, const Block* quarter, float* y, int64_t ldy, int64_t n0, int64_t valid,
               const float* scale, const float* bias) {
  constexpr int kAcc = 2 * kQuarters;
  __m256 acc[kRows][kAcc];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kAcc; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kp / 2; ++p) {
    const Block* w = quarter + p * 2 * kBlock;
#if BATON_INT8_PREFETCH
    if constexpr (std::is_same_v<Block, int8_t>)
      _mm_prefetch(reinterpret_cast<const char*>(w) + BATON_INT8_PREFETCH, _MM_HINT_T0);
#endif
    __m256 wv[kAcc];
    for (int j = 0; j < kAcc; ++j) wv[j] = load8(w + 8 * j);
    for (int r = 0; r < kRows; ++r) {
      const __m256 xv = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + r * kp + 2 * p)));
      for (int j = 0; j < kAcc; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 4
  for (int q = 0; q < kQuarters; ++q) {
    const int64_t first = 8 * q, count = std::clamp<int64_t>(valid - first, 0, 8);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes);
    const __m256 s = _mm256_maskload_ps(scale + n0 + first, mask);
    const __m256 b = bias ? _mm256_maskload_ps(bias + n0 + first, mask) : _mm256_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      // hadd: channels (0, 1, 4, 5 | 2, 3, 6, 7); the 64-bit permute puts them in order
      const __m256 sum = _mm256_hadd_ps(acc[r][2 * q], acc[r][2 * q + 1]);
      const __m256 ordered = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sum), 0xD8));
      _mm256_maskstore_ps(y + r * ldy + n0 + first, mask, _mm256_fmadd_ps(ordered, s, b));
    }
  }
}

// Every row against one block: 4 quarters at once for one row, 2 for two, else one quarter
// and up to 6 rows (12 accumulators of the 16 registers).
template <typename Block>
void rows_against_block(const float* x, int64_t M, int64_t kp, const Block* block, float* y, int64_t N, int64_t n0,
                        int64_t valid, const float* scale, const float* bias) {
  if (M == 1) {
    tile_avx2<Block, 1, 4>(x, kp, block, y, N, n0, valid, scale, bias);
    return;
  }
  if (M == 2) {
    for (int h = 0; h < 2 && 16 * h < valid; ++h)
      tile_avx2<Block, 2, 2>(x, kp, block + 32 * h, y, N, n0 + 16 * h, valid - 16 * h, scale, bias);
    return;
  }
  for (int64_t m = 0; m < M; m += 6) {
    const float* xm = x + m * kp;
    float* ym = y + m * N;
    for (int q = 0; q < 4 && 8 * q < valid; ++q) {
      const Block* wq = block + 16 * q;  // a channel's pair is 2 values
      const int64_t nq = n0 + 8 * q, vq = valid - 8 * q;
      switch (std::min<int64_t>(6, M - m)) {
        case 1: tile_avx2<Block, 1, 1>(xm, kp, wq, ym, N, nq, vq, scale, bias); break;
        case 2: tile_avx2<Block, 2, 1>(xm, kp, wq, ym, N, nq, vq, scale, bias); break;
        case 3: tile_avx2<Block, 3, 1>(xm, kp, wq, ym, N, nq, vq, scale, bias); break;
        case 4: tile_avx2<Block, 4, 1>(xm, kp, wq, ym, N, nq, vq, scale, bias); break;
        case 5: tile_avx2<Block, 5, 1>(xm, kp, wq, ym, N, nq, vq, scale, bias); break;
        default: tile_avx2<Block, 6, 1>(xm, kp, wq, ym, N, nq, vq, scale, bias); break;
      }
    }
  }
}

inline void widen_block(const int8_t* block, int64_t kp, float* out) {
  for (int64_t i = 0; i < kp * kBlock; i += 8) _mm256_storeu_ps(out + i, load8(block + i));
}
#endif  // __AVX512F__, AVX2

#if defined(__AVX512F__) || defined(BATON_INT8_AVX2)
// x [M, kp] float32 (zero past K).
void int8_linear_vector(const at::Tensor& x, const at::Tensor& packed, const float* sp, const float* bias_ptr,
                        int64_t N, at::Tensor& y) {
  const int64_t M = x.size(0), kp = x.size(1), num_blocks = packed.size(0);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const bool widen_once = M >= kScratchRows;
  baton::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    // Reused across calls: a fresh (zeroed) vector cost more than the widening it saves.
    thread_local std::vector<float> scratch;
    if (widen_once && static_cast<int64_t>(scratch.size()) < kp * kBlock) scratch.resize(kp * kBlock);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int8_t* block = wp + nb * kp * kBlock;
      const int64_t n0 = nb * kBlock, valid = std::min<int64_t>(kBlock, N - n0);
      if (widen_once) {
        widen_block(block, kp, scratch.data());
        rows_against_block<float>(xp, M, kp, scratch.data(), yp, N, n0, valid, sp, bias_ptr);
      } else {
        rows_against_block<int8_t>(xp, M, kp, block, yp, N, n0, valid, sp, bias_ptr);
      }
    }
  });
}
#endif

#ifdef BATON_INT8_AMX
constexpr int64_t kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX state only to processes that ask for it (once per process).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Tiles 0, 1: C (rows x 16 float32: channels 0-15, 16-31); 2: A (rows x 32 bf16);
// 3, 4: B (16 k-pairs x 16 channels x 2 bf16).
void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 3; ++t) config.rows[t] = rows, config.colsb[t] = 64;
  for (int t = 3; t < 5; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// x [M, kp] float32 (zero past K).
void int8_linear_amx(const at::Tensor& x, const at::Tensor& packed, const float* sp, const float* bias_ptr, int64_t N,
                     at::Tensor& y) {
  const int64_t M = x.size(0), kp = x.size(1), num_blocks = packed.size(0);
  const at::Tensor xb = x.to(at::kBFloat16);
  const auto* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const int8_t* wp = packed.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  baton::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> widened;  // reused: [pairs][32 channels][2] bf16
    if (static_cast<int64_t>(widened.size()) < kp * kBlock) widened.resize(kp * kBlock);
    alignas(64) float c[2][kAmxRows * 16];
    int configured_rows = 0;
    for (int64_t nb = begin; nb < end; ++nb) {
      const int8_t* block = wp + nb * kp * kBlock;
      for (int64_t i = 0; i < kp * kBlock; i += 32) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(widen(block + i + 16), widen(block + i));  // (high, low)
        _mm512_storeu_si512(widened.data() + i, (__m512i)pair);
      }
      const int64_t n0 = nb * kBlock, valid = std::min<int64_t>(kBlock, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, M - m0));
        if (rows != configured_rows) configure_tiles(configured_rows = rows);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k0 = 0; k0 < kp; k0 += kPadK) {
          _tile_loadd(2, xbp + m0 * kp + k0, kp * 2);
          const uint16_t* b = widened.data() + k0 * kBlock;  // pair k0 / 2, 64 bf16 per pair
          _tile_loadd(3, b, kBlock * 4);
          _tile_loadd(4, b + 32, kBlock * 4);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        for (int r = 0; r < rows; ++r) {
          float* yr = yp + (m0 + r) * N;
          for (int64_t h = 0; h < 2 && 16 * h < valid; ++h) {
            store16(_mm512_load_ps(c[h] + r * 16), yr, n0 + 16 * h, std::min<int64_t>(16, valid - 16 * h), sp,
                    bias_ptr);
          }
        }
      }
    }
    if (configured_rows) _tile_release();
  });
}
#endif  // BATON_INT8_AMX

// The layout services/model/int8_linear.py packs for this build: 1 the k-pair blocks above,
// 0 the plain [N, K] values (no AVX-512).
int64_t int8_linear_layout() {
#if defined(__AVX512F__) || defined(BATON_INT8_AVX2)
  return 1;
#else
  return 0;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t N, int64_t amx_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kChar, "packed: contiguous int8");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == N, "scale: float32 [N]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N, "bias: float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  if (packed.dim() == 2) {  // layout 0
    at::Tensor y = at::matmul(x, packed.to(at::kFloat).t()) * scale;
    return bias.has_value() ? y + *bias : y;
  }
#if defined(__AVX512F__) || defined(BATON_INT8_AVX2)
  const int64_t M = x.size(0), K = x.size(1), kp = 2 * packed.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2, "packed: int8 [N/32, K/2, 32, 2]");
  TORCH_CHECK(kp % kPadK == 0 && kp >= K && kp - K < kPadK, "packed K (", kp, ") is not x's (", K, ") padded to 32");
  TORCH_CHECK(N > (packed.size(0) - 1) * kBlock && N <= packed.size(0) * kBlock, "N=", N, " does not fit the blocks");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor xp = x.contiguous();
  if (kp != K) {  // the padded weights are zero; the activations there must be too (not NaN)
    xp = at::zeros({M, kp}, x.options());
    xp.narrow(1, 0, K).copy_(x);
  }
#ifdef BATON_INT8_AMX
  if (M >= amx_min_rows && amx_permitted()) {
    int8_linear_amx(xp, packed, scale.data_ptr<float>(), bias_ptr, N, y);
    return y;
  }
#endif
  int8_linear_vector(xp, packed, scale.data_ptr<float>(), bias_ptr, N, y);
  return y;
#else
  TORCH_CHECK(false, "this build has no kernel for a packed int8 weight of ", packed.dim(), " dims");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BATON_CPU_LIB, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int N, int amx_min_rows) -> Tensor");
  m.def("int8_linear_layout() -> int", &int8_linear_layout);
}

TORCH_LIBRARY_IMPL(BATON_CPU_LIB, CPU, m) { m.impl("int8_linear", &int8_linear); }
