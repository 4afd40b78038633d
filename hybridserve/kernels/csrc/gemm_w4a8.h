// W4A8: 4-bit group-wise weights times activations quantized to int8 per block of the weight's group, the sums
// exact in int32 (few-row calls, kW4a8MaxRows): on AVX-512 VNNI at the avx512_bf16 and amx levels, on AVX2's
// vpmaddubsw / vpmaddwd at the avx2 and avx512 levels (gemm_w4a8_avx2.h). Included by gemm_w4.h inside its
// anonymous namespace (W4Layout, for_row_tiles, store_vec, widen_scalar).
// The reference, step for step: ops/linear_w4.py: linear_w4a8_ref.
//
// Activations. Each row is cut into blocks of the weight's group (the last may be short), and each block is
// quantized as ops/linear_w8.py: quantize_rows_int8 quantizes a row: s = max|x| / 127 (1 for a block of zeros),
// code = nearest-even(x * (127 / max|x|)) clamped to [-127, 127]; with it the block's sum of codes q.
//
// Sums. A packed word holds the codes of k = 8 k8 .. 8 k8 + 7 of one column, k = 8 k8 + j in bits 4j .. 4j + 3,
// so `word & 0x0f0f0f0f` is the bytes (c0, c2, c4, c6) and `(word >> 4) & 0x0f0f0f0f` the bytes (c1, c3, c5,
// c7): vpdpbusd's unsigned operand for 16 columns at once, with no repacking. The activation codes are stored
// in that order (x0, x2, x4, x6, x1, x3, x5, x7 per 8 k), so each quad is one broadcast 32-bit load, and
//   isum = sum_k c[n, k] * xq[m, k]   over a group (exact: |isum| <= 15 * 127 * group < 2^31).
//
// Per group, in float32, each step rounded on its own (no fused multiply-add; the reference does the same):
//   centred codes:  v = float(isum - 8 q) * scale
//   with mins:      v = float(isum) * scale + float(q) * min
//   acc += v * s    (groups in order), then y = acc + bias rounded to the activation dtype.
// So the outputs are the reference's bit for bit, and a row's output depends on its own values only.
#pragma once

// (a test build of the 8-lane vectors, HS_VECTOR_LANES, takes the AVX2 sums)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && (!defined(HS_VECTOR_LANES) || HS_VECTOR_LANES == 16)
#define HS_HAVE_W4A8_VNNI 1
#else
#define HS_HAVE_W4A8_VNNI 0
#endif

#if HS_HAVE_W4A8_VNNI || (defined(__AVX2__) && defined(__F16C__))
#define HS_HAVE_W4A8 1

constexpr int64_t kW4a8MaxRows = 15;  // rows up to which calls run on W4A8, every activation dtype (< kW4AmxRows)
static_assert(kW4a8MaxRows < kW4AmxRows, "the AMX tiles take the calls W4A8 leaves");

// The quantized rows of one call: codes (M rows of K8 x 8 bytes in the nibble order above), block scales and
// block code sums (M rows of G each).
struct W4a8Rows {
  const int8_t* codes;
  const float* scales;
  const int32_t* sums;
  int64_t G;
};

// 8 activations as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline __m256 load8(const _Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Row x (K values) quantized into codes (nibble order), scales and sums (G blocks of gs k), 8 k at a time (K and
// gs are multiples of 8). The codes: x * (127 / max|x|) rounded by vcvtps2dq (nearest even), then clamped.
template <typename A>
void w4a8_quantize_row(int64_t K, int64_t gs, const A* x, int8_t* codes, float* scales, int32_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // k = 0, 2, 4, 6, 1, ..
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += gs) {
    const int64_t k1 = std::min(K, k0 + gs);
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8(x + k), magnitude));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.0f;
    for (float a : lanes) amax = a > amax ? a : amax;
    scales[g] = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);  // codes are x * (127 / max|x|)
    __m256i vsum = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 8) {
      const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + k), inv));
      const __m256i c = _mm256_max_epi32(_mm256_min_epi32(n, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
      vsum = _mm256_add_epi32(vsum, c);
      // the 8 codes as bytes in k order (in range: the packs do not saturate), then in the nibble order
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      const __m128i bytes = _mm_packs_epi16(words, words);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + k), _mm_shuffle_epi8(bytes, order));
    }
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), vsum);
    int32_t sum = 0;
    for (int32_t v : parts) sum += v;
    sums[g] = sum;
  }
}

// One output as A, rounded once (bf16: nearest even, as store_vec).
inline void w4a8_store_lane(float* out, float v) { *out = v; }
inline void w4a8_store_lane(_Float16* out, float v) { *out = static_cast<_Float16>(v); }
inline void w4a8_store_lane(uint16_t* out, float v) { *out = from_f32<BF16>(v).bits; }  // nearest even, as store_vec

