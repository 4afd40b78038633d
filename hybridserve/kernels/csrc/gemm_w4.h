// Linear layers over 4-bit group-wise weights, y = x @ W.T (+ b), activations bf16, fp16 or float32
// (kernels/linear_w4.py; the format: ops/linear_w4.py). Included by gemm.cpp after gemm_w8.h (it uses the
// float32 vector helpers, vi32, and, at the amx level, gemm_amx.h's amx_linear).
//
// A weight W (N, K) of codes c (0..15) with scales s and, optionally, mins m per group of `group` consecutive k
// (W[n, k] = c s + m, or (c - 8) s without mins) is packed per panel of 16 output columns:
//   uint32 words: word (k8, col) holds the codes of k = 8 k8 + j in bits 4j .. 4j + 3; in blocks of
//   kW4BlockPanels panels (the last may hold fewer), group after group, panel after panel,
//   [blocks][G][block's panels][group's 8-k steps][16], so a tile of a block's panels that sums a group panel after
//   panel reads the block as one sequential stream (W4Layout::group_words);
//   the scales: [panels][G][16] float16, or, sub-scaled (kW4SubScaled), [panels][S][16] float16 super-scales d,
//   one per super-block of SG groups (kW4SuperK k), then [panels][G][16] uint8 sub-scales u: s = d u, exact in
//   float32 (an 11-bit by 8-bit product);
//   with mins (kW4Mins), the mins after the scales in the same form (pad columns 0).
// K and the group are multiples of 8 (a group of K or more is one group), so a word never spans two groups.
//
// Five paths:
// * avx2 and above, any activation dtype, up to kW4a8MaxRows rows (decode): W4A8, the activations quantized to int8
//   per group and the sums exact in int32 on AVX-512 VNNI or AVX2 integer vectors (gemm_w4a8.h).
// * every level, kWidenedRows rows or more where no path above or below takes them: each panel group's codes
//   dequantized once per row block into float32 panels, the float32 tiles over them (gemm_widened.h).
// * every level, fewer rows: the float32 vector path. Each word vector gives 8 k of 16 columns; a
//   code becomes a float32 value in registers (AVX-512: one permute of a 16-entry table, indexed by the word
//   shifted to its nibble; elsewhere a shift, a mask and a conversion), and a tile of MR rows sums x * c over a
//   group, then adds that sum times the group's scale, and the rows' group sums of x times the mins (without
//   mins: minus 8 times the scale), once per group. One row (decode) reads each code once: half a byte a weight.
// * amx level, bf16 activations and kW4AmxRows rows or more: the AMX-BF16 tiles of gemm_amx.h. Each 32-column
//   block's codes are dequantized (c s + m, one fused multiply-add, rounded once to bf16) into the thread's
//   copy in the bf16 k-pair layout of an AMX B tile, once per call (gemm_amx.h: CallWidened, overlapped with
//   the tiles of the block before), and the tiles run over it at their rate.
// * avx512_bf16 level on CPUs that prefer its dot products (bf16_dot_preferred), bf16 activations and
//   kDotWidenedRows rows or more: the same bf16 weights, widened once per call, under vdpbf16ps (gemm_widened.h).
#pragma once

namespace {

constexpr int64_t kW4Codes = 8;       // codes per 32-bit word
constexpr int64_t kW4AmxRows = 16;    // rows from which bf16 calls run on the AMX tiles (amx level)

// Nibble J of each lane of w as a float32 value 0..15.
template <int J>
inline vf nibble(vu w) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // vpermps reads only the low 4 bits of each index: the shift alone picks the nibble
    const __m512i idx = J == 0 ? reinterpret_cast<__m512i>(w) : _mm512_srli_epi32(reinterpret_cast<__m512i>(w), 4 * J);
    return reinterpret_cast<vf>(_mm512_permutexvar_ps(idx, table));
  }
