// int8 weights and int8 activations (W8A8) for the CPU: y = (q_x W_q^T) * s_x * s_w + bias.
// W_q is int8 [N, K] with one float32 scale per output channel (services/model/
// w8a8_linear.py quantizes and packs it); each row of x is quantized here, on every call, to
// int8 with a scale of its own (dynamic, per token), so a row's result does not depend on the
// other rows of the batch:
//
//     s_x = max|x[m, :]| / 127,   q_x = round(x[m, :] * (127 / max|x[m, :]|))   (half to even)
//
// The weight is packed in blocks of 16 output channels, k in groups of four (the order of
// AVX512-VNNI's vpdpbusd, which multiplies four unsigned bytes by four signed ones and adds
// the four products to an int32 lane), K padded to a multiple of 4 with zeros:
//
//     packed[nb][g][c][j] = W_q[nb * 16 + c][4 g + j]        (c < 16, j < 4)
//
// vpdpbusd wants unsigned activations, so the kernel multiplies q_x + 128 (1..255) and takes
// 128 * sum_k W_q[n, k] (`column_sums`, computed at packing) back off the int32 sum, which is
// exact. One vpdpbusd does 64 multiply-adds where a float32 FMA does 16, and the weight is a
// quarter of float32's bytes, so this is what makes int8 pay at decode batches of 4-16 rows
// on CPUs without AMX, where widening each int8 weight to float32 (cpu_int8_linear.cpp)
// costs as much as float32's own multiply.
//
// Blocks are split across threads (thread_pool.h's parallel_for), and so are the rows'
// quantization; a register tile is up to 12 rows of one block, or from kPairMinRows rows up
// to 6 rows of two.
//
// AVX2 (no VNNI): each group's int8 weights widen to int16 (vpmovsxbw, 16 weights an
// instruction) and vpmaddwd multiplies them by q_x as int16, adding pairs into int32 lanes:
// 16 multiply-adds an instruction, exact (|products| <= 127 * 127). No + 128 offset there,
// so no column sums either: the same integers. Measured on a Zen 3 core, vpmaddwd plus its
// vpaddd run ~1.7x the multiply-adds a second of float32 FMAs, and one instruction widens 16
// weights where int8_linear's float path takes two for 8. A register tile is up to 6 rows of
// half a block (8 channels).
//
// Builds with neither run the same arithmetic in scalar code (`w8a8_linear_fast` says
// which): the results are equal.
//
// Built on first use by kernels/cpu_ops.py with the other csrc files, joining their
// baton_cpu library.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "op_library.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define BATON_W8A8_VNNI 1
#elif defined(__AVX2__)
#define BATON_W8A8_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 16;    // output channels per packed block
constexpr int64_t kGroup = 4;     // k per vpdpbusd lane
constexpr int64_t kMaxRows = 12;  // rows per register tile of one block (6 of two)
// The AVX2 tile prefetches this many bytes ahead of the weight line it reads. From memory
// (a decode step's weights do not stay in cache), the bench model's layers at 1-8 rows took
// 0.78-0.89x the time with 8 KB (4 KB 0.82-0.89x, 16 KB 0.81-0.91x; Zen 3, 2 threads): the
// hardware prefetcher alone kept the int8 stream at ~22 GB/s where float32's reads 30-40.
#ifndef BATON_W8A8_PREFETCH
#define BATON_W8A8_PREFETCH 8192
#endif
#ifndef BATON_W8A8_PAIR
#define BATON_W8A8_PAIR 1
#endif
// From this many rows a task takes two blocks (prefill: 0.89-0.98x the time of one-block
// tiles at 256 rows of the bench model's shapes, four runs); below, one (two took 1.1-1.35x as
// long at 1-16 rows: half the tasks to share out, two streams of weights a task).
constexpr int64_t kPairMinRows = 64;