#if HS_HAVE_W4A8_VNNI
// rows of a tile: 8 rows read the weights once (tiles of 4 ran 0.84-0.87x as fast at 8 rows, weights from memory)
constexpr int kW4a8TileRows = 8;
// Groups ahead whose scales (and mins) a tile requests. Each panel's scales and mins are streams of their own
// beside its words, 32 bytes a group each, which the hardware prefetchers follow poorly: requesting them 4 groups
// ahead streamed one-row calls at the ~1.3B layout's shapes 1.06x as fast without mins, and requesting the mins
// too 1.13x as fast again with them (AMD EPYC Zen 5, 2 threads, medians of 20 interleaved pairs of two builds in
// one process; the same bits).
constexpr int64_t kW4a8ScalesAhead = 4;

// One group of MR rows over one panel p: its n 8-k steps from w (kPanel words each; GW > 0: n == GW, the steps
// unrolled), the group's first step w0: the exact int32 sums, then per row acc += v * s (acc: [MR][kW4BlockPanels]
// [16] float32 from panel p's).
// Inlined into w4a8_tile, whose flags it then takes (so the tile carries the same fp-contract=off).
template <int MR, bool Mins, int GW>
__attribute__((optimize("fp-contract=off"), always_inline)) inline void w4a8_panel(
    const uint32_t* w, int64_t n, int64_t w0, int64_t g, const W4a8Rows& xr, int64_t xs, const W4Layout& L, int64_t p,
    float* acc) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const int64_t steps = GW > 0 ? GW : n;
  // one or two rows: four int32 sums a row (steps even and odd, codes even and odd), added at the end, so the
  // dependency chains are short (one chain a row ran one-row calls from cache 0.7x as fast); more rows give
  // independent chains of their own
  constexpr int C = MR <= 2 ? 4 : 1;
  __m512i part[MR][C];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < C; ++c) part[r][c] = _mm512_setzero_si512();
  for (int64_t i = 0; i < steps; ++i) {
    const uint32_t* row = w + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(row + kW4AheadLines * kPanel), _MM_HINT_T0);
    const __m512i words = _mm512_loadu_si512(row);
    const __m512i even = _mm512_and_si512(words, low);                       // c0, c2, c4, c6
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(words, 4), low);  // c1, c3, c5, c7
    for (int r = 0; r < MR; ++r) {
      const int8_t* q = xr.codes + r * xs + (w0 + i) * 8;
      int32_t qe, qo;
      __builtin_memcpy(&qe, q, 4);
      __builtin_memcpy(&qo, q + 4, 4);
      const int ce = C == 4 ? 2 * static_cast<int>(i & 1) : 0, co = C == 4 ? ce + 1 : 0;
      part[r][ce] = _mm512_dpbusd_epi32(part[r][ce], even, _mm512_set1_epi32(qe));
      part[r][co] = _mm512_dpbusd_epi32(part[r][co], odd, _mm512_set1_epi32(qo));
    }
  }
  __m512i isum[MR];
  for (int r = 0; r < MR; ++r) {
    isum[r] = part[r][0];
    if constexpr (C == 4)
      isum[r] = _mm512_add_epi32(_mm512_add_epi32(part[r][0], part[r][1]), _mm512_add_epi32(part[r][2], part[r][3]));
  }
  _mm_prefetch(L.group_line(p, g + kW4a8ScalesAhead, false), _MM_HINT_T0);
  const vf s = L.scale(p, g, 0);
  vf m{};
  if constexpr (Mins) {
    _mm_prefetch(L.group_line(p, g + kW4a8ScalesAhead, true), _MM_HINT_T0);
    m = L.min(p, g, 0);
  }
  for (int r = 0; r < MR; ++r) {
    const float sx = xr.scales[r * xr.G + g];
    const int32_t q = xr.sums[r * xr.G + g];
    vf v;
    if constexpr (Mins) {
      v = __builtin_convertvector(reinterpret_cast<vi32>(isum[r]), vf) * s + static_cast<float>(q) * m;
    } else {
      const vi32 centred = reinterpret_cast<vi32>(isum[r]) - 8 * q;
      v = __builtin_convertvector(centred, vf) * s;
    }
    float* a = acc + r * kW4BlockPanels * kPanel;
    store_vec(a, load_vec<vf>(a) + v * sx, kPanel);
  }
}

#else
#include "gemm_w4a8_avx2.h"  // w4a8_panel on AVX2 integer vectors
#endif

