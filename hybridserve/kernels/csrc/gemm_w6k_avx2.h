// The Q6_K int8-activation tile on AVX2 integer vectors (the avx2 and avx512 levels, and the 8-lane test builds):
// the same exact int32 sums as the AVX-512 VNNI tile of gemm_w6k_vnni.h, hence the same outputs bit for bit.
// Included by gemm_w6k_vnni.h (W6kA8Rows, W6kLayout, w6k_quad; w4a8_store8 from gemm_w4a8_avx2.h).
//
// vpmaddubsw multiplies the unsigned 6-bit code bytes by the signed activation codes and adds adjacent products
// into int16 lanes (|sum| <= 2 x 63 x 127 = 16002); two quads' such sums add in int16 without overflow (32004 <
// 2^15), and vpmaddwd by ones widens them into int32. A panel is two 8-column vectors; the float32 epilogue is
// gemm_w6k_vnni.h's, step for step.
#pragma once

#include <cstring>

constexpr int kW6kA8TileRows = 2;  // rows of a tile: 2 rows x 2 vectors of sums, the codes and the broadcasts
constexpr int w6k_a8_panels(int) { return 1; }

typedef uint32_t w6k_v8u __attribute__((vector_size(32)));  // one 8-column half of a sub-block vector

// out[r, n0 + c] for MR rows and one panel (NP = 1) from panel p0; xs: the codes' row stride.
template <int MR, int NP, typename A>
__attribute__((optimize("fp-contract=off"))) void w6k_a8_tile(const W6kLayout& L, int64_t p0, const W6kA8Rows& xr,
                                                              int64_t xs, const A* bias, A* out, int64_t os,
                                                              int64_t n0, int64_t N) {
  static_assert(NP == 1, "the AVX2 tile takes one panel");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < L.KB; ++b) {
    const uint8_t* blk = L.block(p0, b);
    __m256i t[MR][2];
    for (int r = 0; r < MR; ++r) t[r][0] = t[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = b * kW6kSuper + g * 16;
      const uint8_t* sub = blk + g * kW6kSubBytes;
      _mm_prefetch(reinterpret_cast<const char*>(sub + 6 * kW6kSubBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sub + 6 * kW6kSubBytes + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sub + 6 * kW6kSubBytes + 128), _MM_HINT_T0);
      for (int v = 0; v < 2; ++v) {
        w6k_v8u lo01, lo23, hi;
        std::memcpy(&lo01, sub + 32 * v, 32);
        std::memcpy(&lo23, sub + 64 + 32 * v, 32);
        std::memcpy(&hi, sub + 128 + 32 * v, 32);
        const __m256i q0 = reinterpret_cast<__m256i>(w6k_quad<0>(lo01, lo23, hi));
        const __m256i q1 = reinterpret_cast<__m256i>(w6k_quad<1>(lo01, lo23, hi));
        const __m256i q2 = reinterpret_cast<__m256i>(w6k_quad<2>(lo01, lo23, hi));
        const __m256i q3 = reinterpret_cast<__m256i>(w6k_quad<3>(lo01, lo23, hi));
        const __m256i sc = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + kW6kScaleAt + g * kPanel + 8 * v)));
        for (int r = 0; r < MR; ++r) {
          int32_t quads[4];
          std::memcpy(quads, xr.codes + r * xs + k0, sizeof quads);
          const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, _mm256_set1_epi32(quads[0])),
                                               _mm256_maddubs_epi16(q1, _mm256_set1_epi32(quads[1])));
          const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q2, _mm256_set1_epi32(quads[2])),
                                               _mm256_maddubs_epi16(q3, _mm256_set1_epi32(quads[3])));
          const __m256i isum = _mm256_add_epi32(
              _mm256_set1_epi32(xr.offsets[r * (xs / 16) + k0 / 16]),
              _mm256_add_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones)));
          t[r][v] = _mm256_add_epi32(t[r][v], _mm256_mullo_epi32(isum, sc));
        }
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kW6kDAt + 16 * v)));
      for (int r = 0; r < MR; ++r) {
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(xr.scales[r * xr.KB + b]));
        acc[r][v] = _mm256_add_ps(acc[r][v], _mm256_mul_ps(_mm256_cvtepi32_ps(t[r][v]), ds));
      }
    }
  }
  for (int v = 0; v < 2; ++v) {
    const int64_t col = n0 + 8 * v;
    const int valid = static_cast<int>(N - col < 8 ? N - col : 8);
    if (valid <= 0) break;
    for (int r = 0; r < MR; ++r) w4a8_store8(out + r * os, acc[r][v], bias, col, valid);
  }
}