// IEEE single-precision division and product, whatever -ffast-math allows the compiler to do
// with `/` (a reciprocal): the reference (w8a8_linear.py) computes the scales the same way.
// Elsewhere than x86 the operators (a quotient may then differ in its last bit).
#if defined(__x86_64__)
inline float divide(float a, float b) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b))); }
inline float multiply(float a, float b) { return _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(a), _mm_set_ss(b))); }
#else
inline float divide(float a, float b) { return a / b; }
inline float multiply(float a, float b) { return a * b; }
#endif

// The activations as the path multiplies them: unsigned bytes q_x + 128 for vpdpbusd (and
// the scalar path, which follows its arithmetic), q_x itself as int16 for vpmaddwd.
#if defined(BATON_W8A8_AVX2)
using Activation = int16_t;
constexpr int32_t kOffset = 0;
#else
using Activation = uint8_t;
constexpr int32_t kOffset = 128;
#endif

// Row m's scale (s_x) and its values (Activation), K padded with zeros.
void quantize_row(const float* x, int64_t K, int64_t kp, Activation* q, float* scale) {
  float amax = 0.f;
  bool nan = false;  // max drops a NaN operand: tracked on its own, so a NaN's row stays NaN
  int64_t k = 0;
#if defined(BATON_W8A8_VNNI)
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  amax = _mm512_reduce_max_ps(vmax);
  nan = unordered != 0;
#elif defined(BATON_W8A8_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float lane : lanes) amax = std::max(amax, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (int64_t i = k; i < K; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    nan |= std::isnan(x[i]);
  }
  if (nan) amax = std::numeric_limits<float>::quiet_NaN();
  if (!(amax > 0.f)) {  // an all-zero row: every product is zero; a NaN scale keeps a NaN's row NaN
    std::fill(q, q + kp, static_cast<Activation>(kOffset));
    *scale = amax == 0.f ? 0.f : amax;
    return;
  }
  const float inv = divide(127.f, amax);
  *scale = divide(amax, 127.f);
  k = 0;
#if defined(BATON_W8A8_VNNI)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i bias = _mm512_set1_epi32(kOffset);
  for (; k + 16 <= K; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv));  // rounds half to even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, bias)));
  }
#elif defined(BATON_W8A8_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; k + 8 <= K; k += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));  // rounds half to even
    // packs: (v0..v3 twice | v4..v7 twice) as int16, exact (|q| <= 127); the permute joins the halves
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm256_castsi256_si128(packed));
  }
#endif
  for (int64_t i = k; i < K; ++i) {
    const float v = multiply(x[i], inv);
    q[i] = static_cast<Activation>(static_cast<int32_t>(std::nearbyint(v)) + kOffset);
  }
  std::fill(q + K, q + kp, static_cast<Activation>(kOffset));
}

#if defined(BATON_W8A8_VNNI)
// kRows rows against kBlocks adjacent blocks: channels [n0, n0 + valid), valid <= 16 kBlocks.
// Two blocks a tile (up to 6 rows, 12 accumulators) share each row's broadcast between two
// vpdpbusd; one block a tile (up to 12 rows) takes the last block of an odd count.
template <int kRows, int kBlocks>
void tile(const uint8_t* q, int64_t kp, const int8_t* blocks, const int32_t* column_sums, const float* row_scales,
          const float* scale, const float* bias, float* y, int64_t N, int64_t n0, int64_t valid) {
  const int64_t stride = kp * kBlock;  // bytes from one block to the next
  __m512i acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_si512();
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    __m512i w[kBlocks];
    for (int b = 0; b < kBlocks; ++b) w[b] = _mm512_loadu_si512(blocks + b * stride + g * kGroup * kBlock);
    for (int r = 0; r < kRows; ++r) {
      int32_t four;
      std::memcpy(&four, q + r * kp + g * kGroup, sizeof(four));
      const __m512i x = _mm512_set1_epi32(four);
      for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], x, w[b]);
    }
  }
  for (int b = 0; b < kBlocks && kBlock * b < valid; ++b) {
    const int64_t nb0 = n0 + kBlock * b, left = valid - kBlock * b;
    const __mmask16 mask = left >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512i sums = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, column_sums + nb0), _mm512_set1_epi32(128));
    const __m512 channel = _mm512_maskz_loadu_ps(mask, scale + nb0);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + nb0) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], sums));
      const __m512 v = _mm512_mul_ps(dot, _mm512_mul_ps(_mm512_set1_ps(row_scales[r]), channel));
      _mm512_mask_storeu_ps(y + r * N + nb0, mask, bias ? _mm512_add_ps(v, bv) : v);
    }
  }
}

