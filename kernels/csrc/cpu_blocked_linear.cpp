// Linear layers for the CPU on a blocked weight: y = x W^T + b, W [N, K] packed by
// services/model/blocked_linear.py as
//
//     float32:   blocks[nb][k][c]     = W[nb * 16 + c][k]              [N/16, K, 16]
//     bfloat16:  blocks[nb][p][c][j]  = W[nb * 16 + c][2 p + j]        [N/16, K/2, 16, 2]
//
// (c < 16; channels past N and the k past an odd K are zero), so a block of 16 output
// channels is one contiguous run of 64-byte lines, read front to back: one stream per block,
// which the hardware prefetcher follows at close to the machine's copy bandwidth. oneDNN's
// packed layout read the bench model's float32 weights at ~18 GB/s in a decode step where
// this reads ~30 (2 threads). bfloat16 takes k in pairs, AVX512-BF16's order: one
// vdpbf16ps multiplies a line of 16 channels x 2 k by a broadcast pair of activations and
// accumulates in float32 (twice the multiply-adds of a float32 FMA, half the bytes).
//
// With AVX-512 a register tile is 4 blocks x up to 6 rows (24 zmm accumulators): for each k
// (pair), one load per block and one broadcast of x[m][k] (the pair) per row feed the FMAs,
// 10 loads for 24 FMAs (12 rows x 2 blocks took 14 and ran 5-15% slower at 16-2,048 rows).
// Blocks left over at a chunk's end take 2- and 1-block tiles of up to 12 rows. AVX2 CPUs
// have 16 ymm registers: a tile there is 1 block (two ymm) x up to 6 rows, and 2 x 2 or
// 4 x 1 for one or two rows; they take bfloat16 by widening it to float32
// (blocked_linear_avx2.h). Accumulators hold whole outputs, so nothing is reduced across lanes.
//
// Work is split into items of (a panel of up to 120 rows, a chunk of blocks of ~128 KB, up to
// 1 MB on AVX2 where there are many panels), and the threads take items from a shared
// counter rather than a static split: a thread preempted by another process (the gateway,
// the client, Ray on a 2-core machine) leaves its share to the others. On OpenMP the others
// still wait for it at the region's end; on Baton's thread pool (thread_pool.h) they do not.
//
// Built on first use by kernels/cpu_ops.py with the other csrc files, joining their
// baton_cpu library. `blocked_linear_supported(dtype)` says which dtypes this build has a
// kernel for (float32 with AVX-512 or AVX2 and FMA; bfloat16 with AVX512-BF16 and no AMX, or
// with AVX2 and FMA and no AVX-512); the Python side keeps oneDNN for the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "op_library.h"
#include "thread_pool.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define BATON_BLOCKED_F32 1
#endif

