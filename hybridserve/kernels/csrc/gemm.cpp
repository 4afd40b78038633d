// CPU kernels for 16-bit linear layers, y = x @ W.T (+ b), with float32 sums rounded once to the
// activation dtype: bf16 and fp16 weights stay 16-bit in memory (a decode step streams them) and
// are widened to float32 in registers. Float32 weights take the same vector path (no widening).
//
// A weight W (N, K) is packed once into panels of 16 output columns, zero-padded to whole panels
// and to an even K (Kp):
//   bf16: panel p holds W[16p : 16p + 16] as [Kp/2][16][2] (k-pair major), so one 64-byte line gives
//         two k values for 16 columns: the operand of AVX-512 BF16's vdpbf16ps, and on other CPUs
//         two float32 vectors through one shift (k even) and one mask (k odd) per 32-bit lane.
//   fp16: panel p holds W[16p : 16p + 16] as [Kp][16] (k major), widened by F16C's vcvtph2ps.
//   float32: the fp16 layout, loaded as it is.
//
// 8-bit weights (int8, fp8 e4m3) with float32 scales have their own packing and kernels, on the same
// tiles: gemm_w8.h, included below.
//
// Two implementations, chosen by the ISA level the library is built for (kernels/isa.py):
// * avx512_bf16, bf16 weights: vdpbf16ps on bf16 activations (tile() below).
// * every level, fp16 weights, and bf16 below avx512_bf16: GCC vector code in float32 (vtile()
//   below): 8-lane vectors (AVX2 + FMA registers, or pairs of SSE / NEON ones on generic builds) or
//   16-lane ones on AVX-512. The activations are widened once per call into a float32 copy; a tile
//   of MR rows and NP panels keeps MR x NP x 16 float32 sums in registers, and each k-pair step
//   widens the panels' weights once for all MR rows.
//
// A tile of MR rows of x and NR panels keeps MR x NR float32 accumulators in registers; each step
// broadcasts a k-pair of every row and multiplies it into NR weight vectors. Threads split the
// panels. One token (M = 1) streams the weights at memory speed with several panels in flight; a
// batch reuses each weight vector for several rows. Output is rounded to bf16 (nearest even) or fp16
// once, after the float32 sum and the bias.
//
// avx512_bf16: a call of more than 8 rows passes over each panel group once per 8-row tile: the
// first pass reads the weights from memory, the others from L2. While a group computes, its row
// tiles also request the next group's weights into L2 (a slice each, a line or more per k-pair
// step), so the first pass of the next group does not wait on memory: 7% faster at 32 rows on the
// benchmark model's layers.

#include "isa_level.h"
#include "registry.h"
#include <algorithm>
#include <cmath>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "dtypes.h"
#include "vecmath.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <cpuid.h>
#include <cstring>
#include <immintrin.h>
#define HS_HAVE_BF16_DOT 1
#else
#define HS_HAVE_BF16_DOT 0
#endif
#if HS_HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HS_HAVE_AMX 1
#else
#define HS_HAVE_AMX 0
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

// The weights a tile reads: k-pair kk of panel j as 16 bf16 pairs. Here the packed bf16 panels themselves;
// gemm_w8.h's source widens 8-bit codes instead (and keeps them for the group's other row tiles).
template <int MR>
struct PackedBf16 {
  // Fewer than 8 rows: in a call of at most 8 rows, each weight line is read once; the non-temporal
  // hint keeps the stream out of L3, which then still holds the activations, states and interpreter
  // data between the matmuls of a one-sequence decode step (about 1 ms of its 12 on the bench model).
  // (The last M % 8 rows of a larger batch get the hint too, after the 8-row tiles have brought the
  // lines in, where it changes nothing.)
  static constexpr _mm_hint kHint = MR < 8 ? _MM_HINT_NTA : _MM_HINT_T0;
  const uint16_t* w;
  int64_t panel_elems;
  __m512bh operator()(int j, int64_t kk) const {
    const uint16_t* p = w + j * panel_elems + kk * 2 * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, kHint);
    return (__m512bh)_mm512_loadu_si512(p);
  }
};

// Row tile t's share of the bytes [next, next_end) that a panel group's `tiles` row tiles of K2 k-pair steps
// each request while they compute (the next group's weights or codes, so that they come from L2 when it starts).
inline Ahead tile_ahead(const char* next, const char* next_end, int64_t tiles, int64_t K2, int64_t t) {
  const int per_step = static_cast<int>(((next_end - next) / 64 + tiles * K2 - 1) / (tiles * K2));  // lines a step
  const int64_t slice = per_step * K2 * 64;  // bytes a row tile requests
  const char* begin = std::min(next + t * slice, next_end);
  return Ahead{begin, std::min(begin + slice, next_end), per_step};
}

template <int MR, int NR, typename Weights>
void tile_over(int64_t K2, const uint16_t* x, int64_t xs, const Weights& weights, const uint16_t* bias,
               const float* scale, uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * xs);
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int l = 0; l < ahead.per_step && ahead.begin < ahead.end; ++l, ahead.begin += 64)
      _mm_prefetch(ahead.begin, _MM_HINT_T1);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = weights(j, kk);
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
    // 8-bit weights (gemm_w8.h): the sums of x * q times each column's scale
    const __m512 s = scale != nullptr ? _mm512_maskz_loadu_ps(mask, scale + col) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < MR; ++r) {
      const __m512 sum = scale != nullptr ? _mm512_fmadd_ps(acc[r][j], s, b) : _mm512_add_ps(acc[r][j], b);
      const __m256i y = (__m256i)_mm512_cvtneps_pbh(sum);
      _mm256_mask_storeu_epi16(out + r * os + col, mask, y);
    }
  }
}