// Every row against `num_blocks` (1 or 2) adjacent blocks from channel n0.
void rows_against_blocks(const uint8_t* q, int64_t M, int64_t kp, const int8_t* blocks, int64_t num_blocks,
                         const int32_t* column_sums, const float* row_scales, const float* scale, const float* bias,
                         float* y, int64_t N, int64_t n0, int64_t valid) {
  const int64_t rows = num_blocks == 2 ? kMaxRows / 2 : kMaxRows;
  for (int64_t m = 0; m < M; m += rows) {
    const uint8_t* qm = q + m * kp;
    float* ym = y + m * N;
    const float* sm = row_scales + m;
    const int64_t r = std::min<int64_t>(rows, M - m);
#define BATON_W8A8_TILE(R, B) \
  case R: tile<R, B>(qm, kp, blocks, column_sums, sm, scale, bias, ym, N, n0, valid); break;
    if (num_blocks == 2) {
      switch (r) {
        BATON_W8A8_TILE(1, 2)
        BATON_W8A8_TILE(2, 2)
        BATON_W8A8_TILE(3, 2)
        BATON_W8A8_TILE(4, 2)
        BATON_W8A8_TILE(5, 2)
        BATON_W8A8_TILE(6, 2)
      }
    } else {
      switch (r) {
        BATON_W8A8_TILE(1, 1)
        BATON_W8A8_TILE(2, 1)
        BATON_W8A8_TILE(3, 1)
        BATON_W8A8_TILE(4, 1)
        BATON_W8A8_TILE(5, 1)
        BATON_W8A8_TILE(6, 1)
        BATON_W8A8_TILE(7, 1)
        BATON_W8A8_TILE(8, 1)
        BATON_W8A8_TILE(9, 1)
        BATON_W8A8_TILE(10, 1)
        BATON_W8A8_TILE(11, 1)
        BATON_W8A8_TILE(12, 1)
      }
    }
#undef BATON_W8A8_TILE
  }
}
#elif defined(BATON_W8A8_AVX2)
// One row's step of a tile: a0 += x . w0, a1 += x . w1 for the group's four activations x
// (broadcast from `src`) against two ymm of widened weights (4 channels x 4 k each;
// vpmaddwd leaves each channel's sum in two adjacent lanes). In asm because GCC, given the
// same intrinsics, hoists every row's broadcast above the multiplies and, out of registers,
// keeps accumulators on the stack: a 4-row tile's k loop stored and reloaded one every
// group (a store-to-load chain), and 1-3 row tiles copied registers. Here the accumulators
// stay in place, 12 of them plus 2 weights and 2 temporaries: all 16 ymm at 6 rows.
#define BATON_W8A8_ROW(a0, a1, src)                                                         \
  do {                                                                                       \
    __m256i x_, p_;                                                                          \
    asm("vpbroadcastq %[s], %[x]\n\t"                                                        \
        "vpmaddwd %[w0], %[x], %[p]\n\t"                                                     \
        "vpmaddwd %[w1], %[x], %[x]\n\t"                                                     \
        "vpaddd %[p], %[A0], %[A0]\n\t"                                                      \
        "vpaddd %[x], %[A1], %[A1]"                                                          \
        : [A0] "+x"(a0), [A1] "+x"(a1), [x] "=&x"(x_), [p] "=&x"(p_)                         \
        : [w0] "x"(w0), [w1] "x"(w1), [s] "m"(*reinterpret_cast<const int64_t*>(src))); \
  } while (0)

