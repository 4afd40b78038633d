// W8A8 linears: int8 weights with one float32 scale per output channel (the packed 8-bit panels of
// gemm_w8.h) times activations quantized to int8 per row, y = (x_q @ q.T) * s_w * s_x (+ b). Included by
// gemm.cpp after gemm_w8.h (kPanel, vf, vi32, kLanes, kVecs, load_vec, store_vec, widen_scalar, extend8).
//
// Each row of x is quantized on its own: s_x = max|x| / 127 (1 for a row of zeros), x_q = x * (127 / max|x|)
// rounded to the nearest integer (ties to even) and clamped to [-127, 127] (ops/linear_w8.py: quantize_rows_int8, the
// same float32 operations). The sums x_q . q are exact in int32 (|x_q q| <= 127^2, K < 2^17), so a row's
// result depends on its own values only, not on the other rows of the call or on the ISA level's summation
// order: the float32 epilogue, float(sum) * s_w * s_x + b rounded once to the activation dtype, is all that
// rounds.
//
// Paths: at the amx level on a CPU with AMX-INT8, tiles (tdpbssd); a weight panel's [K][16] codes are 4 x 16
// bytes per k-quad, and two rounds of byte and word interleaves per quad give the B-tile layout [K/4][16][4],
// written per 32-column block into a scratch the block's row tiles share. Elsewhere, integer vectors (the codes
// widened to int32, multiplied and summed exactly).
#pragma once

namespace {

constexpr int64_t kW8a8K = 64;  // activations are padded with zeros to a multiple of 64 k: one int8 tile step

#if defined(__AVX512F__)
// 16 activations as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const _Float16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// x (M, K) quantized into q (rows of Kq >= K bytes, zeros past K) and s (M,), one scale per row; sums (M,)
// the sum of each row's codes.
template <typename A>
void quantize_rows(int64_t M, int64_t K, int64_t Kq, const A* x, int64_t xs, int8_t* q, float* s, int32_t* sums) {
  const bool parallel = M > 1 && M * K >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t m = 0; m < M; ++m) {
    const A* xr = x + m * xs;
    int8_t* qr = q + m * Kq;
    float amax = 0.0f;
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(xr + k)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; k < K; ++k) {
      const float a = std::fabs(widen_scalar(xr[k]));
      amax = a > amax ? a : amax;
    }
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;  // codes are x * (127 / max|x|)
    s[m] = scale;
    k = 0;
    int32_t sum = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    __m512i vsum = _mm512_setzero_si512();
    for (; k + 16 <= K; k += 16) {
      const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + k), iv));  // nearest even
      const __m512i c = _mm512_max_epi32(_mm512_min_epi32(n, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k), _mm512_cvtepi32_epi8(c));
      vsum = _mm512_add_epi32(vsum, c);
    }
    sum = _mm512_reduce_add_epi32(vsum);
#endif
    for (; k < K; ++k) {
      const float v = std::nearbyint(widen_scalar(xr[k]) * inv);  // the default rounding: nearest even
      qr[k] = static_cast<int8_t>(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : (v == v ? v : 0.0f)));
      sum += qr[k];
    }
    sums[m] = sum;
    for (k = K; k < Kq; ++k) qr[k] = 0;
  }
}

// out[r, col + i] = float(acc[r][i]) * sw[i] * sx[r] + bias[col + i] for rows [0, mr) (acc rows `as` int32
// apart, out rows os apart) and the `valid` columns of one panel (16), each operation rounded on its own (no
// fused multiply-add), as the plain-PyTorch reference rounds.
template <typename A>
__attribute__((optimize("fp-contract=off"))) void w8a8_store(const int32_t* acc, int64_t as, int mr, const float* sx,
                                                            const float* sw, const A* bias, A* out, int64_t os,
                                                            int64_t col, int valid) {
  for (int v = 0; v < kVecs; ++v) {
    const int n = valid - v * kLanes < kLanes ? valid - v * kLanes : kLanes;
    if (n <= 0) break;
    vf b = vf{};
    if (bias != nullptr)
      for (int i = 0; i < n; ++i) b[i] = widen_scalar(bias[col + v * kLanes + i]);
    const vf w = load_vec<vf>(sw + v * kLanes);
    for (int r = 0; r < mr; ++r) {
      const vf y = __builtin_convertvector(load_vec<vi32>(acc + r * as + v * kLanes), vf) * w * sx[r];
      store_vec(out + r * os + col + v * kLanes, y + b, n);
    }
  }
}