template <int MR, int NR>
void tile(int64_t K2, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t panel_elems, const uint16_t* bias,
          const float* scale, uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  tile_over<MR, NR>(K2, x, xs, PackedBf16<MR>{w, panel_elems}, bias, scale, out, os, n0, N, ahead);
}

// Widest panel group per row count: registers hold MR x NR accumulators, NR weight vectors and a broadcast.
constexpr int max_panels(int MR) { return MR == 1 ? 8 : MR <= 4 ? 4 : 3; }

template <int MR, int NR>
void tile_any(int nr, int64_t K2, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t pe, const uint16_t* bias,
              const float* scale, uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  if constexpr (NR > 1) {
    if (nr < NR) return tile_any<MR, NR - 1>(nr, K2, x, xs, w, pe, bias, scale, out, os, n0, N, ahead);
  }
  tile<MR, NR>(K2, x, xs, w, pe, bias, scale, out, os, n0, N, ahead);
}

template <int MR>
void rows(int nr, int64_t K2, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t pe, const uint16_t* bias,
          const float* scale, uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  tile_any<MR, max_panels(MR)>(nr, K2, x, xs, w, pe, bias, scale, out, os, n0, N, ahead);
}

using RowsFn = void (*)(int, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*,
                        const float*, uint16_t*, int64_t, int64_t, int64_t, Ahead);
constexpr RowsFn kRows[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

// Whether bf16 linears below the amx level take the dot products. Measured on an Intel Xeon (Sapphire Rapids
// class, one thread, K = N = 2048): vdpbf16ps ran at 4-53 GFLOP/s, the float32 vector path (weights widened
// by a shift, vfmadd231ps) at 12-79, from 1 row to 512: Intel cores issue vdpbf16ps at half their FMA
// rate, and the one-row tile's dependent dot products stream the weights at a third of the widening path's
// speed. AMD's Zen 4/5 issue it at the FMA rate, and there the dot products win (docs/performance.md). So
// the choice is the CPU vendor's: Intel CPUs take the vector path.
inline bool bf16_dot_preferred() {
  static const bool preferred = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return true;
    char vendor[13];
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    vendor[12] = 0;
    return std::strcmp(vendor, "GenuineIntel") != 0;
  }();
  return preferred;
}

// The avx512_bf16 path of hs_linear_bf16 (K even).
int dot_linear(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const uint16_t* packed,
               const uint16_t* bias, uint16_t* out, int64_t os) {
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
      kRows[mr](nr, K2, x + m0 * xs, xs, w, panel_elems, bias, nullptr, out + m0 * os, os, n0, N, ahead);
    }
  }
  return 0;
}

#endif

#if HS_HAVE_AMX
// ---- the amx path: bf16 tiles on the AMX matrix units (gemm_amx.h) ----
#include "gemm_amx.h"
#endif


// ---- the float32 vector path (every level) ----

#if defined(HS_VECTOR_LANES)  // a test build: the other width's code on this CPU (kernels/test_isa.py)
constexpr int kLanes = HS_VECTOR_LANES;
#elif defined(__AVX512F__)
constexpr int kLanes = 16;  // float32 lanes of one vector
#else
constexpr int kLanes = 8;
#endif
constexpr int kRegisters = kLanes == 16 ? 32 : 16;
constexpr int kVecs = kPanel / kLanes;  // vectors per panel row
constexpr int kMaxRows = kLanes == 16 ? 8 : 4;  // rows of a tile

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
typedef _Float16 vh __attribute__((vector_size(2 * kLanes)));

template <typename V, typename T> inline V load_vec(const T* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

// fp16 <-> float32 vectors on F16C's vcvtph2ps / vcvtps2ph (nearest even): GCC 12 converts _Float16 vectors one
// lane at a time, which made every fp16 weight, int4 scale and fp16 output a scalar conversion.
inline vf widen_halfs(const _Float16* p) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<const vf&>(v);
  }
#endif
#if defined(__F16C__)
  if constexpr (kLanes == 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<const vf&>(v);
  }
#endif
  return __builtin_convertvector(load_vec<vh>(p), vf);
}
inline vh narrow_halfs(vf y) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    const __m256i h = _mm512_cvtps_ph(reinterpret_cast<const __m512&>(y), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return reinterpret_cast<const vh&>(h);
  }
#endif
#if defined(__F16C__)
  if constexpr (kLanes == 8) {
    const __m128i h = _mm256_cvtps_ph(reinterpret_cast<const __m256&>(y), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return reinterpret_cast<const vh&>(h);
  }
#endif
  return __builtin_convertvector(y, vh);
}

