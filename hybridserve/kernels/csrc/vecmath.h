// Vectorizable float32 math shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// exp(x) without a libm call, so that loops over it vectorize: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p the degree-6 Taylor polynomial (relative error < 2e-7). Inputs are clamped to
// [-87.3, 88.7]: below, the result is ~1e-38 instead of a subnormal or 0.
inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float silu(float x) { return x / (1.0f + exp_f32(-x)); }

#if defined(__AVX512F__)
// exp_f32 (vecmath.h) on 16 lanes, with the same operations in the same order (no fused multiply-adds).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), _mm512_min_ps(x, _mm512_set1_ps(88.7f)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.42860682030941723e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  constexpr float kCoeffs[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  for (const float c : kCoeffs) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// silu on 16 lanes, as silu() lane by lane.
inline __m512 silu16(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#endif

}  // namespace
