// Fused element-wise CPU kernels: RMSNorm with the residual add before it, rotary embedding
// fused with the KV-cache write, and SiLU-and-multiply.
//
// Each replaces a chain of torch ops (kernels/reference.py) that reads and writes the whole
// activation once per op and pays the dispatcher per op: a decode step of the bench model ran
// about 1,000 small ops, most of them these chains. Every kernel makes one pass per row and
// rounds where the reference rounds (a bf16 sum, a bf16 normed value), so bf16
// and fp16 results equal the reference's up to the order of float additions; the arithmetic
// itself is float32 for every dtype, as in the references. SiLU-and-multiply's exp is
// vec_math.h's (glibc's expf made a fused loop 2.5x slower than torch's two ops).
//
// Rows are split across threads (thread_pool.h's parallel_for) only when there are enough of
// them to pay for it (kGrainElements per task); a decode step's few rows run on the calling
// thread.
//
// Built on first use by kernels/cpu_ops.py together with cpu_paged_decode_attention.cpp, which
// defines the baton_cpu library these ops join.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "op_library.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "vec_math.h"

namespace {

constexpr int64_t kGrainElements = 1 << 16;

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

using baton_cpu::from_float;
using baton_cpu::raw;
using baton_cpu::round_to;
using baton_cpu::to_float;

template <typename scalar_t>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor* residual,
                   at::Tensor& out, at::Tensor* residual_out) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const auto* xp = raw(x.data_ptr<scalar_t>());
  const auto* wp = raw(weight.data_ptr<scalar_t>());
  const auto* rp = residual ? raw(residual->data_ptr<scalar_t>()) : nullptr;
  auto* op = raw(out.data_ptr<scalar_t>());
  auto* rop = residual_out ? raw(residual_out->data_ptr<scalar_t>()) : nullptr;
  const float feps = static_cast<float>(eps);
  baton::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* xr = xp + r * H;
      const auto* src = xr;  // what is normed: x, or x + residual in x's dtype
      float sum_sq = 0.f;
      if (rp != nullptr) {
        const auto* rr = rp + r * H;
        auto* ro = rop + r * H;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < H; ++i) {
          const auto s = from_float<scalar_t>(to_float<scalar_t>(xr[i]) + to_float<scalar_t>(rr[i]));
          ro[i] = s;
          const float v = to_float<scalar_t>(s);
          sum_sq += v * v;
        }
        src = ro;
      } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < H; ++i) {
          const float v = to_float<scalar_t>(xr[i]);
          sum_sq += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(H) + feps);
      auto* o = op + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) {
        const float normed = round_to<scalar_t>(to_float<scalar_t>(src[i]) * inv);
        o[i] = from_float<scalar_t>(to_float<scalar_t>(wp[i]) * normed);
      }
    }
  });
}

// (normed, new residual): with a residual, normed = norm(x + residual) and the new residual
// is x + residual; without one, the second result is an empty tensor.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm needs a contiguous CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(), "rms_norm: weight of ",
              weight.sizes(), " for rows of ", x.size(-1));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: the residual must be contiguous, of x's shape and dtype");
  }
  auto out = at::empty_like(x);
  at::Tensor residual_out = residual ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, weight, eps, residual ? &*residual : nullptr, out,
                            residual ? &residual_out : nullptr);
  });
  return {out, residual_out};
}

template <typename scalar_t>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t I = out.size(-1), rows = out.numel() / std::max<int64_t>(1, I);
  const auto* xp = raw(x.data_ptr<scalar_t>());
  auto* op = raw(out.data_ptr<scalar_t>());
  baton::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* __restrict__ gate = xp + r * 2 * I;
      const auto* __restrict__ up = gate + I;
      auto* __restrict__ o = op + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float g = to_float<scalar_t>(gate[i]);
        const float silu = round_to<scalar_t>(g / (1.f + baton_cpu::exp_approx(-g)));
        o[i] = from_float<scalar_t>(silu * to_float<scalar_t>(up[i]));
      }
    }
  });
}

// [..., 2I] (gate, then up) -> silu(gate) * up [..., I], rounding silu(gate) to x's dtype
// before the product as the reference does.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "silu_and_mul needs a contiguous CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: the last dimension (", x.size(-1),
              ") must hold gate and up halves");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_rows<scalar_t>(x, out); });
  return out;
}