#endif
  return __builtin_convertvector(reinterpret_cast<vi32>((w >> (4 * J)) & 15u), vf);
}

inline vf load_halfs(const _Float16* p) { return widen_halfs(p); }

// kLanes bytes 0..255 as float32 values.
inline vf widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return reinterpret_cast<const vf&>(v);
  }
#endif
#if defined(__AVX2__)
  if constexpr (kLanes == 8) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return reinterpret_cast<const vf&>(v);
  }
#endif
  typedef uint8_t vb __attribute__((vector_size(kLanes)));
  return __builtin_convertvector(load_vec<vb>(p), vf);
}

// Format bits of a packed weight (kernels/linear_w4.py: FORMAT_MINS, FORMAT_SUB_SCALED).
constexpr int kW4Mins = 1;          // a min per group beside the scale
constexpr int kW4SubScaled = 2;     // scales and mins as uint8 sub-scales times a float16 per super-block
constexpr int64_t kW4SuperK = 256;  // in-features of a super-block (GGUF's Q4_K blocks)
// Panels whose words interleave group by group (kernels/linear_w4.py: BLOCK_PANELS). A tile of a block then reads
// one sequential stream, which memory serves faster than 8 streams a panel apart.
constexpr int64_t kW4BlockPanels = 8;
constexpr int64_t kW4AheadLines = 32;  // lines ahead in the block's stream a tile requests

// The packed weight's parts, and the scale and min vectors of one panel's group.
struct W4Layout {
  int64_t K8, gs, gw, G, panels, pe;  // words per column; k and words per group; groups; panels; words per panel
  int64_t SG = 1, S = 0;          // sub-scaled: groups per super-block, super-blocks per column
  const uint32_t* words;
  const _Float16* scale_halfs;   // [panels][G][16], or sub-scaled the super-scales [panels][S][16]
  const uint8_t* scale_bytes;    // sub-scaled: [panels][G][16] sub-scales; else null
  const _Float16* min_halfs;     // the mins likewise; null without mins
  const uint8_t* min_bytes;
  W4Layout(int64_t N, int64_t K, int64_t group, int format, const uint8_t* packed) {
    K8 = K / kW4Codes;
    gs = group < K ? group : K;
    gw = gs / kW4Codes;
    G = (K + gs - 1) / gs;
    panels = (N + kPanel - 1) / kPanel;
    pe = K8 * kPanel;
    const bool sub = (format & kW4SubScaled) != 0;
    if (sub) {
      SG = kW4SuperK % gs == 0 ? kW4SuperK / gs : 1;
      S = (G + SG - 1) / SG;
    }
    words = reinterpret_cast<const uint32_t*>(packed);
    const uint8_t* at = packed + panels * pe * 4;
    const auto part = [&](const _Float16*& halfs, const uint8_t*& bytes) {
      halfs = reinterpret_cast<const _Float16*>(at);
      at += panels * (sub ? S : G) * kPanel * 2;
      bytes = sub ? at : nullptr;
      if (sub) at += panels * G * kPanel;
    };
    part(scale_halfs, scale_bytes);
    min_halfs = nullptr, min_bytes = nullptr;
    if (format & kW4Mins) part(min_halfs, min_bytes);
  }
  // panel p's words of group g: the group's 8-k steps from g gw on, kPanel words each, one after another
  const uint32_t* group_words(int64_t p, int64_t g) const {
    const int64_t b0 = p - p % kW4BlockPanels, wb = std::min<int64_t>(kW4BlockPanels, panels - b0);
    const int64_t w0 = g * gw, n = std::min(gw, K8 - w0);
    return words + b0 * pe + (w0 * wb + (p - b0) * n) * kPanel;
  }
  vf scale(int64_t p, int64_t g, int v) const { return value(scale_halfs, scale_bytes, p, g, v); }
  vf min(int64_t p, int64_t g, int v) const { return value(min_halfs, min_bytes, p, g, v); }
  // the first byte of a group's scales (or mins: `mins`), for a prefetch
  const char* group_line(int64_t p, int64_t g, bool mins) const {
    const uint8_t* b = mins ? min_bytes : scale_bytes;
    if (b != nullptr) return reinterpret_cast<const char*>(b + (p * G + g) * kPanel);
    return reinterpret_cast<const char*>((mins ? min_halfs : scale_halfs) + (p * G + g) * kPanel);
  }