// The integer vector path, every level: MR rows x one panel per tile, int32 sums of the widened codes.
template <int MR, typename A>
void w8a8_vector_tile(int64_t K, const int8_t* xq, int64_t Kq, const float* sx, const uint8_t* panel,
                      const float* sw, const A* bias, A* out, int64_t os, int64_t col, int valid) {
  vi32 acc[MR][kVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = vi32{};
  for (int64_t k = 0; k < K; ++k) {
    vi32 w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = reinterpret_cast<vi32>(extend8<true>(panel + k * kPanel + v * kLanes));
    for (int r = 0; r < MR; ++r) {
      const int32_t a = xq[r * Kq + k];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += a * w[v];
    }
  }
  alignas(64) int32_t sums[MR][kPanel];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVecs; ++v) __builtin_memcpy(&sums[r][v * kLanes], &acc[r][v], sizeof acc[r][v]);
  w8a8_store(&sums[0][0], kPanel, MR, sx, sw, bias, out, os, col, valid);
}

template <typename A>
void w8a8_vector(int64_t M, int64_t N, int64_t K, const int8_t* xq, int64_t Kq, const float* sx,
                 const uint8_t* packed, const A* bias, A* out, int64_t os) {
  constexpr int kRowsPerTile = 4;
  const int64_t panels = (N + kPanel - 1) / kPanel, pe = K * kPanel;
  const float* scales = reinterpret_cast<const float*>(packed + panels * pe);
  const bool parallel = panels > 1 && M * N * K >= (1 << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t col = p * kPanel;
    const int valid = static_cast<int>(N - col < kPanel ? N - col : kPanel);
    int64_t m = 0;
    for (; m + kRowsPerTile <= M; m += kRowsPerTile)
      w8a8_vector_tile<kRowsPerTile>(K, xq + m * Kq, Kq, sx + m, packed + p * pe, scales + col, bias,
                                     out + m * os, os, col, valid);
    for (; m < M; ++m)
      w8a8_vector_tile<1>(K, xq + m * Kq, Kq, sx + m, packed + p * pe, scales + col, bias, out + m * os, os, col,
                          valid);
  }
}

#include "gemm_w8a8_vnni.h"  // the sums on AVX-512 VNNI

#if HS_HAVE_AMX && defined(__AMX_INT8__)
// Whether this CPU has AMX-INT8 (CPUID leaf 7, EDX bit 25); the amx level itself needs AMX-TILE and AMX-BF16.
inline bool amx_int8_present() {
  static const bool present = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1u);
  }();
  return present;
}

// The B tiles of np panels (codes at `codes`, pe bytes apart): panel j's [K][16] codes as [Kq/4][16][4] at
// dst + j * Kq * 16, zeros past K.
inline void w8a8_tile_layout(const uint8_t* codes, int64_t pe, int np, int64_t K, int64_t Kq, int8_t* dst) {
  const int64_t whole = K / 4, quads = Kq / 4;
  for (int j = 0; j < np; ++j) {
    const uint8_t* src = codes + j * pe;
    __m128i* d = reinterpret_cast<__m128i*>(dst + j * Kq * kPanel);
    for (int64_t r = 0; r < quads; ++r, d += 4) {
      __m128i k[4];  // the quad's 4 k, 16 columns each (zeros past K)
      for (int i = 0; i < 4; ++i)
        k[i] = r < whole || 4 * r + i < K ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (4 * r + i) * kPanel))
                                          : _mm_setzero_si128();
      // interleave to column-major: column c's 4 k in bytes 4c .. 4c + 3
      const __m128i k01lo = _mm_unpacklo_epi8(k[0], k[1]), k01hi = _mm_unpackhi_epi8(k[0], k[1]);
      const __m128i k23lo = _mm_unpacklo_epi8(k[2], k[3]), k23hi = _mm_unpackhi_epi8(k[2], k[3]);
      _mm_storeu_si128(d, _mm_unpacklo_epi16(k01lo, k23lo));
      _mm_storeu_si128(d + 1, _mm_unpackhi_epi16(k01lo, k23lo));
      _mm_storeu_si128(d + 2, _mm_unpacklo_epi16(k01hi, k23hi));
      _mm_storeu_si128(d + 3, _mm_unpackhi_epi16(k01hi, k23hi));
    }
  }
}