// The two float32 vectors of one k-pair (k even, k odd) for lanes [v * kLanes, (v + 1) * kLanes) of a
// panel: bf16 from the [Kp/2][16][2] layout, fp16 from the [Kp][16] layout.
inline void widen_pair(const uint16_t* panel, int64_t kk, int v, vf& even, vf& odd) {
  const vu raw = load_vec<vu>(panel + kk * 2 * kPanel + v * 2 * kLanes);  // kLanes (k even, k odd) pairs
  even = reinterpret_cast<vf>(raw << 16);
  odd = reinterpret_cast<vf>(raw & 0xffff0000u);
}
inline void widen_pair(const _Float16* panel, int64_t kk, int v, vf& even, vf& odd) {
  even = widen_halfs(panel + 2 * kk * kPanel + v * kLanes);
  odd = widen_halfs(panel + (2 * kk + 1) * kPanel + v * kLanes);
}
inline void widen_pair(const float* panel, int64_t kk, int v, vf& even, vf& odd) {  // [Kp][16], as fp16
  even = load_vec<vf>(panel + 2 * kk * kPanel + v * kLanes);
  odd = load_vec<vf>(panel + (2 * kk + 1) * kPanel + v * kLanes);
}

// Rounds float32 lanes to the output dtype and stores the first `valid` of them.
inline void store_vec(uint16_t* out, vf y, int valid) {  // bf16: nearest even, NaN -> 0x7fc0
  const vu u = reinterpret_cast<vu>(y);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu r = ((u & 0x7fffffffu) > 0x7f800000u) ? vu{} + 0x7fc0u : rounded;
  const vu16 h = __builtin_convertvector(r, vu16);
  if (valid == kLanes) __builtin_memcpy(out, &h, sizeof h);
  else for (int i = 0; i < valid; ++i) out[i] = h[i];
}
inline void store_vec(_Float16* out, vf y, int valid) {
  const vh h = narrow_halfs(y);
  if (valid == kLanes) __builtin_memcpy(out, &h, sizeof h);
  else for (int i = 0; i < valid; ++i) out[i] = h[i];
}
inline void store_vec(float* out, vf y, int valid) {
  if (valid == kLanes) __builtin_memcpy(out, &y, sizeof y);
  else for (int i = 0; i < valid; ++i) out[i] = y[i];
}
inline float widen_scalar(float v) { return v; }
inline float widen_scalar(uint16_t v) { uint32_t u = static_cast<uint32_t>(v) << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
inline float widen_scalar(_Float16 v) { return static_cast<float>(v); }

// Float32 weights need no widening: a tile steps one k at a time, and the registers that held the
// second widened vector of a k-pair hold more rows instead.
template <typename W> constexpr bool kPlain = std::is_same_v<W, float>;
template <typename W> constexpr int max_rows() { return kPlain<W> ? (kLanes == 16 ? 8 : 6) : kMaxRows; }

// Panels per tile of MR rows: MR x NP x kVecs sums, 2 x NP x kVecs widened weights and 2 broadcasts
// in the registers (float32: NP x kVecs weights and one broadcast).
template <typename W>
constexpr int vpanels(int MR) {
  const int np = kPlain<W> ? (kRegisters - 1) / (kVecs * (MR + 1)) : (kRegisters - 2) / (kVecs * (MR + 2));
  return np < 1 ? 1 : (np > 8 ? 8 : np);
}

// The float32 tiles' stores: out[r, n0 + j * kLanes ..] = acc[r][j] (times its column scales when `sc` is
// given: 8-bit weights, the scales of vector j at sc + (j / kVecs) * ps + (j % kVecs) * kLanes) + bias, for
// the columns below N.
template <int MR, int NV, typename A>
void store_rows(const vf (&acc)[MR][NV], const A* bias, const float* sc, int64_t ps, A* out, int64_t os, int64_t n0,
                int64_t N) {
  for (int j = 0; j < NV; ++j) {
    const int64_t col = n0 + j * kLanes;
    const int valid = static_cast<int>(N - col < kLanes ? N - col : kLanes);
    if (valid <= 0) break;
    vf b = vf{};
    if (bias != nullptr)
      for (int i = 0; i < valid; ++i) b[i] = widen_scalar(bias[col + i]);
    if (sc == nullptr) {
      for (int r = 0; r < MR; ++r) store_vec(out + r * os + col, acc[r][j] + b, valid);
    } else {
      const vf s = load_vec<vf>(sc + (j / kVecs) * ps + (j % kVecs) * kLanes);
      for (int r = 0; r < MR; ++r) store_vec(out + r * os + col, acc[r][j] * s + b, valid);
    }
  }
}

// out[r, n0 + c] = sum_k xf[r, k] W[n0 + c, k] + bias for MR rows and NP panels (columns past N skipped).
// xf: float32 rows of stride xs, zero-padded to Kp; w: the first panel; pe: elements per panel.
// A: the dtype of the bias and the output (the weights' own, or float32 weights widened from codes:
// gemm_widened.h).
template <int MR, int NP, typename W, typename A = W>
void vtile(int64_t K2, const float* xf, int64_t xs, const W* w, int64_t pe, const A* bias, A* out, int64_t os,
           int64_t n0, int64_t N) {
  constexpr int NV = NP * kVecs;
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  if constexpr (kPlain<W>) {
    for (int64_t k = 0; k < 2 * K2; ++k) {  // panels are [Kp][16]: row k of each
      vf wv[NV];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < kVecs; ++v) wv[p * kVecs + v] = load_vec<vf>(w + p * pe + k * kPanel + v * kLanes);
      for (int r = 0; r < MR; ++r) {
        const float x0 = xf[r * xs + k];
        for (int j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + x0 * wv[j];
      }
    }
  } else {
    for (int64_t kk = 0; kk < K2; ++kk) {
      vf even[NV], odd[NV];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < kVecs; ++v) widen_pair(w + p * pe, kk, v, even[p * kVecs + v], odd[p * kVecs + v]);
      for (int r = 0; r < MR; ++r) {
        const float x0 = xf[r * xs + 2 * kk], x1 = xf[r * xs + 2 * kk + 1];
        for (int j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + x0 * even[j] + x1 * odd[j];
      }
    }
  }
  store_rows<MR, NV>(acc, bias, nullptr, 0, out, os, n0, N);
}

template <int MR, int NP, typename W, typename A>
void vtile_any(int np, int64_t K2, const float* xf, int64_t xs, const W* w, int64_t pe, const A* bias, A* out,
               int64_t os, int64_t n0, int64_t N) {
  if constexpr (NP > 1) {
    if (np < NP) return vtile_any<MR, NP - 1, W, A>(np, K2, xf, xs, w, pe, bias, out, os, n0, N);
  }
  vtile<MR, NP, W, A>(K2, xf, xs, w, pe, bias, out, os, n0, N);
}

template <typename W, typename A, int MR>
void vrows(int np, int64_t K2, const float* xf, int64_t xs, const W* w, int64_t pe, const A* bias, A* out,
           int64_t os, int64_t n0, int64_t N) {
  vtile_any<MR, vpanels<W>(MR), W, A>(np, K2, xf, xs, w, pe, bias, out, os, n0, N);
}

template <typename W, typename A>
using VRowsFn = void (*)(int, int64_t, const float*, int64_t, const W*, int64_t, const A*, A*, int64_t, int64_t,
                         int64_t);

template <typename W, typename A, int... R>
constexpr auto vrows_table(std::integer_sequence<int, R...>) {
  return std::array<VRowsFn<W, A>, sizeof...(R)>{vrows<W, A, R + 1>...};
}

// x (M, K) in W's dtype, row stride xs -> float32 rows of stride fs (the pad column K of an odd K
// is 0), into `xf`.
template <typename W>
void widen_rows(int64_t M, int64_t K, int64_t fs, const W* x, int64_t xs, float* xf) {
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t k = 0; k < K; ++k) xf[r * fs + k] = widen_scalar(x[r * xs + k]);
    if (K % 2 != 0) xf[r * fs + K] = 0.0f;
  }
}

