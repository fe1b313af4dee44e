// The vector operations of cpu_paged_prefill_attention.cpp, on a zmm of 16 lanes (AVX-512)
// or a ymm of 8 (AVX2): the same algorithm with tiles half as tall. That file includes this
// one inside its anonymous namespace, after <immintrin.h> and vec_math.h, where it defines
// BATON_PREFILL_KERNEL; it is not a header to include anywhere else.

#pragma once

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // rows per tile, and keys per chunk
using vfloat = __m512;
using vint = __m512i;
using vmask = __mmask16;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_load_ps(p); }
inline vfloat vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_store_ps(p, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vint vload_int(const int32_t* p) { return _mm512_load_si512(p); }
// Lanes whose position is at least `pos`.
inline vmask at_least(vint positions, int32_t pos) { return _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32(pos)); }
inline vmask no_lanes() { return 0; }
inline vfloat max_where(vmask m, vfloat a, vfloat b) { return _mm512_mask_max_ps(a, m, a, b); }
inline vfloat zero_unless(vmask m, vfloat a) { return _mm512_maskz_mov_ps(m, a); }
// Output columns per pass of the weighted-values loop over a task's NT tiles (kColumns / NT
// each): its accumulators, NT row vectors and a broadcast fit the 32 registers.
constexpr int kColumns = 16;

inline vfloat vclamp(vfloat x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset(lo)), vset(hi)); }
inline vfloat vround(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat times_pow2(vfloat p, vfloat n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
#elif defined(BATON_PREFILL_KERNEL)
constexpr int kLanes = 8;
using vfloat = __m256;
using vint = __m256i;
using vmask = __m256;  // all ones in the lanes it holds
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_load_ps(p); }
inline vfloat vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm256_store_ps(p, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vint vload_int(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline vmask at_least(vint positions, int32_t pos) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(positions, _mm256_set1_epi32(pos - 1)));
}
inline vmask no_lanes() { return _mm256_setzero_ps(); }
inline vfloat max_where(vmask m, vfloat a, vfloat b) { return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m); }
inline vfloat zero_unless(vmask m, vfloat a) { return _mm256_and_ps(m, a); }
constexpr int kColumns = 8;  // with NT row vectors and a broadcast, within the 16 registers

inline vfloat vclamp(vfloat x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset(lo)), vset(hi)); }
inline vfloat vround(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n, n integral in [-126, 127] (vexp's clamp): 2^n built in the exponent bits.
inline vfloat times_pow2(vfloat p, vfloat n) {
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
#endif

#if defined(BATON_PREFILL_KERNEL)
// vec_math.h's exp_approx, a vector at a time (the same polynomial; clamped so that the
// power of two stays a normal float).
inline vfloat vexp(vfloat x) {
  const vfloat t = vclamp(x, -87.3f, 88.3f) * vset(1.44269504088896341f);
  const vfloat n = vround(t);
  const vfloat f = (t - n) * vset(0.693147180559945309f);
  vfloat p = vset(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = vfma(p, f, vset(c));
  return times_pow2(p, n);
}

// Keeps a vector that a loop reuses in a register. Without it GCC folds the vector's load into
// every FMA that reads it (a memory operand), and one load per FMA beside the broadcasts makes
// the loop wait on loads: without it the kernel takes 1.15x as long (an AMD EPYC Zen 4, four
// tiles a task), and the weighted-values loop ran at two thirds of the score loop's speed.
inline void in_register(vfloat& v) { asm volatile("" : "+v"(v)); }
#endif  // BATON_PREFILL_KERNEL