// kRows rows (q_x as int16, rows kp apart) against half a block (8 channels), from `half`
// (its first weight in the block's first group line).
template <int kRows>
void tile_avx2(const int16_t* xs, int64_t kp, const int8_t* half, const float* row_scales, const float* scale,
               const float* bias, float* y, int64_t N, int64_t n0, int64_t valid) {
  static_assert(kRows >= 1 && kRows <= 6, "a tile is 1-6 rows");
  const __m256i z = _mm256_setzero_si256();
  // Named, not an array: GCC keeps an array that asm operands name on the stack.
  __m256i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int8_t* line = half + g * kGroup * kBlock;
#if BATON_W8A8_PREFETCH
    _mm_prefetch(reinterpret_cast<const char*>(line) + BATON_W8A8_PREFETCH, _MM_HINT_T0);
#endif
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16)));
    const int16_t* x = xs + g * kGroup;
    BATON_W8A8_ROW(a00, a01, x);
    if constexpr (kRows > 1) BATON_W8A8_ROW(a10, a11, x + kp);
    if constexpr (kRows > 2) BATON_W8A8_ROW(a20, a21, x + 2 * kp);
    if constexpr (kRows > 3) BATON_W8A8_ROW(a30, a31, x + 3 * kp);
    if constexpr (kRows > 4) BATON_W8A8_ROW(a40, a41, x + 4 * kp);
    if constexpr (kRows > 5) BATON_W8A8_ROW(a50, a51, x + 5 * kp);
  }
  const __m256i acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t count = std::min<int64_t>(valid, 8);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes);
  const __m256 channel = _mm256_maskload_ps(scale + n0, mask);
  const __m256 bv = bias ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    // hadd: channels (0, 1, 4, 5 | 2, 3, 6, 7); the 64-bit permute puts them in order
    const __m256i sum = _mm256_hadd_epi32(acc[r][0], acc[r][1]);
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(sum, 0xD8));
    const __m256 v = _mm256_mul_ps(dot, _mm256_mul_ps(_mm256_set1_ps(row_scales[r]), channel));
    _mm256_maskstore_ps(y + r * N + n0, mask, bias ? _mm256_add_ps(v, bv) : v);
  }
}
#undef BATON_W8A8_ROW

// Every row against one block: each half (8 channels) in tiles of up to 6 rows (12
// accumulators). Whole-block tiles of one or two rows compiled to spills and register copies
// in the k loop (GCC loads all four weight vectors first).
void rows_against_block(const int16_t* xs, int64_t M, int64_t kp, const int8_t* block, const float* row_scales,
                        const float* scale, const float* bias, float* y, int64_t N, int64_t n0, int64_t valid) {
  for (int64_t m = 0; m < M; m += 6) {
    const int16_t* xm = xs + m * kp;
    float* ym = y + m * N;
    const float* sm = row_scales + m;
    for (int64_t h = 0; h < 2 && 8 * h < valid; ++h) {
      const int8_t* half = block + 32 * h;  // 8 channels x 4 k of each group line
      const int64_t nh = n0 + 8 * h, vh = valid - 8 * h;
#define BATON_W8A8_TILE(R) \
  case R: tile_avx2<R>(xm, kp, half, sm, scale, bias, ym, N, nh, vh); break;
      switch (std::min<int64_t>(6, M - m)) {
        BATON_W8A8_TILE(1)
        BATON_W8A8_TILE(2)
        BATON_W8A8_TILE(3)
        BATON_W8A8_TILE(4)
        BATON_W8A8_TILE(5)
        BATON_W8A8_TILE(6)
      }
#undef BATON_W8A8_TILE
    }
  }
}

