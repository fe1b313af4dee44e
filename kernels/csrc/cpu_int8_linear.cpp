// Weight-only int8 linear for the CPU: y = (x W_q^T) * scale + bias, W_q int8 [N, K] with one
// float32 scale per output channel (services/model/int8_linear.py quantizes and packs it).
//
// The weight is packed in column blocks of 64 output channels, each block k-major:
//
//     packed[nb][k][c] = W_q[nb * 64 + c][k]        (c < 64; rows past N are zero)
//
// so one k step of a block is one 64-byte cache line, read front to back. The activations
// stay float32 (this is weight-only quantization): each int8 weight is widened to float32 in
// registers (vpmovsxbd + vcvtdq2ps) and multiplied with an FMA; the scale multiplies the
// finished dot product once per output. Decode batches (a few rows) are memory-bound, and
// this reads a quarter of the float32 weight's bytes.
//
// Register tile: kRows rows x 64 channels = kRows * 4 zmm accumulators (kRows <= 6: 24 of the
// 32 zmm registers, 4 for the weights, 1 for the broadcast row value). Rows past one tile
// re-read the block: with few rows (decode) straight from the int8 block, widening it again;
// with many (prefill) the block is widened once into a float32 scratch [K][64] (L2-resident)
// that every row tile reads, so prefill runs at float32 FMA speed.
//
// Blocks of channels are split across threads (at::parallel_for); rows are not.
//
// Built on first use by kernels/cpu_ops.py with the other csrc files, joining their
// baton_cpu library.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;   // output channels per packed block
constexpr int64_t kMaxRows = 6;  // rows per register tile
// From this many rows up, a block is widened to float32 once rather than per row tile.
constexpr int64_t kScratchRows = 4 * kMaxRows;

inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Writes acc * scale + bias for `rows` rows into y's columns [n0, n0 + valid).
template <int kRows>
inline void store_tile(__m512 (&acc)[kRows][4], float* y, int64_t ldy, int64_t n0, int64_t valid, const float* scale,
                       const float* bias) {
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = j * 16;
    if (c0 >= valid) break;
    const int64_t count = std::min<int64_t>(16, valid - c0);
    const __mmask16 mask = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0 + c0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + c0) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      _mm512_mask_storeu_ps(y + r * ldy + n0 + c0, mask, _mm512_fmadd_ps(acc[r][j], s, b));
    }
  }
}

inline __m512 load_weights(const int8_t* p) { return widen(p); }
inline __m512 load_weights(const float* p) { return _mm512_loadu_ps(p); }

// One tile of kRows rows against one block: an int8 block widened on the fly, or a float32
// one widened beforehand.
template <typename Block, int kRows>
void tile(const float* x, int64_t K, const Block* block, float* y, int64_t ldy, int64_t n0, int64_t valid,
          const float* scale, const float* bias) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const Block* w = block + k * kBlock;
    const __m512 w0 = load_weights(w), w1 = load_weights(w + 16), w2 = load_weights(w + 32),
                 w3 = load_weights(w + 48);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  store_tile<kRows>(acc, y, ldy, n0, valid, scale, bias);
}

template <typename Block>
void rows_against_block(const float* x, int64_t M, int64_t K, const Block* block, float* y, int64_t N, int64_t n0,
                        int64_t valid, const float* scale, const float* bias) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(kMaxRows, M - m)) {
      case 1: tile<Block, 1>(xm, K, block, ym, N, n0, valid, scale, bias); break;
      case 2: tile<Block, 2>(xm, K, block, ym, N, n0, valid, scale, bias); break;
      case 3: tile<Block, 3>(xm, K, block, ym, N, n0, valid, scale, bias); break;
      case 4: tile<Block, 4>(xm, K, block, ym, N, n0, valid, scale, bias); break;
      case 5: tile<Block, 5>(xm, K, block, ym, N, n0, valid, scale, bias); break;
      default: tile<Block, 6>(xm, K, block, ym, N, n0, valid, scale, bias); break;
    }
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kBlock,
              "packed: contiguous int8 [N/64, K, 64]");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed weight has K=", packed.size(1), ", x has ", K);
  TORCH_CHECK(N > (num_blocks - 1) * kBlock && N <= num_blocks * kBlock, "N=", N, " does not fit ", num_blocks,
              " blocks");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == N, "scale: float32 [N]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N, "bias: float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool widen_once = M >= kScratchRows;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(widen_once ? K * kBlock : 0);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int8_t* block = wp + nb * K * kBlock;
      const int64_t n0 = nb * kBlock, valid = std::min<int64_t>(kBlock, N - n0);
      if (widen_once) {
        for (int64_t i = 0; i < K * kBlock; i += 16) _mm512_storeu_ps(scratch.data() + i, widen(block + i));
        rows_against_block<float>(xp, M, K, scratch.data(), yp, N, n0, valid, sp, bias_ptr);
      } else {
        rows_against_block<int8_t>(xp, M, K, block, yp, N, n0, valid, sp, bias_ptr);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