// One block of MT 16-row groups (a at xq, row stride Kq bytes) by NP panels (b: their tile layout, Kq * 16
// bytes apart): the int32 sums into c (32 x 32).
template <int MT, int NP>
inline void w8a8_amx_block(int64_t steps, const int8_t* a, int64_t Kq, const int8_t* b, int32_t (*c)[32]) {
  amx_zero_sums<MT, NP>();
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, b + s * 1024, 64);
    _tile_loadd(4, a + s * 64, Kq);
    _tile_dpbssd(0, 4, 6);
    if constexpr (NP > 1) {
      _tile_loadd(7, b + Kq * kPanel + s * 1024, 64);
      _tile_dpbssd(1, 4, 7);
    }
    if constexpr (MT > 1) {
      _tile_loadd(5, a + 16 * Kq + s * 64, Kq);
      _tile_dpbssd(2, 5, 6);
      if constexpr (NP > 1) _tile_dpbssd(3, 5, 7);
    }
  }
  amx_store_sums<MT, NP>(c);
}

// The tile path: threads split the 32-column blocks; rows go in chunks whose quantized activations fit in
// L2. The first chunk lays each block's codes out for the tiles into the thread's scratch, which keeps the
// layouts of all the thread's blocks for the later chunks (up to kWholeBytes; past that, one block's,
// laid out again for every chunk). The scratch is kept between calls.
template <typename A>
void w8a8_amx(int64_t M, int64_t N, int64_t K, const int8_t* xq, int64_t Kq, const float* sx, const uint8_t* packed,
              const A* bias, A* out, int64_t os) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pe = K * kPanel, blocks = (panels + 1) / 2;
  const float* scales = reinterpret_cast<const float*>(packed + panels * pe);
  const int64_t groups = (M + 15) / 16, steps = Kq / kW8a8K;  // 16-row groups (xq is padded to whole groups)
  const int64_t chunk_groups = std::max<int64_t>(2, (kAmxChunkBytes / (Kq * 16)) & ~int64_t(1));
  const bool parallel = blocks > 1 && M * N * K >= (1 << 18);
#pragma omp parallel if (parallel)
  {
    constexpr int64_t kWholeBytes = 64 << 20;
    static thread_local std::vector<int8_t> layout;
    const AmxTileScope tiles(AmxTileConfig{kAmxLinearTiles});
    const auto [b_begin, b_end] = thread_share(blocks);
    const int64_t block_bytes = 2 * Kq * kPanel;  // the layout of one 32-column block
    const bool whole = groups > chunk_groups && (b_end - b_begin) * block_bytes <= kWholeBytes;
    const int64_t need = (whole ? b_end - b_begin : 1) * block_bytes + 64;
    if (static_cast<int64_t>(layout.size()) < need) layout.resize(need);
    int8_t* base = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(layout.data()) + 63) & ~uintptr_t(63));
    alignas(64) int32_t c[32][32];
    for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
      const int64_t g1 = std::min(groups, g0 + chunk_groups);
      for (int64_t blk = b_begin; blk < b_end; ++blk) {
        const int64_t p = 2 * blk;
        const int np = panels - p >= 2 ? 2 : 1;
        int8_t* b = whole ? base + (blk - b_begin) * block_bytes : base;
        if (!whole || g0 == 0) w8a8_tile_layout(packed + p * pe, pe, np, K, Kq, b);
        for (int64_t g = g0; g < g1;) {
          const int mt = g + 1 < g1 ? 2 : 1;
          const int8_t* a = xq + g * 16 * Kq;
          if (mt == 2 && np == 2) w8a8_amx_block<2, 2>(steps, a, Kq, b, c);
          else if (mt == 2) w8a8_amx_block<2, 1>(steps, a, Kq, b, c);
          else if (np == 2) w8a8_amx_block<1, 2>(steps, a, Kq, b, c);
          else w8a8_amx_block<1, 1>(steps, a, Kq, b, c);
          const int64_t m0 = g * 16;
          const int mr = static_cast<int>(std::min<int64_t>(16 * mt, M - m0));
          for (int j = 0; j < np; ++j) {
            const int64_t col = (p + j) * kPanel;
            const int valid = static_cast<int>(N - col < kPanel ? N - col : kPanel);
            w8a8_store(&c[0][j * 16], 32, mr, sx + m0, scales + col, bias, out + m0 * os, os, col, valid);
          }
          g += mt;
        }
      }
    }
  }
}
#endif