namespace {

#if defined(BATON_BLOCKED_F32)
constexpr int64_t kBlock = 16;         // output channels per block: one zmm (two ymm) of float32
constexpr int64_t kPanelRows = 120;    // rows per work item: 10 tiles of 12 (20 of 6 on AVX2)
constexpr int64_t kChunkBytes = 1 << 17;  // weight bytes per work item (~128 KB), up to
#if defined(__AVX512F__)
constexpr int64_t kMaxChunkBytes = kChunkBytes;
#else
constexpr int64_t kMaxChunkBytes = 1 << 20;  // where there are many panels (AVX2, measured there)
#endif

// T: float, or uint16_t for bfloat16 (raw bits).
template <typename T>
struct Problem {
  const T* x;  // [M, K]
  const T* w;  // the blocks
  const T* bias;  // [N] or null
  T* y;  // [M, N]
  int64_t M, K, N;
};
#endif

#if defined(__AVX512F__)

// 16 values of y as float32, written as T (bfloat16 rounded to nearest even).
inline void store16(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

#if defined(__AVX512BF16__)
inline void store16(uint16_t* y, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 load16(const uint16_t* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// x's pair (k, k + 1) as one 32-bit lane; `last` is an odd K's final k (its partner is 0).
inline __m512i pair_of(const uint16_t* x, bool last) {
  uint32_t v = x[0];
  if (!last) std::memcpy(&v, x, sizeof(v));
  return _mm512_set1_epi32(static_cast<int32_t>(v));
}
#endif

template <int kRows, int kBlocks, typename T>
void accumulate(const Problem<T>& p, int64_t m0, int64_t b0, __m512 (&acc)[kRows][kBlocks]) {
  if constexpr (std::is_same_v<T, float>) {
    const float* x = p.x + m0 * p.K;
    const float* w = p.w + b0 * p.K * kBlock;
    for (int64_t k = 0; k < p.K; ++k) {
      __m512 wv[kBlocks];
      for (int b = 0; b < kBlocks; ++b) wv[b] = _mm512_loadu_ps(w + (b * p.K + k) * kBlock);
      for (int r = 0; r < kRows; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * p.K + k]);
        for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_fmadd_ps(wv[b], xv, acc[r][b]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    const int64_t num_pairs = (p.K + 1) / 2;
    const uint16_t* x = p.x + m0 * p.K;
    const uint16_t* w = p.w + b0 * num_pairs * 2 * kBlock;
    auto step = [&](int64_t q, auto pair) {
      __m512i wv[kBlocks];
      for (int b = 0; b < kBlocks; ++b) wv[b] = _mm512_loadu_si512(w + (b * num_pairs + q) * 2 * kBlock);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh xv = (__m512bh)pair(x + r * p.K + 2 * q);
        for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, (__m512bh)wv[b]);
      }
    };
    const int64_t full = p.K / 2;
    for (int64_t q = 0; q < full; ++q) step(q, [](const uint16_t* xp) { return pair_of(xp, false); });
    if (full < num_pairs) step(full, [](const uint16_t* xp) { return pair_of(xp, true); });
#endif
  }
}

// Rows [m0, m0 + kRows) against blocks [b0, b0 + kBlocks).
template <int kRows, int kBlocks, typename T>
void tile(const Problem<T>& p, int64_t m0, int64_t b0) {
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  accumulate<kRows, kBlocks>(p, m0, b0, acc);
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t n0 = (b0 + b) * kBlock, valid = std::min<int64_t>(kBlock, p.N - n0);
    const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 bias = p.bias ? load16(p.bias + n0, mask) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) store16(p.y + (m0 + r) * p.N + n0, mask, _mm512_add_ps(acc[r][b], bias));
  }
}

// Every row of [m0, m1) against blocks [b0, b0 + kBlocks), in tiles of up to kMaxRows rows.
template <int kBlocks, int kMaxRows, typename T>
void rows_against_blocks(const Problem<T>& p, int64_t m0, int64_t m1, int64_t b0) {
  static_assert(kMaxRows == 4 || kMaxRows == 6 || kMaxRows == 12, "tile heights are instantiated up to 4, 6 or 12");
  for (int64_t m = m0; m < m1; m += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, m1 - m)) {
      case 1: tile<1, kBlocks>(p, m, b0); break;
      case 2: tile<2, kBlocks>(p, m, b0); break;
      case 3: tile<3, kBlocks>(p, m, b0); break;
      case 4: tile<4, kBlocks>(p, m, b0); break;
      default:
        if constexpr (kMaxRows == 6) {
          if (m1 - m == 5) tile<5, kBlocks>(p, m, b0); else tile<6, kBlocks>(p, m, b0);
        }
        if constexpr (kMaxRows == 12) {
          switch (std::min<int64_t>(12, m1 - m)) {
            case 5: tile<5, kBlocks>(p, m, b0); break;
            case 6: tile<6, kBlocks>(p, m, b0); break;
            case 7: tile<7, kBlocks>(p, m, b0); break;
            case 8: tile<8, kBlocks>(p, m, b0); break;
            case 9: tile<9, kBlocks>(p, m, b0); break;
            case 10: tile<10, kBlocks>(p, m, b0); break;
            case 11: tile<11, kBlocks>(p, m, b0); break;
            default: tile<12, kBlocks>(p, m, b0); break;
          }
        }
    }
  }
}

// Rows [m0, m1) against blocks [b0, b1).
template <typename T>
void run_item(const Problem<T>& p, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  int64_t b = b0;
  if (m1 - m0 <= 4) {
    for (; b + 4 <= b1; b += 4) rows_against_blocks<4, 4>(p, m0, m1, b);
  } else {
    for (; b + 4 <= b1; b += 4) rows_against_blocks<4, 6>(p, m0, m1, b);
  }
  for (; b + 2 <= b1; b += 2) rows_against_blocks<2, 12>(p, m0, m1, b);
  for (; b < b1; ++b) rows_against_blocks<1, 12>(p, m0, m1, b);
}

#elif defined(BATON_BLOCKED_F32)
#include "blocked_linear_avx2.h"
#endif  // __AVX512F__, AVX2

