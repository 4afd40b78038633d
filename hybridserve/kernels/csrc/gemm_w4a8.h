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

#if HS_HAVE_W4A8_VNNI
// rows of a tile: 8 rows read the weights once (tiles of 4 ran 0.84-0.87x as fast at 8 rows, weights from memory)
constexpr int kW4a8TileRows = 8;
// Groups ahead whose scales (and mins) a tile requests. Each panel's scales and mins are streams of their own
// beside its words, 32 bytes a group each, which the hardware prefetchers follow poorly: requesting them 4 groups
// ahead streamed one-row calls at the ~1.3B layout's shapes 1.06x as fast without mins, and requesting the mins
// too 1.13x as fast again with them (AMD EPYC Zen 5, 2 threads, medians of 20 interleaved pairs of two builds in
// one process; the same bits).
constexpr int64_t kW4a8ScalesAhead = 4;

// Panels of a tile of MR rows: 2 x MR x NP sums (the float32 total and the group's int32) and the two nibble
// vectors of a panel in the registers, the activation quads as memory broadcasts.
constexpr int w4a8_panels(int MR) {
  const int np = 26 / (2 * MR);
  return np < 1 ? 1 : (np > 8 ? 8 : np);
}

// out[r, n0 + c] for MR rows and NP panels from panel p0 of L; gw: words a group.
template <int MR, int NP, bool Mins, typename A>
__attribute__((optimize("fp-contract=off"))) void w4a8_tile(int64_t K8, int64_t gw, const W4a8Rows& xr, int64_t xs,
                                                            const W4Layout& L, int64_t p0, const A* bias, A* out,
                                                            int64_t os, int64_t n0, int64_t N) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const uint32_t* w = L.words + p0 * L.pe;
  const int64_t pe = L.pe;
  vf acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vf{};
  for (int64_t g = 0; g < xr.G; ++g) {
    const int64_t w0 = g * gw, w1 = std::min(K8, w0 + gw);
    __m512i isum[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_setzero_si512();
    for (int64_t k8 = w0; k8 < w1; ++k8) {
      for (int p = 0; p < NP; ++p) {
        const uint32_t* row = w + p * pe + k8 * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(row + 8 * kPanel), _MM_HINT_T0);
        const __m512i words = _mm512_loadu_si512(row);
        const __m512i even = _mm512_and_si512(words, low);                       // c0, c2, c4, c6
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(words, 4), low);  // c1, c3, c5, c7
        for (int r = 0; r < MR; ++r) {
          const int8_t* q = xr.codes + r * xs + k8 * 8;
          int32_t qe, qo;
          __builtin_memcpy(&qe, q, 4);
          __builtin_memcpy(&qo, q + 4, 4);
          isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], even, _mm512_set1_epi32(qe));
          isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], odd, _mm512_set1_epi32(qo));
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      _mm_prefetch(L.group_line(p0 + p, g + kW4a8ScalesAhead, false), _MM_HINT_T0);
      const vf s = L.scale(p0 + p, g, 0);
      vf m{};
      if constexpr (Mins) {
        _mm_prefetch(L.group_line(p0 + p, g + kW4a8ScalesAhead, true), _MM_HINT_T0);
        m = L.min(p0 + p, g, 0);
      }
      for (int r = 0; r < MR; ++r) {
        const float sx = xr.scales[r * xr.G + g];
        const int32_t q = xr.sums[r * xr.G + g];
        vf v;
        if constexpr (Mins) {
          v = __builtin_convertvector(reinterpret_cast<vi32>(isum[r][p]), vf) * s + static_cast<float>(q) * m;
        } else {
          const vi32 centred = reinterpret_cast<vi32>(isum[r][p]) - 8 * q;
          v = __builtin_convertvector(centred, vf) * s;
        }
        acc[r][p] = acc[r][p] + v * sx;
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t col = n0 + p * kPanel;
    const int valid = static_cast<int>(N - col < kPanel ? N - col : kPanel);
    if (valid <= 0) break;
    vf b = vf{};
    if (bias != nullptr)
      for (int i = 0; i < valid; ++i) b[i] = widen_scalar(bias[col + i]);
    for (int r = 0; r < MR; ++r) store_vec(out + r * os + col, acc[r][p] + b, valid);
  }
}

#else
#include "gemm_w4a8_avx2.h"  // w4a8_tile on AVX2 integer vectors
#endif

template <int MR, int NP, bool Mins, typename A>
void w4a8_tile_any(int np, int64_t K8, int64_t gw, const W4a8Rows& xr, int64_t xs, const W4Layout& L, int64_t p0,
                   const A* bias, A* out, int64_t os, int64_t n0, int64_t N) {
  if constexpr (NP > 1) {
    if (np < NP) return w4a8_tile_any<MR, NP - 1, Mins>(np, K8, gw, xr, xs, L, p0, bias, out, os, n0, N);
  }
  w4a8_tile<MR, NP, Mins>(K8, gw, xr, xs, L, p0, bias, out, os, n0, N);
}

template <bool Mins, typename A, int MR>
void w4a8_rows(int np, int64_t K8, int64_t gw, const W4a8Rows& xr, int64_t xs, const W4Layout& L, int64_t p0,
               const A* bias, A* out, int64_t os, int64_t n0, int64_t N) {
  w4a8_tile_any<MR, w4a8_panels(MR), Mins>(np, K8, gw, xr, xs, L, p0, bias, out, os, n0, N);
}

template <typename A>
using W4a8RowsFn = void (*)(int, int64_t, int64_t, const W4a8Rows&, int64_t, const W4Layout&, int64_t, const A*, A*,
                            int64_t, int64_t, int64_t);

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
  const int64_t gw = L.gs / kW4Codes;
  for_row_tiles(M, N, K, K / 4, kW4a8TileRows, L.panels,
                w4a8_panels(M >= kW4a8TileRows ? kW4a8TileRows : static_cast<int>(M)),
                [&](int64_t p0, int np, int64_t m0, int mr) {
                  const W4a8Rows tile{rows.codes + m0 * K, rows.scales + m0 * L.G, rows.sums + m0 * L.G, L.G};
                  table[mr - 1](np, L.K8, gw, tile, K, L, p0, bias, out + m0 * os, os, p0 * kPanel, N);
                });
  return 0;
}

#else
#define HS_HAVE_W4A8 0
#endif