// Every row against `num_blocks` adjacent blocks from channel n0, one after the other.
void rows_against_blocks(const int16_t* xs, int64_t M, int64_t kp, const int8_t* blocks, int64_t num_blocks,
                         const int32_t* /*column_sums*/, const float* row_scales, const float* scale,
                         const float* bias, float* y, int64_t N, int64_t n0, int64_t valid) {
  for (int64_t b = 0; b < num_blocks && kBlock * b < valid; ++b) {
    rows_against_block(xs, M, kp, blocks + b * kp * kBlock, row_scales, scale, bias, y, N, n0 + kBlock * b,
                       std::min<int64_t>(kBlock, valid - kBlock * b));
  }
}
#else
// y[m, n] from the int32 dot product of q_x + 128 with W_q[n], in the vector path's order.
inline float finish(int32_t dot, int32_t column_sum, float row_scale, float channel_scale, const float* bias,
                    int64_t n) {
  const float v = static_cast<float>(dot - 128 * column_sum) * (row_scale * channel_scale);
  return bias ? v + bias[n] : v;
}

void rows_against_blocks(const uint8_t* q, int64_t M, int64_t kp, const int8_t* blocks, int64_t /*num_blocks*/,
                         const int32_t* column_sums, const float* row_scales, const float* scale, const float* bias,
                         float* y, int64_t N, int64_t n0, int64_t valid) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < valid; ++c) {
      const int8_t* block = blocks + (c / kBlock) * kp * kBlock;
      int32_t dot = 0;
      for (int64_t k = 0; k < kp; ++k) {
        dot += static_cast<int32_t>(q[m * kp + k]) * block[(k / kGroup) * kGroup * kBlock + (c % kBlock) * kGroup + k % kGroup];
      }
      y[m * N + n0 + c] = finish(dot, column_sums[n0 + c], row_scales[m], scale[n0 + c], bias, n0 + c);
    }
  }
}
#endif

bool w8a8_linear_fast() {
#if defined(BATON_W8A8_VNNI) || defined(BATON_W8A8_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& column_sums,
                       const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kBlock && packed.size(3) == kGroup,
              "packed: contiguous int8 [N/16, K/4, 16, 4]");
  const int64_t M = x.size(0), K = x.size(1), kp = kGroup * packed.size(1), num_blocks = packed.size(0);
  TORCH_CHECK(kp >= K && kp - K < kGroup, "packed K (", kp, ") is not x's (", K, ") padded to 4");
  TORCH_CHECK(N > (num_blocks - 1) * kBlock && N <= num_blocks * kBlock, "N=", N, " does not fit the blocks");
  TORCH_CHECK(column_sums.is_contiguous() && column_sums.scalar_type() == at::kInt && column_sums.numel() >= N,
              "column_sums: int32 [N]");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == N, "scale: float32 [N]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N, "bias: float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({M, kp}, x.options().dtype(std::is_same_v<Activation, int16_t> ? at::kShort : at::kByte));
  at::Tensor row_scales = at::empty({M}, x.options());
  const float* xp = xc.data_ptr<float>();
  Activation* activations = static_cast<Activation*>(q.data_ptr());
  float* sp = row_scales.data_ptr<float>();
  baton::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, K, kp, activations + m * kp, sp + m);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cs = column_sums.data_ptr<int32_t>();
  const float* ws = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Tasks of one or two adjacent blocks (a register tile's channels).
  const int64_t pair = BATON_W8A8_PAIR && M >= kPairMinRows ? 2 : 1;
  const int64_t num_tasks = (num_blocks + pair - 1) / pair;
  baton::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = task * pair, blocks = std::min<int64_t>(pair, num_blocks - nb), n0 = nb * kBlock;
      rows_against_blocks(activations, M, kp, wp + nb * kp * kBlock, blocks, cs, sp, ws, bias_ptr, yp, N, n0,
                          std::min<int64_t>(blocks * kBlock, N - n0));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BATON_CPU_LIB, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor column_sums, Tensor scale, Tensor? bias, int N) -> Tensor");
  m.def("w8a8_linear_fast() -> bool", &w8a8_linear_fast);
}

TORCH_LIBRARY_IMPL(BATON_CPU_LIB, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
