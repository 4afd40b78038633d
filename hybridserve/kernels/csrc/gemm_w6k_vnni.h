// Q6_K weights times activations quantized to int8 per super-block of 256 k, the sums exact in int32 (few-row
// calls, kW6kA8MaxRows): on AVX-512 VNNI at the avx512_bf16 and amx levels, on AVX2's vpmaddubsw / vpmaddwd at the
// avx2 and avx512 levels (gemm_w6k_avx2.h). Included by gemm_w6k.h (W6kLayout, w6k_quad, for_row_tiles,
// store_vec, widen_scalar; load8 from gemm_w4a8.h).
// The reference, step for step: ops/linear_w6k.py: linear_w6k_a8_ref.
//
// Activations. Each row is cut into super-blocks of 256 k, each quantized as ops/linear_w8.py: quantize_rows_int8
// quantizes a row: s = max|x| / 127 (1 for a block of zeros), code = nearest-even(x * (127 / max|x|)) clamped to
// [-127, 127]; with it each 16-k sub-block's sum of codes xsum. The codes stay in k order: a quad of 4 k is one
// broadcast 32-bit load.
//
// Sums. Per sub-block g and column, on vpdpbusd (codes q unsigned 0..63, xq signed), starting from -32 xsum:
//   isum_g = sum_k q xq - 32 xsum_g = sum_k (q - 32) xq        (|isum_g| <= 16 32 127)
//   t = sum_g sc_g isum_g over the super-block                   (|t| <= 16 128 16 32 127 < 2^31: exact)
// Per super-block, in float32, each step rounded on its own (no fused multiply-add, as the reference):
//   acc = acc + float(t) * (d * s), then y = acc + bias rounded to the activation dtype.
// So the outputs are the reference's bit for bit, and a row's output depends on its own values only.
#pragma once

// (a test build of the 8-lane vectors, HS_VECTOR_LANES, takes the AVX2 sums, as gemm_w4a8.h does)
#if HS_HAVE_W4A8
#define HS_HAVE_W6K_A8 1

namespace {

constexpr int64_t kW6kA8MaxRows = 15;  // rows up to which calls run on int8 activations (< kW6kAmxRows)
static_assert(kW6kA8MaxRows < kW6kAmxRows, "the AMX tiles take the calls the int8 path leaves");

// The quantized rows of one call: codes (M rows of K), super-block scales (M rows of KB), sub-block code sums
// times -32 (M rows of K / 16).
struct W6kA8Rows {
  const int8_t* codes;
  const float* scales;
  const int32_t* offsets;
  int64_t KB;
};

// Row x (K values) quantized into codes, scales (one per 256 k) and offsets (-32 times each 16 k's code sum).
template <typename A>
void w6k_quantize_row(int64_t K, const A* x, int8_t* codes, float* scales, int32_t* offsets) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0, k0 = 0; k0 < K; ++b, k0 += kW6kSuper) {
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + kW6kSuper; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8(x + k), magnitude));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.0f;
    for (float a : lanes) amax = a > amax ? a : amax;
    scales[b] = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);  // codes are x * (127 / max|x|)
    for (int64_t k = k0; k < k0 + kW6kSuper; k += 16) {
      __m256i c[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + k + 8 * h), inv));
        c[h] = _mm256_max_epi32(_mm256_min_epi32(n, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(c[h]), _mm256_extracti128_si256(c[h], 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + k + 8 * h), _mm_packs_epi16(words, words));  // in range
      }
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), _mm256_add_epi32(c[0], c[1]));
      int32_t sum = 0;
      for (int32_t v : parts) sum += v;
      offsets[k / 16] = -32 * sum;
    }
  }
}

#if HS_HAVE_W4A8_VNNI
constexpr int kW6kA8TileRows = 4;  // rows of a tile

// Panels of a tile of MR rows: 3 x MR x NP sums (float32 total, super-block and sub-block int32), the panel's three
// code vectors, a quad and its sub-scales in the registers (the rows' 5 broadcasts per sub-block besides, or on the
// stack).
constexpr int w6k_a8_panels(int MR) {
  const int np = 24 / (3 * MR);
  return np < 1 ? 1 : (np > 8 ? 8 : np);
}