 private:
  vf value(const _Float16* halfs, const uint8_t* bytes, int64_t p, int64_t g, int v) const {
    if (bytes == nullptr) return load_halfs(halfs + (p * G + g) * kPanel + v * kLanes);
    return widen_bytes(bytes + (p * G + g) * kPanel + v * kLanes) *
           load_halfs(halfs + (p * S + g / SG) * kPanel + v * kLanes);
  }
};

// f(p, n) for the panels [p0, p0 + np) cut where a block ends: a tile's panels lie in one block.
template <typename F>
inline void w4_block_split(int64_t p0, int np, const F& f) {
  for (int64_t p = p0, end = p0 + np; p < end;) {
    const int64_t e = std::min(end, p - p % kW4BlockPanels + kW4BlockPanels);
    f(p, static_cast<int>(e - p));
    p = e;
  }
}

// Registers: 2 x MR x NP x kVecs sums (the tile's and the group's), NP x kVecs words, a code and MR broadcasts.
constexpr int w4_max_rows() { return kLanes == 16 ? 8 : 2; }
constexpr int w4_panels(int MR) {
  const int np = (kRegisters - 1 - MR) / (kVecs * (2 * MR + 1));
  return np < 1 ? 1 : (np > 8 ? 8 : np);
}

// One k8 step of a group: part[r][j] += x[r, 8 k8 + J] * code J of words[j], for J = 0 .. 7.
template <int MR, int NV, int J>
inline void w4_nibble_step(vf (&part)[MR][NV], const vu (&words)[NV], const float* xk, int64_t xs) {
  vf c[NV];
  for (int j = 0; j < NV; ++j) c[j] = nibble<J>(words[j]);
  for (int r = 0; r < MR; ++r) {
    const float x0 = xk[r * xs + J];
    for (int j = 0; j < NV; ++j) part[r][j] = part[r][j] + x0 * c[j];
  }
  if constexpr (J + 1 < kW4Codes) w4_nibble_step<MR, NV, J + 1>(part, words, xk, xs);
}

// out[r, n0 + c] for MR rows and NP panels of one block from panel p0 of L; xsum[r * G + g]: row r's sum of x over
// group g.
template <int MR, int NP, bool Mins, typename A>
void w4tile(const float* xf, int64_t xs, const float* xsum, const W4Layout& L, int64_t p0, const A* bias, A* out,
            int64_t os, int64_t n0, int64_t N) {
  constexpr int NV = NP * kVecs;
  const int64_t G = L.G;
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    const int64_t w0 = g * L.gw, w1 = std::min(L.K8, w0 + L.gw);
    vf part[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) part[r][j] = vf{};
    const uint32_t* w[NP];
    for (int p = 0; p < NP; ++p) w[p] = L.group_words(p0 + p, g);
    for (int64_t k8 = w0; k8 < w1; ++k8) {
      vu words[NV];
      for (int p = 0; p < NP; ++p) {
        const uint32_t* row = w[p] + (k8 - w0) * kPanel;
        __builtin_prefetch(row + kW4AheadLines * kPanel, 0, 3);  // further on in the block, all levels
        for (int v = 0; v < kVecs; ++v) words[p * kVecs + v] = load_vec<vu>(row + v * kLanes);
      }
      w4_nibble_step<MR, NV, 0>(part, words, xf + k8 * kW4Codes, xs);
    }
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kVecs; ++v) {
        const int j = p * kVecs + v;
        const vf s = L.scale(p0 + p, g, v);
        if constexpr (Mins) {
          const vf m = L.min(p0 + p, g, v);
          for (int r = 0; r < MR; ++r) acc[r][j] = acc[r][j] + part[r][j] * s + xsum[r * G + g] * m;
        } else {
          for (int r = 0; r < MR; ++r) acc[r][j] = acc[r][j] + (part[r][j] - 8.0f * xsum[r * G + g]) * s;
        }
      }
  }
  store_rows<MR, NV>(acc, bias, nullptr, 0, out, os, n0, N);
}

