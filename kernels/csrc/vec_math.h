// Vectorizable float math for the CPU kernels.
//
// glibc's expf is a scalar call that gcc does not vectorize here (libmvec needs
// -ffinite-math-only, and the online softmax needs -inf), so a softmax or a SiLU over a
// row ran one expf at a time. `exp_approx` is branch-free arithmetic that a `#pragma omp
// simd` loop turns into vector instructions: 2^(x log2 e) split into an integer power of
// two (built in the exponent bits) and 2^f for f in [-0.5, 0.5] (a degree-7 Taylor
// polynomial, relative error below 2e-7, about float32's rounding). Inputs below -87.3
// give ~1e-38 instead of 0 and inputs above 88.7 give ~3e38 instead of inf; callers use
// it where those tails cannot matter (a softmax after subtracting the max, a sigmoid).
//
// `to_float` / `from_float` convert a tensor's element type to and from float32. For
// bfloat16 they are the bit operations themselves: c10::BFloat16's own conversion from float
// checks for NaN with a branch, which kept a fused SiLU loop scalar and 5x slower than torch.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace baton_cpu {

#pragma omp declare simd notinbranch
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float t = x * 1.44269504088896341f;
  const float n = __builtin_rintf(t);
  const float f = (t - n) * 0.693147180559945309f;  // e^f = 2^(t - n), |f| <= ln2 / 2
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// A tensor element as the kernels read and write it: bfloat16 as its raw bits (a struct's
// loads and stores kept loops scalar), every other type as itself.
template <typename scalar_t>
using raw_t = std::conditional_t<std::is_same_v<scalar_t, c10::BFloat16>, uint16_t, scalar_t>;

template <typename scalar_t>
inline const raw_t<scalar_t>* raw(const scalar_t* p) {
  return reinterpret_cast<const raw_t<scalar_t>*>(p);
}

template <typename scalar_t>
inline raw_t<scalar_t>* raw(scalar_t* p) {
  return reinterpret_cast<raw_t<scalar_t>*>(p);
}

template <typename scalar_t>
inline float to_float(raw_t<scalar_t> v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(v);
  }
}

// Rounds to nearest even, as c10::BFloat16 does; NaN stays NaN.
template <typename scalar_t>
inline raw_t<scalar_t> from_float(float f) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
  } else {
    return static_cast<scalar_t>(f);
  }
}

// float32 -> scalar_t -> float32: where a reference stores an intermediate in the tensor's
// dtype (a no-op for float32).
template <typename scalar_t>
inline float round_to(float v) {
  return to_float<scalar_t>(from_float<scalar_t>(v));
}

}  // namespace baton_cpu