// out[r, n0 + c] for MR rows and NP panels from panel p0; xs: the codes' row stride.
template <int MR, int NP, typename A>
__attribute__((optimize("fp-contract=off"))) void w6k_a8_tile(const W6kLayout& L, int64_t p0, const W6kA8Rows& xr,
                                                              int64_t xs, const A* bias, A* out, int64_t os,
                                                              int64_t n0, int64_t N) {
  vf acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vf{};
  for (int64_t b = 0; b < L.KB; ++b) {
    __m512i t[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) t[r][p] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = b * kW6kSuper + g * 16;
      __m512i xb[MR][5];  // each row's 4 quads of activation codes and its -32 x sum, broadcast once for the panels
      for (int r = 0; r < MR; ++r) {
        int32_t quads[4];
        __builtin_memcpy(quads, xr.codes + r * xs + k0, sizeof quads);
        for (int j = 0; j < 4; ++j) xb[r][j] = _mm512_set1_epi32(quads[j]);
        xb[r][4] = _mm512_set1_epi32(xr.offsets[r * (xs / 16) + k0 / 16]);
      }
      for (int p = 0; p < NP; ++p) {
        const uint8_t* blk = L.block(p0 + p, b);
        const uint8_t* sub = blk + g * kW6kSubBytes;
        _mm_prefetch(reinterpret_cast<const char*>(sub + 6 * kW6kSubBytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sub + 6 * kW6kSubBytes + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sub + 6 * kW6kSubBytes + 128), _MM_HINT_T0);
        const vu lo01 = load_vec<vu>(sub), lo23 = load_vec<vu>(sub + 64), hi = load_vec<vu>(sub + 128);
        const __m512i q0 = reinterpret_cast<__m512i>(w6k_quad<0>(lo01, lo23, hi));
        const __m512i q1 = reinterpret_cast<__m512i>(w6k_quad<1>(lo01, lo23, hi));
        const __m512i q2 = reinterpret_cast<__m512i>(w6k_quad<2>(lo01, lo23, hi));
        const __m512i q3 = reinterpret_cast<__m512i>(w6k_quad<3>(lo01, lo23, hi));
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kW6kScaleAt + g * kPanel)));
        for (int r = 0; r < MR; ++r) {
          __m512i isum = _mm512_dpbusd_epi32(xb[r][4], q0, xb[r][0]);
          isum = _mm512_dpbusd_epi32(isum, q1, xb[r][1]);
          isum = _mm512_dpbusd_epi32(isum, q2, xb[r][2]);
          isum = _mm512_dpbusd_epi32(isum, q3, xb[r][3]);
          t[r][p] = _mm512_add_epi32(t[r][p], _mm512_mullo_epi32(isum, sc));
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const vf d = widen_halfs(reinterpret_cast<const _Float16*>(L.block(p0 + p, b) + kW6kDAt));
      for (int r = 0; r < MR; ++r) {
        const vf ds = d * xr.scales[r * xr.KB + b];
        acc[r][p] = acc[r][p] + __builtin_convertvector(reinterpret_cast<vi32>(t[r][p]), vf) * ds;
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t col = n0 + p * kPanel;
    const int valid = static_cast<int>(N - col < kPanel ? N - col : kPanel);
    if (valid <= 0) break;
    vf bv = vf{};
    if (bias != nullptr)
      for (int i = 0; i < valid; ++i) bv[i] = widen_scalar(bias[col + i]);
    for (int r = 0; r < MR; ++r) store_vec(out + r * os + col, acc[r][p] + bv, valid);
  }
}

#else
#include "gemm_w6k_avx2.h"  // w6k_a8_tile on AVX2 integer vectors
#endif

template <int MR, int NP, typename A>
void w6k_a8_tile_any(int np, const W6kLayout& L, int64_t p0, const W6kA8Rows& xr, int64_t xs, const A* bias, A* out,
                     int64_t os, int64_t n0, int64_t N) {
  if constexpr (NP > 1) {
    if (np < NP) return w6k_a8_tile_any<MR, NP - 1>(np, L, p0, xr, xs, bias, out, os, n0, N);
  }
  w6k_a8_tile<MR, NP>(L, p0, xr, xs, bias, out, os, n0, N);
}

template <typename A, int MR>
void w6k_a8_rows(int np, const W6kLayout& L, int64_t p0, const W6kA8Rows& xr, int64_t xs, const A* bias, A* out,
                 int64_t os, int64_t n0, int64_t N) {
  w6k_a8_tile_any<MR, w6k_a8_panels(MR)>(np, L, p0, xr, xs, bias, out, os, n0, N);
}

template <typename A>
using W6kA8RowsFn = void (*)(int, const W6kLayout&, int64_t, const W6kA8Rows&, int64_t, const A*, A*, int64_t,
                             int64_t, int64_t);

template <typename A, int... R>
constexpr auto w6k_a8_rows_table(std::integer_sequence<int, R...>) {
  return std::array<W6kA8RowsFn<A>, sizeof...(R)>{w6k_a8_rows<A, R + 1>...};
}

// out (M, N) = x (M, K) @ W.T + bias on int8 activations, M <= kW6kA8MaxRows.
template <typename A>
int w6k_a8_linear(int64_t M, int64_t N, int64_t K, const W6kLayout& L, const A* x, int64_t xs, const A* bias, A* out,
                  int64_t os) {
  static thread_local std::vector<int8_t> codes;     // (M, K)
  static thread_local std::vector<float> scales;     // (M, KB)
  static thread_local std::vector<int32_t> offsets;  // (M, K / 16)
  if (static_cast<int64_t>(codes.size()) < M * K) codes.resize(M * K), offsets.resize(M * K / 16);
  if (static_cast<int64_t>(scales.size()) < M * L.KB) scales.resize(M * L.KB);
  for (int64_t r = 0; r < M; ++r)
    w6k_quantize_row(K, x + r * xs, codes.data() + r * K, scales.data() + r * L.KB, offsets.data() + r * (K / 16));
  // (the thread_local vectors are this thread's: their addresses, taken here, are what the region's threads read)
  const W6kA8Rows rows{codes.data(), scales.data(), offsets.data(), L.KB};
  static constexpr auto table = w6k_a8_rows_table<A>(std::make_integer_sequence<int, kW6kA8TileRows>{});
  for_row_tiles(M, N, K, K / 4, kW6kA8TileRows, L.panels,
                w6k_a8_panels(M >= kW6kA8TileRows ? kW6kA8TileRows : static_cast<int>(M)),
                [&](int64_t p0, int np, int64_t m0, int mr) {
                  const W6kA8Rows tile{rows.codes + m0 * K, rows.scales + m0 * L.KB, rows.offsets + m0 * (K / 16), L.KB};
                  table[mr - 1](np, L, p0, tile, K, bias, out + m0 * os, os, p0 * kPanel, N);
                });
  return 0;
}

}  // namespace

#else
#define HS_HAVE_W6K_A8 0
#endif