template <int MR, int NP, bool Mins, typename A>
void w4tile_any(int np, const float* xf, int64_t xs, const float* xsum, const W4Layout& L, int64_t p0, const A* bias,
                A* out, int64_t os, int64_t n0, int64_t N) {
  if constexpr (NP > 1) {
    if (np < NP) return w4tile_any<MR, NP - 1, Mins>(np, xf, xs, xsum, L, p0, bias, out, os, n0, N);
  }
  w4tile<MR, NP, Mins>(xf, xs, xsum, L, p0, bias, out, os, n0, N);
}

template <bool Mins, typename A, int MR>
void w4rows(int np, const float* xf, int64_t xs, const float* xsum, const W4Layout& L, int64_t p0, const A* bias,
            A* out, int64_t os, int64_t n0, int64_t N) {
  w4tile_any<MR, w4_panels(MR), Mins>(np, xf, xs, xsum, L, p0, bias, out, os, n0, N);
}

template <typename A>
using W4RowsFn = void (*)(int, const float*, int64_t, const float*, const W4Layout&, int64_t, const A*, A*, int64_t,
                          int64_t, int64_t);

template <bool Mins, typename A, int... R>
constexpr auto w4rows_table(std::integer_sequence<int, R...>) {
  return std::array<W4RowsFn<A>, sizeof...(R)>{w4rows<Mins, A, R + 1>...};
}

// The float32 vector path: out (M, N) = x (M, K) @ W.T + bias.
template <bool Mins, typename A>
int w4linear(int64_t M, int64_t N, int64_t K, const W4Layout& L, const A* x, int64_t xs, const A* bias, A* out,
             int64_t os) {
  const int64_t fs = float_stride(K);
  const float* xf = widened_rows(M, K, fs, x, xs);
  static thread_local std::vector<float> sums;  // (M, G): each row's sum of x over each group
  if (static_cast<int64_t>(sums.size()) < M * L.G) sums.resize(M * L.G);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < L.G; ++g) {
      float s = 0.0f;
      for (int64_t k = g * L.gs; k < std::min(K, (g + 1) * L.gs); ++k) s += xf[r * fs + k];
      sums[r * L.G + g] = s;
    }
  const float* xsum = sums.data();
  constexpr int kRows = w4_max_rows();
  static constexpr auto table = w4rows_table<Mins, A>(std::make_integer_sequence<int, kRows>{});
  for_row_tiles(M, N, K, K, kRows, L.panels, w4_panels(M >= kRows ? kRows : static_cast<int>(M)),
                [&](int64_t p0, int np, int64_t m0, int mr) {
                  w4_block_split(p0, np, [&](int64_t p, int n) {
                    table[mr - 1](n, xf + m0 * fs, fs, xsum + m0 * L.G, L, p, bias, out + m0 * os, os, p * kPanel, N);
                  });
                });
  return 0;
}

// Codes J.. of a word vector dequantized (c s + m, one rounding) into rows J.. of 8 float32 panel rows at d.
template <int J>
inline void w4_store_codes(vu words, vf s, vf m, float* d) {
  const vf w = nibble<J>(words) * s + m;
  __builtin_memcpy(d + J * kPanel, &w, sizeof w);
  if constexpr (J + 1 < kW4Codes) w4_store_codes<J + 1>(words, s, m, d);
}