// Neox-style rotation of one head's [D] values with this position's cos/sin halves; the
// rotated values, rounded to x's dtype, are copied to copy_to in the cache's.
template <typename scalar_t, typename cache_t>
inline void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half, cache_t* copy_to) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const scalar_t a = static_cast<scalar_t>(x1 * cos[i] - x2 * sin[i]);
    const scalar_t b = static_cast<scalar_t>(x2 * cos[i] + x1 * sin[i]);
    x[i] = a;
    x[i + half] = b;
    if (copy_to != nullptr) {
      copy_to[i] = static_cast<cache_t>(a);
      copy_to[i + half] = static_cast<cache_t>(b);
    }
  }
}

template <typename scalar_t, typename cache_t>
void rope_and_cache_rows(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& cos_sin_cache, at::Tensor& key_cache, at::Tensor& value_cache,
                         const at::Tensor& slot_mapping) {
  const int64_t T = query.size(0), H = query.size(1), Hkv = key.size(1), D = query.size(2), half = D / 2;
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t k_row = key.stride(0), k_head = key.stride(1);
  const int64_t v_row = value.stride(0), v_head = value.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cs = cos_sin_cache.data_ptr<float>();
  const int64_t cs_row = cos_sin_cache.size(1);
  scalar_t* qp = query.data_ptr<scalar_t>();
  scalar_t* kp = key.data_ptr<scalar_t>();
  const scalar_t* vp = value.data_ptr<scalar_t>();
  cache_t* kc = key_cache.data_ptr<cache_t>();
  cache_t* vc = value_cache.data_ptr<cache_t>();
  const int64_t slot_stride = Hkv * D;  // a cache slot: one token's K (or V), every KV head
  baton::parallel_for(0, T, grain_rows((H + 2 * Hkv) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cs + pos[t] * cs_row;
      const float* sin = cos + half;
      for (int64_t h = 0; h < H; ++h)
        rotate_head<scalar_t, cache_t>(qp + t * q_row + h * q_head, cos, sin, half, nullptr);
      const int64_t slot = slots[t];  // -1: padding, not cached
      for (int64_t h = 0; h < Hkv; ++h) {
        cache_t* dst = slot >= 0 ? kc + slot * slot_stride + h * D : nullptr;
        rotate_head<scalar_t, cache_t>(kp + t * k_row + h * k_head, cos, sin, half, dst);
      }
      if (slot >= 0) {
        for (int64_t h = 0; h < Hkv; ++h) {
          const scalar_t* src = vp + t * v_row + h * v_head;
          cache_t* dst = vc + slot * slot_stride + h * D;
          if constexpr (std::is_same_v<scalar_t, cache_t>)
            std::copy(src, src + D, dst);
          else
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<cache_t>(static_cast<float>(src[d]));
        }
      }
    }
  });
}

// Rotates query [T, H, D] and key [T, H_kv, D] in place by their positions (cos_sin_cache
// [max_pos, D] float32: cos in the first half, sin in the second), and writes each token's
// rotated key and its value into the caches ([N, B, H_kv, D]) at its slot.
void rotary_embedding_and_cache(const at::Tensor& positions, at::Tensor query, at::Tensor key,
                                const at::Tensor& value, const at::Tensor& cos_sin_cache, at::Tensor key_cache,
                                at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query, key and value must be [T, H, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "rotary_embedding_and_cache needs each head's values contiguous");
  TORCH_CHECK(key.sizes() == value.sizes() && query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "query ", query.sizes(), ", key ", key.sizes(), " and value ", value.sizes(), " do not match");
  TORCH_CHECK(query.size(2) % 2 == 0 && cos_sin_cache.size(1) == query.size(2), "cos_sin_cache of ",
              cos_sin_cache.sizes(), " for heads of ", query.size(2));
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous float32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.dim() == 4 && key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "the caches must be contiguous [N, B, H_kv, D] for keys of ", key.sizes());
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "the key and value caches differ in dtype");
  // a float32 model may keep a bfloat16 cache (kv_cache_dtype "bfloat16")
  const bool bf16_cache = query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() || bf16_cache, "the caches must have the query's dtype (",
              query.scalar_type(), ") or, for a float32 query, bfloat16; got ", key_cache.scalar_type());
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == query.size(0) &&
                  slot_mapping.numel() == query.size(0),
              "positions and slot_mapping must be contiguous int64 with one entry per token");
  if (bf16_cache) {
    rope_and_cache_rows<float, at::BFloat16>(positions, query, key, value, cos_sin_cache, key_cache, value_cache,
                                             slot_mapping);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "rotary_embedding_and_cache", [&] {
    rope_and_cache_rows<scalar_t, scalar_t>(positions, query, key, value, cos_sin_cache, key_cache, value_cache,
                                            slot_mapping);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BATON_CPU_LIB, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
        "Tensor cos_sin_cache, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(BATON_CPU_LIB, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding_and_cache", &rotary_embedding_and_cache);
}
