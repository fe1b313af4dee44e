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

#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace baton_cpu