// The float32 panels of gemm_widened.h: panels [p0, p0 + np) dequantized, [np][K][16] at dst.
struct W4FloatPanels {
  const W4Layout* L;
  void operator()(int64_t p0, int np, float* dst) const {
    const int64_t gw = L->gw, pe = L->K8 * kW4Codes * kPanel;
    for (int j = 0; j < np; ++j)
      for (int64_t g = 0; g < L->G; ++g) {
        const uint32_t* w = L->group_words(p0 + j, g);
        for (int v = 0; v < kVecs; ++v) {
          const vf s = L->scale(p0 + j, g, v);
          const vf m = L->min_halfs != nullptr ? L->min(p0 + j, g, v) : -8.0f * s;  // centred: (c - 8) s
          for (int64_t k8 = g * gw; k8 < std::min(L->K8, (g + 1) * gw); ++k8)
            w4_store_codes<0>(load_vec<vu>(w + (k8 - g * gw) * kPanel + v * kLanes), s, m,
                              dst + j * pe + k8 * kW4Codes * kPanel + v * kLanes);
        }
      }
  }
};

#if HS_HAVE_BF16_DOT
// Two vectors of 16 float32 weights (k even and k odd of 16 columns) as one k-pair vector of bf16 (k even in the low
// half of each 32-bit lane), each rounded to nearest even once: one conversion of both and a word permute. The
// conversion treats subnormal inputs as zero; the coded formats' weights are multiples of 2^-24 (float16 scales and
// mins times small integers), so none is subnormal in float32 and every weight keeps its nearest bf16.
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  // words 0-15: even's columns, 16-31: odd's; word 2c <- c, word 2c + 1 <- 16 + c
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
}

// The weights of the amx path and of the dot-product path of many bf16 rows (gemm_widened.h): the 8-k words of a
// panel dequantized into the bf16 k-pair layout, each code (c s + m, one fused multiply-add) rounded once to bf16;
// gemm_amx.h's CallWidened and dot_widened_linear do so once per call.
struct W4Words {
  const W4Layout* L;
  int64_t units() const { return L->K8; }
  // where panel p's share of the words begins, for a prefetch: panels [p, p + n) of a block span as many words as
  // they hold, interleaved with the block's other panels'
  const char* bytes(int64_t p) const { return reinterpret_cast<const char*>(L->words + p * L->pe); }
  // words [from, to) of the panels from p on (panel j's word k8 is j * K8 + k8) into dst (panel j at j * 8 K8 x 16)
  void widen(int64_t p, int64_t from, int64_t to, uint16_t* dst) const {
    if (from >= to) return;
    const int64_t pe = L->K8 * kW4Codes * kPanel;
    int64_t j = from / L->K8, k8 = from - j * L->K8, g = k8 / L->gw, in = k8 - g * L->gw;  // in: step in the group
    const uint32_t* w = nullptr;  // panel p + j's words of group g
    __m512 s = _mm512_setzero_ps(), m = _mm512_setzero_ps();
    const auto enter = [&] {  // a new (panel, group): its words, scale and min
      w = L->group_words(p + j, g);
      s = reinterpret_cast<__m512>(L->scale(p + j, g, 0));
      m = L->min_halfs != nullptr ? reinterpret_cast<__m512>(L->min(p + j, g, 0)) : _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
    };
    enter();
    for (int64_t i = from; i < to; ++i) {
      const vu words = load_vec<vu>(w + in * kPanel);
      uint16_t* d = dst + j * pe + k8 * 4 * 2 * kPanel;  // 4 k-pairs of 16 columns
      const auto pair = [&](auto even, auto odd, int n) {
        _mm512_storeu_si512(d + n * 2 * kPanel, bf16_pairs(_mm512_fmadd_ps(reinterpret_cast<__m512>(even), s, m),
                                                          _mm512_fmadd_ps(reinterpret_cast<__m512>(odd), s, m)));
      };
      pair(nibble<0>(words), nibble<1>(words), 0);
      pair(nibble<2>(words), nibble<3>(words), 1);
      pair(nibble<4>(words), nibble<5>(words), 2);
      pair(nibble<6>(words), nibble<7>(words), 3);
      if (i + 1 == to) break;
      if (++k8 == L->K8) {
        ++j, k8 = 0, g = 0, in = 0;
        enter();
      } else if (++in == L->gw) {
        ++g, in = 0;
        enter();
      }
    }
  }
};
#endif