#if defined(BATON_BLOCKED_F32)
template <typename P>
void blocked_linear_parallel(const P& p, int64_t num_blocks) {
  // Chunks of whole 4-block groups, about kChunkBytes of weights each, larger where there
  // are many panels: every chunk reads all of x's panels again, and at 2,048 rows on AVX2
  // 1 MB chunks ran 6-10% faster than 128 KB. Few panels keep small chunks, so that there
  // are items enough for threads to share (1 MB was 10% slower at 128 rows).
  const int64_t num_panels = (p.M + kPanelRows - 1) / kPanelRows;
  const int64_t chunk_bytes = std::min(kMaxChunkBytes, kChunkBytes * std::max<int64_t>(1, num_panels / 2));
  const int64_t block_bytes = (p.K + 1) / 2 * 2 * kBlock * static_cast<int64_t>(sizeof(*p.w));
  const int64_t chunk = std::max<int64_t>(4, (chunk_bytes / block_bytes + 3) / 4 * 4);
  const int64_t num_chunks = (num_blocks + chunk - 1) / chunk;
  const int64_t num_items = num_chunks * num_panels;
  std::atomic<int64_t> next{0};
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  baton::run_on_threads(num_threads, [&] {
    // Consecutive items share a chunk, so its weights stay in cache while the panels go by
    // (the other order, panels outer, read a large layer's weights again for every panel:
    // up to 1.3x slower at 2,048 rows).
    for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
      const int64_t c = item / num_panels, panel = item % num_panels;
      const int64_t m0 = panel * kPanelRows, b0 = c * chunk;
      run_item(p, m0, std::min(p.M, m0 + kPanelRows), b0, std::min(num_blocks, b0 + chunk));
    }
  });
}
#endif  // BATON_BLOCKED_F32

// bfloat16 with AVX512-BF16 but no AMX, or on AVX2: where the CPU has AMX, oneDNN's AMX
// GEMMs multiply bfloat16 several times faster than vdpbf16ps can (the 512x3072 projection
// at 512 rows: ~1.9 TFLOP/s on 2 Xeon cores), so they keep bfloat16 layers. AVX-512 CPUs
// without AVX512-BF16 keep oneDNN too: the AVX2 widening has not been measured there.
bool blocked_linear_supported(at::ScalarType dtype) {
#if defined(BATON_BLOCKED_F32)
  if (dtype == at::kFloat) return true;
#endif
#if (defined(__AVX512BF16__) && !defined(__AMX_BF16__)) || (defined(BATON_BLOCKED_F32) && !defined(__AVX512F__))
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

// A bfloat16 tensor's raw bits.
inline uint16_t* raw(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                          int64_t N) {
  const at::ScalarType dtype = blocks.scalar_type();
  TORCH_CHECK(blocked_linear_supported(dtype), "this build has no blocked linear kernel for ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "x: [M, K] of the weight's dtype (", dtype, ")");
  const bool pairs = dtype == at::kBFloat16;
  TORCH_CHECK(blocks.is_contiguous() && blocks.dim() == (pairs ? 4 : 3) && blocks.size(2) == 16 &&
                  (!pairs || blocks.size(3) == 2),
              "blocks: contiguous ", pairs ? "[N/16, K/2, 16, 2]" : "[N/16, K, 16]");
  const int64_t K = x.size(1);
  TORCH_CHECK(pairs ? blocks.size(1) == (K + 1) / 2 : blocks.size(1) == K, "x has ", K,
              " features, the weight's blocks do not");
  TORCH_CHECK(N > (blocks.size(0) - 1) * 16 && N <= blocks.size(0) * 16, "N=", N, " does not fit the blocks");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == dtype && bias->numel() == N,
                "bias: [N] of the weight's dtype");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
#if defined(BATON_BLOCKED_F32)
  if (!pairs) {
    const Problem<float> p{xc.data_ptr<float>(), blocks.data_ptr<float>(),
                           bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), x.size(0), K, N};
    blocked_linear_parallel(p, blocks.size(0));
  } else {
#if defined(__AVX512BF16__)
    const Problem<uint16_t> p{raw(xc), raw(blocks), bias.has_value() ? raw(*bias) : nullptr, raw(y), x.size(0), K, N};
    blocked_linear_parallel(p, blocks.size(0));
#elif !defined(__AVX512F__)
    at::Tensor xf = xc.to(at::kFloat);
    if (K % 2) xf = at::constant_pad_nd(xf, {0, 1});  // the odd K's pair partner, zero
    const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
    const WidenedBf16 p{xf.data_ptr<float>(), raw(blocks), bias.has_value() ? bf.data_ptr<float>() : nullptr, raw(y),
                        x.size(0), K, N};
    blocked_linear_parallel(p, blocks.size(0));
#endif
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BATON_CPU_LIB, m) {
  m.def("blocked_linear(Tensor x, Tensor blocks, Tensor? bias, int N) -> Tensor");
  m.def("blocked_linear_supported(ScalarType dtype) -> bool", &blocked_linear_supported);
}

TORCH_LIBRARY_IMPL(BATON_CPU_LIB, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
