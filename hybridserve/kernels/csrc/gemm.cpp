// CPU kernel for bf16 linear layers, y = x @ W.T (+ b), on AVX-512 BF16 CPUs.
//
// The weight W (N, K) is packed once into panels of 16 output columns: panel p holds rows
// W[16p : 16p + 16] as [K/2][16][2] bf16 (k-pair major), so one 64-byte load gives two k values for
// 16 columns, the operand layout of vdpbf16ps, and a panel is one contiguous stream. Missing
// columns of the last panel are zero. K must be even.
//
// A tile of MR rows of x and NR panels keeps MR x NR float32 accumulators in registers; each step
// broadcasts a k-pair of every row and multiplies it into NR weight vectors. Threads split the
// panels. One token (M = 1) streams the weights at memory speed with 8 panels in flight; a batch
// reuses each weight vector for 8 rows. Output is rounded to bf16 (nearest even) once, after the
// float32 sum and the bias.
//
// A call of more than 8 rows passes over each panel group once per 8-row tile: the first pass reads
// the weights from memory, the others from L2. While a group computes, its row tiles also request
// the next group's weights into L2 (a slice each, a line or more per k-pair step), so the first pass
// of the next group does not wait on memory: 7% faster at 32 rows on the benchmark model's layers.

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HS_HAVE_BF16_DOT 1
#else
#define HS_HAVE_BF16_DOT 0
#endif

namespace {

constexpr int64_t kPanel = 16;                // output columns per panel
constexpr int64_t kPrefetchBytes = 256;       // how far ahead in a panel the next lines are requested

#if HS_HAVE_BF16_DOT

inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// acc[r][j] over all K/2 k-pairs, then bias, rounding and the store of columns [n0, n0 + 16 NR) ∩ [0, N).
// Lines to request ahead during one tile: [begin, end), `per_step` lines per k-pair step.
struct Ahead {
  const char* begin;
  const char* end;
  int per_step;
};

template <int MR, int NR>
void tile(int64_t K2, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t panel_elems, const uint16_t* bias,
          uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  // Fewer than 8 rows: in a call of at most 8 rows, each weight line is read once; the non-temporal
  // hint keeps the stream out of L3, which then still holds the activations, states and interpreter
  // data between the matmuls of a one-sequence decode step (about 1 ms of its 12 on the bench model).
  // (The last M % 8 rows of a larger batch get the hint too, after the 8-row tiles have brought the
  // lines in, where it changes nothing.)
  constexpr _mm_hint kHint = MR < 8 ? _MM_HINT_NTA : _MM_HINT_T0;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * xs);
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int l = 0; l < ahead.per_step && ahead.begin < ahead.end; ++l, ahead.begin += 64)
      _mm_prefetch(ahead.begin, _MM_HINT_T1);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) {
      const uint16_t* p = w + j * panel_elems + kk * 2 * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, kHint);
      wv[j] = (__m512bh)_mm512_loadu_si512(p);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][kk]);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, wv[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = n0 + j * kPanel;
    const int64_t valid = N - col < kPanel ? N - col : kPanel;
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) b = bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + col));
    for (int r = 0; r < MR; ++r) {
      const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(out + r * os + col, mask, y);
    }
  }
}

// Widest panel group per row count: registers hold MR x NR accumulators, NR weight vectors and a broadcast.
constexpr int max_panels(int MR) { return MR == 1 ? 8 : MR <= 4 ? 4 : 3; }

template <int MR, int NR>
void tile_any(int nr, int64_t K2, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t pe, const uint16_t* bias,
              uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  if constexpr (NR > 1) {
    if (nr < NR) return tile_any<MR, NR - 1>(nr, K2, x, xs, w, pe, bias, out, os, n0, N, ahead);
  }
  tile<MR, NR>(K2, x, xs, w, pe, bias, out, os, n0, N, ahead);
}

template <int MR>
void rows(int nr, int64_t K2, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t pe, const uint16_t* bias,
          uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  tile_any<MR, max_panels(MR)>(nr, K2, x, xs, w, pe, bias, out, os, n0, N, ahead);
}

using RowsFn = void (*)(int, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*,
                        int64_t, int64_t, int64_t, Ahead);
constexpr RowsFn kRows[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

#endif

}  // namespace

extern "C" {

// 1 when this build can run hs_linear_bf16 (the CPU it was compiled for has AVX-512 BF16), else 0.
int hs_gemm_supported() { return HS_HAVE_BF16_DOT; }

// Packs w (N, K) bf16, row stride ws, into out (ceil(N / 16) * 16 * K elements). Returns 1 when K is odd.
int hs_pack_bf16(int64_t N, int64_t K, const uint16_t* w, int64_t ws, uint16_t* out) {
  if (K % 2 != 0 || N < 1) return 1;
  const int64_t panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* dst = out + p * K2 * 2 * kPanel;
    for (int64_t kk = 0; kk < K2; ++kk)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        dst[(kk * kPanel + c) * 2] = n < N ? w[n * ws + 2 * kk] : 0;
        dst[(kk * kPanel + c) * 2 + 1] = n < N ? w[n * ws + 2 * kk + 1] : 0;
      }
  }
  return 0;
}

// out (M, N) = x (M, K) @ W.T + bias, all bf16; x and out with row strides xs, os (elements);
// packed from hs_pack_bf16; bias (N,) or null. Returns 1 for bad sizes, 3 when not supported here.
int hs_linear_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const uint16_t* packed,
                   const uint16_t* bias, uint16_t* out, int64_t os) {
#if HS_HAVE_BF16_DOT
  if (M < 0 || N < 1 || K < 2 || K % 2 != 0) return 1;
  if (M == 0) return 0;
  const int64_t K2 = K / 2, panel_elems = K2 * 2 * kPanel, panels = (N + kPanel - 1) / kPanel;
  const int MR = M >= 8 ? 8 : static_cast<int>(M);
  const int64_t group = max_panels(MR);
  const int64_t groups = (panels + group - 1) / group;
  const bool parallel = groups > 1 && (N * K >= (1 << 15) || M * N * K >= (1 << 19));
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    const int nr = static_cast<int>(panels - g * group < group ? panels - g * group : group);
    const uint16_t* w = packed + g * group * panel_elems;
    const int64_t n0 = g * group * kPanel;
    // the next group's weights (none for the last group, or a call of one row tile), a slice per tile
    const int64_t tiles = (M + 7) / 8;
    const char* next = reinterpret_cast<const char*>(w + nr * panel_elems);
    const int64_t next_panels = tiles > 1 && g + 1 < groups ? std::min(group, panels - (g + 1) * group) : 0;
    const char* next_end = next + next_panels * panel_elems * 2;
    const int per_step = static_cast<int>((next_panels + tiles - 1) / tiles);  // lines per k-pair step
    const int64_t slice = per_step * K2 * 64;  // bytes of the next group each tile requests
    for (int64_t m0 = 0, t = 0; m0 < M; m0 += 8, ++t) {
      const int mr = M - m0 >= 8 ? 8 : static_cast<int>(M - m0);
      const char* begin = std::min(next + t * slice, next_end);
      const Ahead ahead{begin, std::min(begin + slice, next_end), per_step};
      // tail rows (M % 8) take this group too: narrower tiles allow at least as many panels
      kRows[mr](nr, K2, x + m0 * xs, xs, w, panel_elems, bias, out + m0 * os, os, n0, N, ahead);
    }
  }
  return 0;
#else
  (void)M; (void)N; (void)K; (void)x; (void)xs; (void)packed; (void)bias; (void)out; (void)os;
  return 3;
#endif
}

}  // extern "C"
