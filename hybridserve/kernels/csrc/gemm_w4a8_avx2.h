// The W4A8 sums on AVX2 integer vectors (the avx2 and avx512 levels, and the 8-lane test builds): the same exact
// int32 sums as the AVX-512 VNNI ones of gemm_w4a8.h, hence the same outputs bit for bit. Included by gemm_w4a8.h
// (W4a8Rows, the activation codes in the nibble order).
//
// vpmaddubsw multiplies the unsigned nibble bytes by the signed activation codes and adds adjacent products into
// int16 lanes; the even and odd quads of one 8-k word add to 4 products per lane, |sum| <= 4 x 15 x 127 = 7620, so
// kW4a8Int16Words words sum in int16 without overflow (30480 < 2^15) before vpmaddwd by ones widens the int16 pairs
// into the int32 sums. A panel is two 8-column vectors; the float32 epilogue is gemm_w4a8.h's, step for step.
#pragma once

#include <cstring>

constexpr int kW4a8TileRows = 2;          // 2 rows x 2 vectors of int32 and int16 sums, the codes and broadcasts
constexpr int64_t kW4a8Int16Words = 4;    // 8-k words summed in int16 before widening

// The scales (or `mins`) of panel p, group g, as float32: columns 0-7 in half[0], 8-15 in half[1] (an 8-lane build
// reads each half as one vf; a 16-lane build reads the panel once and splits it).
inline void w4a8_halves(const W4Layout& L, int64_t p, int64_t g, bool mins, __m256 (&half)[2]) {
  if constexpr (kLanes == 8) {
    for (int v = 0; v < 2; ++v) {
      const vf s = mins ? L.min(p, g, v) : L.scale(p, g, v);
      half[v] = reinterpret_cast<const __m256&>(s);
    }
  } else {
    const vf s = mins ? L.min(p, g, 0) : L.scale(p, g, 0);
    alignas(64) float lanes[16];
    __builtin_memcpy(lanes, &s, sizeof lanes);
    half[0] = _mm256_load_ps(lanes);
    half[1] = _mm256_load_ps(lanes + 8);
  }
}

// Columns [col, col + valid) of one output row: 8 float32 sums plus the bias, each rounded once to A.
template <typename A>
inline void w4a8_store8(A* row, __m256 sums, const A* bias, int64_t col, int valid) {
  alignas(32) float y[8];
  _mm256_store_ps(y, sums);
  for (int i = 0; i < valid; ++i)
    w4a8_store_lane(row + col + i, y[i] + (bias != nullptr ? widen_scalar(bias[col + i]) : 0.0f));
}

// One group of MR rows over one panel p: its n 8-k steps from w (kPanel words each; GW > 0: n == GW), the group's
// first step w0: the exact int32 sums, then per row acc += v * s (acc: [MR][kW4BlockPanels][16] float32 from panel
// p's), as gemm_w4a8.h's.
template <int MR, bool Mins, int GW>
__attribute__((optimize("fp-contract=off"), always_inline)) inline void w4a8_panel(
    const uint32_t* w, int64_t n, int64_t w0, int64_t g, const W4a8Rows& xr, int64_t xs, const W4Layout& L, int64_t p,
    float* acc) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const int64_t steps = GW > 0 ? GW : n;
  __m256i isum[MR][2];
  for (int r = 0; r < MR; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
  for (int64_t c0 = 0; c0 < steps; c0 += kW4a8Int16Words) {
    __m256i part[MR][2];  // int16 sums of up to kW4a8Int16Words words
    for (int r = 0; r < MR; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
    for (int64_t i = c0; i < std::min(steps, c0 + kW4a8Int16Words); ++i) {
      const uint32_t* row = w + i * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + kW4AheadLines * kPanel), _MM_HINT_T0);
      for (int v = 0; v < 2; ++v) {
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8 * v));
        const __m256i even = _mm256_and_si256(words, low);                       // c0, c2, c4, c6
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(words, 4), low);  // c1, c3, c5, c7
        for (int r = 0; r < MR; ++r) {
          const int8_t* q = xr.codes + r * xs + (w0 + i) * 8;
          int32_t qe, qo;
          std::memcpy(&qe, q, 4);
          std::memcpy(&qo, q + 4, 4);
          const __m256i pe16 = _mm256_maddubs_epi16(even, _mm256_set1_epi32(qe));
          const __m256i po16 = _mm256_maddubs_epi16(odd, _mm256_set1_epi32(qo));
          part[r][v] = _mm256_add_epi16(part[r][v], _mm256_add_epi16(pe16, po16));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_madd_epi16(part[r][v], ones));
  }
  __m256 scale[2], min[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  w4a8_halves(L, p, g, false, scale);
  if constexpr (Mins) w4a8_halves(L, p, g, true, min);
  for (int v = 0; v < 2; ++v) {
    const __m256 s = scale[v];
    for (int r = 0; r < MR; ++r) {
      const __m256 sx = _mm256_set1_ps(xr.scales[r * xr.G + g]);
      const int32_t q = xr.sums[r * xr.G + g];
      __m256 val;
      if constexpr (Mins) {
        val = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][v]), s),
                            _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(q)), min[v]));
      } else {
        val = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r][v], _mm256_set1_epi32(8 * q))), s);
      }
      float* a = acc + r * kW4BlockPanels * kPanel + 8 * v;
      _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(val, sx)));
    }
  }
}