// A row stride (floats) for the float32 copy of rows of Kp values: a power-of-two row size gets one
// cache line more, so that the rows of a tile do not all fall into the same L1 sets.
inline int64_t float_stride(int64_t Kp) { return (Kp * 4) % 4096 == 0 ? Kp + 16 : Kp; }

// x (M, K) widened to float32 rows of stride fs, in this thread's scratch (valid until its next call).
template <typename W>
const float* widened_rows(int64_t M, int64_t K, int64_t fs, const W* x, int64_t xs) {
  static thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < M * fs) scratch.resize(M * fs);
  widen_rows(M, K, fs, x, xs, scratch.data());
  return scratch.data();
}

// The float32 paths' schedule: rows in blocks whose float32 copy (rows of Kf floats) stays in L2 (~192 KiB,
// at least min_block rows) while every panel passes over it; in a block, the groups of `group` panels in
// parallel: block(first panel, panels, first row, rows).
template <typename Block>
void for_panel_groups(int64_t M, int64_t N, int64_t K, int64_t Kf, int kRows, int64_t panels, int64_t group,
                      int64_t min_block, const Block& block_fn) {
  const int64_t fit = (192 * 1024 / (4 * Kf)) / kRows * kRows;
  const int64_t block = std::max<int64_t>(std::max<int64_t>(kRows, min_block), fit);
  const int64_t groups = (panels + group - 1) / group;
  const bool parallel = groups > 1 && (N * K >= (1 << 15) || M * N * K >= (1 << 19));
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t rows = std::min(block, M - b0);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t g = 0; g < groups; ++g)
      block_fn(g * group, static_cast<int>(std::min(group, panels - g * group)), b0, rows);
  }
}

// for_panel_groups with each group over its row tiles of up to kRows rows: tile(first panel, panels, first
// row, rows).
template <typename Tile>
void for_row_tiles(int64_t M, int64_t N, int64_t K, int64_t Kf, int kRows, int64_t panels, int64_t group,
                   const Tile& tile) {
  for_panel_groups(M, N, K, Kf, kRows, panels, group, kRows, [&](int64_t p0, int np, int64_t b0, int64_t rows) {
    for (int64_t m0 = b0; m0 < b0 + rows; m0 += kRows)
      tile(p0, np, m0, static_cast<int>(std::min<int64_t>(kRows, b0 + rows - m0)));
  });
}

// The vector path: out (M, N) = x (M, K) @ W.T + bias, W packed in panels of Kp = K rounded up to even.
template <typename W>
int vlinear(int64_t M, int64_t N, int64_t K, const W* x, int64_t xs, const W* packed, const W* bias, W* out,
            int64_t os) {
  if (M < 0 || N < 1 || K < 1) return 1;
  if (M == 0) return 0;
  const int64_t Kp = K + (K & 1), K2 = Kp / 2, pe = Kp * kPanel, panels = (N + kPanel - 1) / kPanel;
  const int64_t fs = float_stride(Kp);
  const float* xf = widened_rows(M, K, fs, x, xs);
  constexpr int kRows = max_rows<W>();
  static constexpr auto table = vrows_table<W, W>(std::make_integer_sequence<int, kRows>{});
  // narrower row tiles take at least as many panels, so a tail tile covers its group too
  for_row_tiles(M, N, K, Kp, kRows, panels, vpanels<W>(M >= kRows ? kRows : static_cast<int>(M)),
                [&](int64_t p0, int np, int64_t m0, int mr) {
                  table[mr - 1](np, K2, xf + m0 * fs, fs, packed + p0 * pe, pe, bias, out + m0 * os, os,
                                p0 * kPanel, N);
                });
  return 0;
}