// out[r, n0 + c] for MR rows and the nb panels of one block from panel p0 of L: group after group, panel after
// panel, the order of the block's words (one stream); GW > 0: the groups of GW steps unrolled (a short last group
// is not).
template <int MR, bool Mins, int GW, typename A>
__attribute__((optimize("fp-contract=off"))) void w4a8_tile(int nb, const W4a8Rows& xr, int64_t xs, const W4Layout& L,
                                                            int64_t p0, const A* bias, A* out, int64_t os, int64_t n0,
                                                            int64_t N) {
  alignas(64) float acc[MR][kW4BlockPanels][kPanel] = {};
  for (int64_t g = 0; g < xr.G; ++g) {
    const int64_t w0 = g * L.gw, n = std::min(L.gw, L.K8 - w0);
    const uint32_t* w = L.group_words(p0, g);  // the block's panels' words of group g, n steps each
    if (GW > 0 && n == GW) {
      for (int j = 0; j < nb; ++j)
        w4a8_panel<MR, Mins, GW>(w + j * GW * kPanel, GW, w0, g, xr, xs, L, p0 + j, &acc[0][j][0]);
    } else {
      for (int j = 0; j < nb; ++j)
        w4a8_panel<MR, Mins, 0>(w + j * n * kPanel, n, w0, g, xr, xs, L, p0 + j, &acc[0][j][0]);
    }
  }
  for (int j = 0; j < nb; ++j) {
    const int64_t col = n0 + j * kPanel;
    const int valid = static_cast<int>(N - col < kPanel ? N - col : kPanel);
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < valid; ++i)
        w4a8_store_lane(out + r * os + col + i,
                        acc[r][j][i] + (bias != nullptr ? widen_scalar(bias[col + i]) : 0.0f));
  }
}

template <bool Mins, typename A, int MR>
void w4a8_rows(int nb, const W4a8Rows& xr, int64_t xs, const W4Layout& L, int64_t p0, const A* bias, A* out,
               int64_t os, int64_t n0, int64_t N) {
  if (L.gw == 4) return w4a8_tile<MR, Mins, 4>(nb, xr, xs, L, p0, bias, out, os, n0, N);  // groups of 32
  if (L.gw == 8) return w4a8_tile<MR, Mins, 8>(nb, xr, xs, L, p0, bias, out, os, n0, N);  // groups of 64
  w4a8_tile<MR, Mins, 0>(nb, xr, xs, L, p0, bias, out, os, n0, N);
}

template <typename A>
using W4a8RowsFn = void (*)(int, const W4a8Rows&, int64_t, const W4Layout&, int64_t, const A*, A*, int64_t, int64_t,
                            int64_t);

template <bool Mins, typename A, int... R>
constexpr auto w4a8_rows_table(std::integer_sequence<int, R...>) {
  return std::array<W4a8RowsFn<A>, sizeof...(R)>{w4a8_rows<Mins, A, R + 1>...};
}

// out (M, N) = x (M, K) @ W.T + bias on W4A8, M <= kW4a8MaxRows.
template <bool Mins, typename A>
int w4a8_linear(int64_t M, int64_t N, int64_t K, const W4Layout& L, const A* x, int64_t xs, const A* bias, A* out,
                int64_t os) {
  static thread_local std::vector<int8_t> codes;  // (M, K): each row's codes in the nibble order
  static thread_local std::vector<float> scales;  // (M, G): each row's block scales
  static thread_local std::vector<int32_t> sums;  // (M, G): each row's block code sums
  if (static_cast<int64_t>(codes.size()) < M * K) codes.resize(M * K);
  if (static_cast<int64_t>(scales.size()) < M * L.G) scales.resize(M * L.G), sums.resize(M * L.G);
  for (int64_t r = 0; r < M; ++r)
    w4a8_quantize_row(K, L.gs, x + r * xs, codes.data() + r * K, scales.data() + r * L.G, sums.data() + r * L.G);
  // (the thread_local vectors are this thread's: their addresses, taken here, are what the region's threads read)
  const W4a8Rows rows{codes.data(), scales.data(), sums.data(), L.G};
  static constexpr auto table = w4a8_rows_table<Mins, A>(std::make_integer_sequence<int, kW4a8TileRows>{});
  // a tile a block (the groups are blocks)
  for_row_tiles(M, N, K, K / 4, kW4a8TileRows, L.panels, kW4BlockPanels,
                [&](int64_t p0, int nb, int64_t m0, int mr) {
                  const W4a8Rows tile{rows.codes + m0 * K, rows.scales + m0 * L.G, rows.sums + m0 * L.G, L.G};
                  table[mr - 1](nb, tile, K, L, p0, bias, out + m0 * os, os, p0 * kPanel, N);
                });
  return 0;
}

#else
#define HS_HAVE_W4A8 0
#endif
