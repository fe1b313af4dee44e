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
// to 6 rows of two. Builds without AVX512-VNNI run
// the same arithmetic in scalar code (`w8a8_linear_fast` says which): the results are equal.
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
#include <optional>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define BATON_W8A8_VNNI 1
#endif

namespace {

constexpr int64_t kBlock = 16;    // output channels per packed block
constexpr int64_t kGroup = 4;     // k per vpdpbusd lane
constexpr int64_t kMaxRows = 12;  // rows per register tile of one block (6 of two)
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

// Row m's scale (s_x) and its values as unsigned bytes q_x + 128, K padded with 128 (a zero).
void quantize_row(const float* x, int64_t K, int64_t kp, uint8_t* q, float* scale) {
  float amax = 0.f;
  int64_t k = 0;
#if defined(BATON_W8A8_VNNI)
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (int64_t i = k; i < K; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (!(amax > 0.f)) {  // an all-zero row: every product is zero; a NaN scale keeps a NaN's row NaN
    std::memset(q, 128, kp);
    *scale = amax == 0.f ? 0.f : amax;
    return;
  }
  const float inv = divide(127.f, amax);
  *scale = divide(amax, 127.f);
  k = 0;
#if defined(BATON_W8A8_VNNI)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i bias = _mm512_set1_epi32(128);
  for (; k + 16 <= K; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv));  // rounds half to even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, bias)));
  }
#endif
  for (int64_t i = k; i < K; ++i) {
    const float v = multiply(x[i], inv);
    q[i] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(v)) + 128);
  }
  std::memset(q + K, 128, kp - K);
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
#if defined(BATON_W8A8_VNNI)
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
  at::Tensor q = at::empty({M, kp}, x.options().dtype(at::kByte));
  at::Tensor row_scales = at::empty({M}, x.options());
  const float* xp = xc.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = row_scales.data_ptr<float>();
  baton::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, K, kp, qp + m * kp, sp + m);
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
      rows_against_blocks(qp, M, kp, wp + nb * kp * kBlock, blocks, cs, sp, ws, bias_ptr, yp, N, n0,
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