// Packs w (N, K), row stride ws, in the layout of W's dtype (see the top of this file).
inline void pack_panel_elem(uint16_t* dst, int64_t k, int64_t c, uint16_t v) { dst[((k / 2) * kPanel + c) * 2 + (k & 1)] = v; }
inline void pack_panel_elem(_Float16* dst, int64_t k, int64_t c, _Float16 v) { dst[k * kPanel + c] = v; }
inline void pack_panel_elem(float* dst, int64_t k, int64_t c, float v) { dst[k * kPanel + c] = v; }

template <typename W>
int pack(int64_t N, int64_t K, const W* w, int64_t ws, W* out) {
  if (K < 1 || N < 1) return 1;
  const int64_t panels = (N + kPanel - 1) / kPanel, Kp = K + (K & 1);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    W* dst = out + p * Kp * kPanel;
    for (int64_t k = 0; k < Kp; ++k)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        pack_panel_elem(dst, k, c, n < N && k < K ? w[n * ws + k] : W{});
      }
  }
  return 0;
}

}  // namespace

#include "gemm_widened.h"  // coded weights widened to float32 panels once per row block (many rows)
#include "gemm_w8.h"  // the 8-bit weight linears, on the vector helpers above
#include "gemm_w8a8.h"  // 8-bit weights times 8-bit activations (W8A8)
#include "gemm_w4.h"  // the 4-bit group-wise weight linears
#include "gemm_w6k.h"  // GGUF Q6_K weights kept 6-bit

extern "C" {

// 1 when hs_linear_bf16 uses AVX-512 BF16 dot products on even K (built for avx512_bf16 or amx, on a CPU
// whose dot products beat the float32 vector path: bf16_dot_preferred), else 0 (the float32 vector path).
int hs_gemm_supported() {
#if HS_HAVE_BF16_DOT
  return bf16_dot_preferred() ? 1 : 0;
#else
  return 0;
#endif
}

// The fewest rows a bf16 linear runs on AMX tiles with (built for amx), else 0 (no AMX path).
int hs_gemm_amx_rows() {
#if HS_HAVE_AMX
  return static_cast<int>(kAmxMinRows);
#else
  return 0;
#endif
}

// Packs w (N, K) bf16, row stride ws, into out (ceil(N / 16) * 16 * Kp elements, Kp = K rounded up to
// even). Returns 1 for bad sizes.
int hs_pack_bf16(int64_t N, int64_t K, const uint16_t* w, int64_t ws, uint16_t* out) { return pack(N, K, w, ws, out); }

// Packs w (N, K) fp16 likewise (same element count).
int hs_pack_f16(int64_t N, int64_t K, const _Float16* w, int64_t ws, _Float16* out) { return pack(N, K, w, ws, out); }

// out (M, N) = x (M, K) @ W.T + bias, all bf16; x and out with row strides xs, os (elements);
// packed from hs_pack_bf16; bias (N,) or null. Returns 1 for bad sizes.
int hs_linear_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const uint16_t* packed,
                   const uint16_t* bias, uint16_t* out, int64_t os) {
#if HS_HAVE_AMX
  if (K % 2 == 0 && M >= kAmxMinRows)
    return amx_linear(M, N, K, x, xs, PackedPanels{packed, K * kPanel}, bias, nullptr, out, os);
#endif
#if HS_HAVE_BF16_DOT
  if (K % 2 == 0 && bf16_dot_preferred()) return dot_linear(M, N, K, x, xs, packed, bias, out, os);
#endif
  return vlinear(M, N, K, x, xs, packed, bias, out, os);
}

// The same for fp16 (packed by hs_pack_f16).
int hs_linear_f16(int64_t M, int64_t N, int64_t K, const _Float16* x, int64_t xs, const _Float16* packed,
                  const _Float16* bias, _Float16* out, int64_t os) {
  return vlinear(M, N, K, x, xs, packed, bias, out, os);
}

// Packs w (N, K) float32 likewise ([Kp][16] panels, as fp16).
int hs_pack_f32(int64_t N, int64_t K, const float* w, int64_t ws, float* out) { return pack(N, K, w, ws, out); }

// The same for float32 (packed by hs_pack_f32): the float32 vector path, float32 out.
int hs_linear_f32_packed(int64_t M, int64_t N, int64_t K, const float* x, int64_t xs, const float* packed,
                         const float* bias, float* out, int64_t os) {
  return vlinear(M, N, K, x, xs, packed, bias, out, os);
}

}  // extern "C"

// ---- Mixture-of-experts blocks over packed expert weights (layers/moe.py: FusedExperts)

namespace {

enum Activation : int { kSilu = 0, kRelu2 = 1 };

// x (n, K) @ W.T -> out (n, N) through the packed kernel of storage type T, or, for 8-bit weights
// (wfmt: WeightFormat), the 8-bit kernel with its scale groups of `group` k.
template <typename T>
int packed_linear(int64_t n, int64_t N, int64_t K, const T* x, const void* packed, T* out, int wfmt = 0,
                  int64_t group = 0) {
  if (wfmt != kNativeWeights) {
    constexpr int code = std::is_same_v<T, BF16> ? kBF16 : std::is_same_v<T, float> ? kF32 : kF16;
    if (wfmt == kInt4Weights || wfmt == kInt4MinsWeights)
      return hs_linear_w4(code, n, N, K, group, wfmt == kInt4MinsWeights ? kW4Mins : kW4SubScaled, x, K,
                          static_cast<const uint8_t*>(packed), nullptr, out, N);
    return hs_linear_w8(code, wfmt, n, N, K, group, x, K, static_cast<const uint8_t*>(packed), nullptr, out, N);
  }
  if constexpr (std::is_same_v<T, BF16>) {
    return hs_linear_bf16(n, N, K, reinterpret_cast<const uint16_t*>(x), K, static_cast<const uint16_t*>(packed),
                          nullptr, reinterpret_cast<uint16_t*>(out), N);
  } else if constexpr (std::is_same_v<T, float>) {
    return hs_linear_f32_packed(n, N, K, x, K, static_cast<const float*>(packed), nullptr, out, N);
  } else {
    return hs_linear_f16(n, N, K, x, K, static_cast<const _Float16*>(packed), nullptr, out, N);
  }
}

template <typename T> inline float rnd(float v) { return to_f32(from_f32<T>(v)); }

constexpr int64_t kExpertRows = 16;  // mean rows per active expert up to which the experts run in parallel

// dst[d] += float(y[d]) * w for d < n: the product rounded to float32 on its own, then added, as PyTorch's
// product and index_add_ do (no fused multiply-add, which this file's -ffp-contract=fast would allow).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void add_weighted(float* dst, const T* y, float w, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] += to_f32(y[d]) * w;
}

// Each expert's tokens (in token order), through up (gated: [gate, up] rows) -> activation -> down,
// each linear rounded to T; every token then sums, in float32 and in expert order, its experts'
// outputs times their weights, as FusedExperts.forward's index_add_ does, rounded to T at the end (plus
// `shared`, rounded again, when given).
template <typename T, typename WT>
int moe_experts_impl(int64_t T_, int64_t H, int64_t I, int64_t E, int64_t k, const T* x, int64_t xs,
                     const int64_t* index, const WT* weight, const int64_t* up, const int64_t* down, int gated, int act,
                     int wfmt, int64_t group, const T* shared, int64_t ss, T* out, int64_t os) {
  for (int64_t a = 0; a < T_ * k; ++a)
    if (index[a] < 0 || index[a] >= E) return 1;
  const int64_t up_rows = gated ? 2 * I : I;
  std::vector<std::vector<int64_t>> assigned(E);  // per expert: flat (token * k + j), in order
  for (int64_t a = 0; a < T_ * k; ++a) assigned[index[a]].push_back(a);
  std::vector<float> acc(T_ * H, 0.0f);
  // expert e's rows through up -> activation -> down into y (n x H); xb, hb, ab: the caller's scratch
  auto expert = [&](int64_t e, T* y, std::vector<T>& xb, std::vector<T>& hb, std::vector<T>& ab) -> int {
    const auto& rows = assigned[e];
    const int64_t n = static_cast<int64_t>(rows.size());
    xb.resize(n * H);
    hb.resize(n * up_rows);
    ab.resize(n * I);
    for (int64_t r = 0; r < n; ++r) std::memcpy(&xb[r * H], x + (rows[r] / k) * xs, H * sizeof(T));
    if (packed_linear<T>(n, up_rows, H, xb.data(), reinterpret_cast<const void*>(up[e]), hb.data(), wfmt, group) != 0)
      return 1;
    for (int64_t r = 0; r < n; ++r) {
      const T* hr = &hb[r * up_rows];
      for (int64_t i = 0; i < I; ++i) {
        if (gated) {  // act(gate) * up, each rounded to T
          ab[r * I + i] = from_f32<T>(rnd<T>(silu(to_f32(hr[i]))) * to_f32(hr[I + i]));
        } else {  // relu(u) ** 2
          const float u = to_f32(hr[i]) > 0.0f ? to_f32(hr[i]) : 0.0f;
          ab[r * I + i] = from_f32<T>(u * u);
        }
      }
    }
    return packed_linear<T>(n, H, I, ab.data(), reinterpret_cast<const void*>(down[e]), y, wfmt, group);
  };
  // expert e's outputs y (n x H) times their routing weights, added to their tokens' sums
  auto accumulate = [&](int64_t e, const T* y) {
    const auto& rows = assigned[e];
    for (size_t r = 0; r < rows.size(); ++r) add_weighted(&acc[(rows[r] / k) * H], y + r * H, to_f32(weight[rows[r]]), H);
  };
  // the sums rounded to T (plus `shared`, rounded again) into out
  auto round_sums = [&]() {
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t d = 0; d < H; ++d) {
        const float v = acc[t * H + d];
        out[t * os + d] = from_f32<T>(shared != nullptr ? rnd<T>(v) + to_f32(shared[t * ss + d]) : v);
      }
    return 0;
  };
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += assigned[e].empty() ? 0 : 1;
  if (active >= 2 && T_ * k <= kExpertRows * active) {
    // Few rows per expert (decode): the experts run in parallel, each on one thread (its linears' own
    // parallel regions nest, one thread each), into one buffer; then, in the same region, the tokens split
    // between the threads and each sums its experts' outputs in expert order, as above, so the result is the
    // same bits as one expert at a time (a linear's bits do not depend on threads, a token's sum only on
    // its own adds).
    std::vector<int64_t> offset(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) offset[e + 1] = offset[e] + static_cast<int64_t>(assigned[e].size());
    std::vector<int64_t> y_row(T_ * k);  // assignment a's row in y
    for (int64_t e = 0; e < E; ++e)
      for (size_t r = 0; r < assigned[e].size(); ++r) y_row[assigned[e][r]] = offset[e] + static_cast<int64_t>(r);
    std::vector<T> y(T_ * k * H);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
      std::vector<T> xb, hb, ab;
#pragma omp for schedule(dynamic)
      for (int64_t e = 0; e < E; ++e)
        if (!assigned[e].empty()) failed |= expert(e, &y[offset[e] * H], xb, hb, ab);
      std::vector<int64_t> order(k);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T_; ++t) {
        // the token's assignments in expert order (ties: in assignment order), the order accumulate adds them
        for (int64_t j = 0; j < k; ++j) order[j] = t * k + j;
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return index[a] < index[b]; });
        float* sum = &acc[t * H];
        for (const int64_t a : order) add_weighted(sum, &y[y_row[a] * H], to_f32(weight[a]), H);
        for (int64_t d = 0; d < H; ++d)
          out[t * os + d] = from_f32<T>(shared != nullptr ? rnd<T>(sum[d]) + to_f32(shared[t * ss + d]) : sum[d]);
      }
    }
    return failed;
  }
  // many rows per expert (prefill): one expert at a time, each linear on every thread
  std::vector<T> xb, hb, ab, y;
  for (int64_t e = 0; e < E; ++e) {
    if (assigned[e].empty()) continue;
    const int64_t n = static_cast<int64_t>(assigned[e].size());
    y.resize(n * H);
    if (expert(e, y.data(), xb, hb, ab) != 0) return 1;
    accumulate(e, y.data());
  }
  return round_sums();
}

// The k largest of v[0, n) as torch.topk picks them on the CPU (ATen's topk loop: std::partial_sort
// when k * 64 <= n, else std::nth_element and, when sorted, std::sort of the first k - 1), so that
// ties between equal scores resolve to the same experts. idx[0, k) gets their indices.
void torch_topk(const float* v, int64_t n, int64_t k, bool sorted, int64_t* idx,
                std::vector<std::pair<float, int64_t>>& queue) {
  queue.resize(n);
  for (int64_t i = 0; i < n; ++i) queue[i] = {v[i], i};
  auto larger = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    if (sorted) std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
  for (int64_t j = 0; j < k; ++j) idx[j] = queue[j].second;
}

// Router top-k over logits (T, E): mode 0 (Granite-4.0-H): the k largest logits, softmax over them;
// mode 1: softmax over all E, the k largest, with normalize = 1 divided by their sum. index (T, k)
// int64 by descending score; weight (T, k) in weight_dtype. All in float32.
template <typename LT, typename WT>
void router_topk_impl(int64_t T_, int64_t E, int64_t k, const LT* logits, int64_t ls, int mode, int normalize,
                      int64_t* index, WT* weight) {
  std::vector<float> s(E);
  std::vector<int64_t> order(E);
  std::vector<std::pair<float, int64_t>> queue;
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t e = 0; e < E; ++e) s[e] = to_f32(logits[t * ls + e]);
    if (mode == 1) {
      float mx = s[0];
      for (int64_t e = 1; e < E; ++e) mx = s[e] > mx ? s[e] : mx;
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (s[e] = exp_f32(s[e] - mx));
      for (int64_t e = 0; e < E; ++e) s[e] /= sum;
    }
    torch_topk(s.data(), E, k, true, order.data(), queue);
    float w[64];
    float total = 0.0f;
    if (mode == 0) {
      const float mx = s[order[0]];
      for (int64_t j = 0; j < k; ++j) total += (w[j] = exp_f32(s[order[j]] - mx));
      for (int64_t j = 0; j < k; ++j) w[j] /= total;
    } else {
      for (int64_t j = 0; j < k; ++j) total += (w[j] = s[order[j]]);
      if (normalize)
        for (int64_t j = 0; j < k; ++j) w[j] /= total;
    }
    for (int64_t j = 0; j < k; ++j) {
      index[t * k + j] = order[j];
      weight[t * k + j] = from_f32<WT>(w[j]);
    }
  }
}

// DeepSeek-V3-style routing (Nemotron-H): scores = sigmoid(logits); experts chosen by score + bias
// among the topk_group best of n_group groups (a group's score: the sum of its two best); weights
// are the chosen scores (renormalized with normalize: divided by their sum + eps), times scale. All in
// float32. LFM2-MoE's router is the case n_group = topk_group = 1.
void router_grouped_sigmoid_impl(int64_t T_, int64_t E, int64_t k, const float* logits, int64_t ls, const float* bias,
                                 int64_t n_group, int64_t topk_group, int normalize, float scale, float eps,
                                 int64_t* index, float* weight) {
  const int64_t per = E / n_group;
  std::vector<float> score(E), choice(E), group_score(n_group);
  std::vector<int64_t> order(std::max(E, n_group));
  std::vector<std::pair<float, int64_t>> queue;
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      score[e] = 1.0f / (1.0f + exp_f32(-logits[t * ls + e]));
      choice[e] = score[e] + bias[e];
    }
    for (int64_t g = 0; g < n_group; ++g) {  // the sum of its two best (topk(2) sorted, then summed)
      int64_t two[2];
      torch_topk(&choice[g * per], per, 2, true, two, queue);
      group_score[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
    }
    torch_topk(group_score.data(), n_group, topk_group, false, order.data(), queue);
    std::vector<bool> keep(n_group, false);
    for (int64_t j = 0; j < topk_group; ++j) keep[order[j]] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
    torch_topk(choice.data(), E, k, false, order.data(), queue);
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) total += score[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      index[t * k + j] = order[j];
      const float w = normalize ? score[order[j]] / (total + eps) : score[order[j]];
      weight[t * k + j] = w * scale;
    }
  }
}

}  // namespace

extern "C" {

// out (M, N) = x (M, K) @ w (N, K).T, x float32 or 16-bit (widened), w float32, the float32 sums
// rounded to out_dtype: routers' logits.
int hs_linear_f32(int x_dtype, int out_dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t xs,
                  const float* w, void* out, int64_t os) {
  return dispatch_dtype_pair(x_dtype, out_dtype, [&](auto tag, auto otag) {
    using XT = decltype(tag);
    using OT = decltype(otag);
#pragma omp parallel for schedule(static) if (M * N * K >= (1 << 20))
    for (int64_t m = 0; m < M; ++m) {
      std::vector<float> xr(K);
      for (int64_t kk = 0; kk < K; ++kk) xr[kk] = to_f32(static_cast<const XT*>(x)[m * xs + kk]);
      for (int64_t n = 0; n < N; ++n) {
        const float* wr = w + n * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t kk = 0; kk < K; ++kk) s += xr[kk] * wr[kk];
        static_cast<OT*>(out)[m * os + n] = from_f32<OT>(s);
      }
    }
  });
}

int hs_router_grouped_sigmoid(int64_t T, int64_t E, int64_t k, const float* logits, int64_t ls, const float* bias,
                              int64_t n_group, int64_t topk_group, int normalize, float scale, float eps,
                              int64_t* index, float* weight) {
  if (n_group < 1 || E % n_group != 0 || E / n_group < 2 || topk_group < 1 || topk_group > n_group || k < 1 ||
      k > topk_group * (E / n_group))
    return 1;
  router_grouped_sigmoid_impl(T, E, k, logits, ls, bias, n_group, topk_group, normalize, scale, eps, index, weight);
  return 0;
}

int hs_moe_experts(int dtype, int weight_dtype, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const void* x,
                   int64_t xs, const int64_t* index, const void* weight, const int64_t* up, const int64_t* down,
                   int gated, int act, int wfmt, int64_t group, const void* shared, int64_t ss, void* out,
                   int64_t os) {
  if ((gated && act != kSilu) || (!gated && act != kRelu2) || k < 1 || E < 1 || wfmt < 0 || wfmt > kInt4MinsWeights)
    return 1;
  int rc = 2;
  auto run = [&](auto t) {
    using AT = decltype(t);
    rc = dispatch_dtype(weight_dtype, [&](auto w) {
      using W = decltype(w);
      rc = moe_experts_impl<AT, W>(T, H, I, E, k, static_cast<const AT*>(x), xs, index, static_cast<const W*>(weight),
                                   up, down, gated, act, wfmt, group, static_cast<const AT*>(shared), ss,
                                   static_cast<AT*>(out), os);
    }) == 0 ? rc : 2;
  };
  if (dtype == kBF16) run(BF16{});
  else if (dtype == kF16) run(_Float16{});
  else if (dtype == kF32) run(float{});
  return rc;
}

int hs_router_topk(int logits_dtype, int weight_dtype, int64_t T, int64_t E, int64_t k, const void* logits, int64_t ls,
                   int mode, int normalize, int64_t* index, void* weight) {
  if (k < 1 || k > E || k > 64 || (mode != 0 && mode != 1)) return 1;
  return dispatch_dtype_pair(logits_dtype, weight_dtype, [&](auto l, auto w) {
    using LT = decltype(l);
    using WT = decltype(w);
    router_topk_impl<LT, WT>(T, E, k, static_cast<const LT*>(logits), ls, mode, normalize, index, static_cast<WT*>(weight));
  });
}

}  // extern "C"

HS_REGISTRY(HS_KERNEL(hs_gemm_supported) HS_KERNEL(hs_gemm_amx_rows) HS_KERNEL(hs_pack_bf16) HS_KERNEL(hs_pack_f16) HS_KERNEL(hs_linear_bf16)
            HS_KERNEL(hs_linear_f16) HS_KERNEL(hs_pack_f32) HS_KERNEL(hs_linear_f32_packed) HS_KERNEL(hs_moe_experts) HS_KERNEL(hs_router_topk) HS_KERNEL(hs_linear_f32)
            HS_KERNEL(hs_router_grouped_sigmoid) HS_KERNEL(hs_pack_w8) HS_KERNEL(hs_linear_w8)
            HS_KERNEL(hs_w4_path) HS_KERNEL(hs_linear_w4) HS_KERNEL(hs_w6k_path) HS_KERNEL(hs_linear_w6k)
            HS_KERNEL(hs_w8a8_sums) HS_KERNEL(hs_linear_w8a8))