// Where W8A8 calls of more than kW8a8VnniRows rows sum here: AMX-INT8 tiles (built for amx, on a CPU with
// AMX-INT8), AVX-512 VNNI (built for avx512_bf16 or amx) or integer vectors (the other levels).
// Up to kW8a8VnniRows rows the tiles' CPUs sum on VNNI: with the weights from memory it streams them faster (K = N =
// 2048, 2 threads, Intel Xeon: 1 row 53 against 34 GFLOP/s, 8 rows 290 against 251; 32 rows from cache 614 against
// 1574).
constexpr int64_t kW8a8VnniRows = 8;
enum W8a8Sums : int { kW8a8Vectors = 0, kW8a8Vnni = 1, kW8a8Tiles = 2 };
inline W8a8Sums w8a8_sums() {
#if HS_HAVE_AMX && defined(__AMX_INT8__)
  if (amx_int8_present()) return kW8a8Tiles;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return kW8a8Vnni;
#else
  return kW8a8Vectors;
#endif
}

template <typename A>
int w8a8_linear(int64_t M, int64_t N, int64_t K, const A* x, int64_t xs, const uint8_t* packed, const A* bias,
                A* out, int64_t os) {
  if (M < 0 || N < 1 || K < 1 || K >= (1 << 17)) return 1;
  if (M == 0) return 0;
  const int64_t Kq = (K + kW8a8K - 1) / kW8a8K * kW8a8K, Mp = (M + 15) / 16 * 16;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> sx;
  static thread_local std::vector<int32_t> row_sums;
  if (static_cast<int64_t>(xq.size()) < Mp * Kq + 64) xq.resize(Mp * Kq + 64);
  if (static_cast<int64_t>(sx.size()) < Mp) sx.resize(Mp);
  if (static_cast<int64_t>(row_sums.size()) < Mp) row_sums.resize(Mp);
  int8_t* q = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xq.data()) + 63) & ~uintptr_t(63));
  quantize_rows(M, K, Kq, x, xs, q, sx.data(), row_sums.data());
  std::memset(q + M * Kq, 0, (Mp - M) * Kq);  // the padded rows of the last 16-row group
  switch (w8a8_sums()) {
#if HS_HAVE_AMX && defined(__AMX_INT8__)
    case kW8a8Tiles:
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (M <= kW8a8VnniRows) {  // (the same exact int32 sums, the same bits)
        w8a8_vnni(M, N, K, q, Kq, row_sums.data(), sx.data(), packed, bias, out, os);
        return 0;
      }
#endif
      w8a8_amx(M, N, K, q, Kq, sx.data(), packed, bias, out, os);
      return 0;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case kW8a8Vnni:
      w8a8_vnni(M, N, K, q, Kq, row_sums.data(), sx.data(), packed, bias, out, os);
      return 0;
#endif
    default:
      w8a8_vector(M, N, K, q, Kq, sx.data(), packed, bias, out, os);
      return 0;
  }
}

}  // namespace

extern "C" {

// Where hs_linear_w8a8 sums here: 2 AMX-INT8 tiles, 1 AVX-512 VNNI, 0 integer vectors.
int hs_w8a8_sums() { return w8a8_sums(); }

// out (M, N) = (quantized x (M, K)) @ q.T * s_w * s_x + bias, in the activation dtype (act_dtype: 0 float32,
// 1 bf16, 2 fp16); packed by hs_pack_w8 from int8 codes with one scale per output channel. Returns 1 for bad
// sizes, 2 for an unknown dtype.
int hs_linear_w8a8(int act_dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t xs, const uint8_t* packed,
                   const void* bias, void* out, int64_t os) {
  switch (act_dtype) {
    case kF32:
      return w8a8_linear(M, N, K, static_cast<const float*>(x), xs, packed, static_cast<const float*>(bias),
                         static_cast<float*>(out), os);
    case kBF16:
      return w8a8_linear(M, N, K, static_cast<const uint16_t*>(x), xs, packed, static_cast<const uint16_t*>(bias),
                         static_cast<uint16_t*>(out), os);
    case kF16:
      return w8a8_linear(M, N, K, static_cast<const _Float16*>(x), xs, packed, static_cast<const _Float16*>(bias),
                         static_cast<_Float16*>(out), os);
    default:
      return 2;
  }
}

}  // extern "C"