#include "gemm_w4a8.h"  // few-row calls on W4A8 (AVX-512 VNNI)

template <typename A>
int w4linear_any(int64_t M, int64_t N, int64_t K, int64_t group, int format, const A* x, int64_t xs,
                 const uint8_t* packed, const A* bias, A* out, int64_t os) {
  if (M < 0 || N < 1 || K < kW4Codes || K % kW4Codes != 0 || group < 1 || (group < K && group % kW4Codes != 0) ||
      format < 0 || format > (kW4Mins | kW4SubScaled))
    return 1;
  if (M == 0) return 0;
  const W4Layout L(N, K, group, format, packed);
  const bool has_mins = (format & kW4Mins) != 0;
#if HS_HAVE_W4A8
  if (M <= kW4a8MaxRows)
    return has_mins ? w4a8_linear<true>(M, N, K, L, x, xs, bias, out, os)
                    : w4a8_linear<false>(M, N, K, L, x, xs, bias, out, os);
#endif
#if HS_HAVE_AMX
  if constexpr (std::is_same_v<A, uint16_t>)
    if (M >= kW4AmxRows) return amx_linear(M, N, K, x, xs, CallWidened<W4Words>{W4Words{&L}, K}, bias, nullptr, out, os);
#endif
#if HS_HAVE_BF16_DOT
  if constexpr (std::is_same_v<A, uint16_t>)
    if (dot_widened_takes(M))
      return dot_widened_linear(M, N, K, x, xs, W4Words{&L}, bias, out, os);
#endif
  if (M >= kWidenedRows) return widened_linear(M, N, K, x, xs, bias, out, os, W4FloatPanels{&L});
  return has_mins ? w4linear<true>(M, N, K, L, x, xs, bias, out, os) : w4linear<false>(M, N, K, L, x, xs, bias, out, os);
}

}  // namespace

extern "C" {

// 2: W4A8, 1: AMX-BF16 tiles over widened codes, 4: bf16 dot products over codes widened once per call, 3: float32
// panels decoded once per row block, 0: the float32 vector path.
int hs_w4_path(int act_dtype, int64_t rows) {
#if HS_HAVE_W4A8
  if (rows <= kW4a8MaxRows) return 2;
#endif
#if HS_HAVE_AMX
  if (act_dtype == kBF16 && rows >= kW4AmxRows) return 1;
#endif
#if HS_HAVE_BF16_DOT
  if (act_dtype == kBF16 && dot_widened_takes(rows)) return 4;
#endif
  (void)act_dtype;
  return rows >= kWidenedRows ? 3 : 0;
}

int hs_linear_w4(int act_dtype, int64_t M, int64_t N, int64_t K, int64_t group, int format, const void* x,
                 int64_t xs, const uint8_t* packed, const void* bias, void* out, int64_t os) {
  switch (act_dtype) {
    case kF32:
      return w4linear_any(M, N, K, group, format, static_cast<const float*>(x), xs, packed,
                          static_cast<const float*>(bias), static_cast<float*>(out), os);
    case kBF16:
      return w4linear_any(M, N, K, group, format, static_cast<const uint16_t*>(x), xs, packed,
                          static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), os);
    case kF16:
      return w4linear_any(M, N, K, group, format, static_cast<const _Float16*>(x), xs, packed,
                          static_cast<const _Float16*>(bias), static_cast<_Float16*>(out), os);
    default:
      return 2;
  }
}

}  // extern "C"
