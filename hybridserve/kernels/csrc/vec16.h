// 16-float vectors (GCC vector extensions: AVX-512 registers where the CPU has them, pairs or
// quads of narrower ones elsewhere) and loads that convert each storage dtype to them.
#pragma once

#include <cstdint>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dtypes.h"

namespace {

typedef float v16f __attribute__((vector_size(64), aligned(4)));        // no alignment assumed
typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef _Float16 v16h __attribute__((vector_size(32), aligned(2)));

inline v16f load16(const float* p) { return *reinterpret_cast<const v16f*>(p); }
// fp16 on F16C's vcvtph2ps where the build has it (GCC 12 converts _Float16 vectors one lane at a time).
inline v16f load16(const _Float16* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<const v16f&>(v);
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  v16f v;
  __builtin_memcpy(&v, &lo, sizeof lo);
  __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
#else
  return __builtin_convertvector(*reinterpret_cast<const v16h*>(p), v16f);
#endif
}
inline v16f load16(const BF16* p) {
  const v16u32 bits = __builtin_convertvector(*reinterpret_cast<const v16u16*>(p), v16u32) << 16;
  return reinterpret_cast<const v16f&>(bits);
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// The widest float vector the build's ISA holds in one register: GCC spills 16-float vectors to the
// stack on AVX2 and below, so loops that only need some vector width (no 16-lane shuffles) use this.
#if defined(HS_VECTOR_LANES)  // a test build: the other width's code on this CPU (kernels/test_isa.py)
constexpr int kNativeLanes = HS_VECTOR_LANES;
#elif defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#else
constexpr int kNativeLanes = 8;
#endif
typedef float vnf __attribute__((vector_size(4 * kNativeLanes), aligned(4)));
typedef uint16_t vnu16 __attribute__((vector_size(2 * kNativeLanes), aligned(2)));
typedef uint32_t vnu32 __attribute__((vector_size(4 * kNativeLanes)));
typedef _Float16 vnh __attribute__((vector_size(2 * kNativeLanes), aligned(2)));

// kNativeLanes values of each storage dtype as float32 (as load16, a native vector at a time).
inline vnf loadn(const float* p) { return *reinterpret_cast<const vnf*>(p); }
inline vnf loadn(const _Float16* p) {
#if defined(__AVX512F__)
  if constexpr (kNativeLanes == 16) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<const vnf&>(v);
  }
#endif
#if defined(__F16C__)
  if constexpr (kNativeLanes == 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<const vnf&>(v);
  }
#endif
  return __builtin_convertvector(*reinterpret_cast<const vnh*>(p), vnf);
}
inline vnf loadn(const BF16* p) {
  const vnu32 bits = __builtin_convertvector(*reinterpret_cast<const vnu16*>(p), vnu32) << 16;
  return reinterpret_cast<const vnf&>(bits);
}

inline float hsum(v16f v) {  // pairwise: 16 -> 8 -> 4 -> 1
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The sums of 16 vectors at once: element i of the result is hsum(s[i]). A transpose-and-add tree
// (8 + 4 + 2 + 1 vector adds with their shuffles) instead of 16 horizontal sums.
inline v16f hsum16x16(const v16f* s) {
  v16f r[8], q[4], u[2];
  for (int k = 0; k < 8; ++k) {  // per 4-lane group: [a0+a2, b0+b2, a1+a3, b1+b3]
    const v16f a = s[2 * k], b = s[2 * k + 1];
    r[k] = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
           __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  for (int k = 0; k < 4; ++k) {  // per 4-lane group g: the group-g sums of four vectors
    const v16f a = r[2 * k], b = r[2 * k + 1];
    q[k] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int k = 0; k < 2; ++k) {  // groups 0+1 and 2+3 of two such vectors
    const v16f a = q[2 * k], b = q[2 * k + 1];
    u[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}

#if defined(__AVX512F__)
// AVX-512 loads of 16 values of each storage dtype as float32, and stores with the rounding of
// from_f32 (nearest even; NaN -> the canonical bf16 NaN).
inline __m512 load16_ps(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_ps(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16_ps(const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16_ps(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16_ps(BF16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
// v rounded to the storage dtype T and back to float32 (what store16_ps then load16_ps would give).
template <typename T> inline __m512 round16_ps(__m512 v);
template <> inline __m512 round16_ps<float>(__m512 v) { return v; }
template <> inline __m512 round16_ps<BF16>(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                               _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}
template <> inline __m512 round16_ps<_Float16>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16_ps(_Float16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace
