// Linear layers over GGUF Q6_K weights kept 6-bit, y = x @ W.T (+ b), activations bf16, fp16 or float32
// (kernels/linear_w6k.py; the format: ops/linear_w6k.py). Included by gemm.cpp after gemm_w4.h (it uses the
// float32 vector helpers, vi32, for_row_tiles and, at the amx level, gemm_amx.h's CallWidened; bf16_pairs).
//
// A weight W (N, K), K a multiple of 256, of codes q (0..63) with an int8 sub-scale sc per 16 k and a float16 d per
// 256 k (W[n, k] = (d sc) (q - 32)) is packed per panel of 16 output columns, super-block after super-block
// ([panels][K / 256][kW6kBlockBytes]), each super-block:
//   16 sub-blocks of 16 k, 192 bytes each: three 64-byte vectors of 16 columns x 4 bytes (lane c: column c):
//     lo01: byte i = q(k = 4 0 + i) & 15 | (q(k = 4 1 + i) & 15) << 4    (k relative to the sub-block)
//     lo23: byte i = q(k = 4 2 + i) & 15 | (q(k = 4 3 + i) & 15) << 4
//     hi:   byte i = sum_j (q(k = 4 j + i) >> 4) << 2 j
//   so quad j's codes (4 k x 16 columns, vpdpbusd's unsigned operand) are a nibble of lo01/lo23 or'ed with two
//   bits of hi moved to bits 4-5: 0.75 bytes a weight;
//   then sc [16 sub-blocks][16] int8, d [16] float16, 32 bytes of padding (3392 bytes: 53 cache lines).
//
// Five paths:
// * avx2 and above, any activation dtype, up to kW6kA8MaxRows rows (decode): the activations quantized to int8 per
//   super-block, the sums exact in int32 on AVX-512 VNNI or AVX2 integer vectors (gemm_w6k_vnni.h).
// * amx level, bf16 activations and kW6kAmxRows rows or more: each panel's codes widened to bf16 ((d sc) (q - 32)
//   rounded to float32, then to bf16) once per call (gemm_amx.h: CallWidened), then AMX-BF16 tiles.
// * avx512_bf16 level on CPUs that prefer its dot products (bf16_dot_preferred), bf16 activations and
//   kDotWidenedRows rows or more: the same bf16 weights, widened once per call, under vdpbf16ps (gemm_widened.h).
// * other calls of kWidenedRows rows or more: each panel group's weights (d sc) (q - 32) in float32, decoded
//   once per row block, under the float32 tiles (gemm_widened.h).
// * fewer rows: the float32 vector path. Each sub-block's codes become float32 values q - 32 in registers,
//   a tile of MR rows sums x (q - 32) over the sub-block and adds that sum times d sc once per sub-block.
#pragma once

namespace {

constexpr int64_t kW6kSuper = 256;                  // k per super-block
constexpr int64_t kW6kSubBytes = 192;               // bytes of one sub-block's codes in a panel
constexpr int64_t kW6kScaleAt = 16 * kW6kSubBytes;  // offset of the sub-scales in a super-block
constexpr int64_t kW6kDAt = kW6kScaleAt + 256;      // offset of d
constexpr int64_t kW6kBlockBytes = kW6kDAt + 64;    // bytes of one super-block of a panel
constexpr int64_t kW6kAmxRows = 16;                 // rows from which bf16 calls run on the AMX tiles (amx level)

// The packed weight's parts.
struct W6kLayout {
  int64_t KB, panels, pe;  // super-blocks per column; panels; bytes per panel
  const uint8_t* packed;
  W6kLayout(int64_t N, int64_t K, const uint8_t* p) : KB(K / kW6kSuper), panels((N + kPanel - 1) / kPanel), packed(p) {
    pe = KB * kW6kBlockBytes;
  }
  const uint8_t* block(int64_t panel, int64_t b) const { return packed + panel * pe + b * kW6kBlockBytes; }
};

// Quad J's code bytes (4 k of each column in each 32-bit lane) from a sub-block's three vectors.
template <int J, typename V>
inline V w6k_quad(V lo01, V lo23, V hi) {
  const V lo = J == 0 ? lo01 : J == 1 ? lo01 >> 4 : J == 2 ? lo23 : lo23 >> 4;
  const V h = J == 0 ? hi << 4 : J == 1 ? hi << 2 : J == 2 ? hi : hi >> 2;
  return (lo & 0x0f0f0f0fu) | (h & 0x30303030u);
}

// ---- the float32 vector path

constexpr int w6k_max_rows() { return kLanes == 16 ? 8 : 2; }
constexpr int w6k_panels(int MR) {  // 2 x MR x NP x kVecs sums, 3 code vectors, a code and a broadcast
  const int np = (kRegisters - 5) / (kVecs * 2 * MR);
  return np < 1 ? 1 : (np > 8 ? 8 : np);
}

// One quad of a sub-block: part[r][j] += x[r, k0 + 4 J + i] * (q - 32) for i < 4.
template <int MR, int NV, int J>
inline void w6k_quad_step(vf (&part)[MR][NV], const vu (&lo01)[NV], const vu (&lo23)[NV], const vu (&hi)[NV],
                          const float* xk, int64_t xs) {
  vu q[NV];
  for (int j = 0; j < NV; ++j) q[j] = w6k_quad<J>(lo01[j], lo23[j], hi[j]);
  for (int i = 0; i < 4; ++i) {
    vf c[NV];
    for (int j = 0; j < NV; ++j) c[j] = __builtin_convertvector(reinterpret_cast<vi32>((q[j] >> (8 * i)) & 0xffu), vf) - 32.0f;
    for (int r = 0; r < MR; ++r) {
      const float x0 = xk[r * xs + 4 * J + i];
      for (int j = 0; j < NV; ++j) part[r][j] = part[r][j] + x0 * c[j];
    }
  }
  if constexpr (J < 3) w6k_quad_step<MR, NV, J + 1>(part, lo01, lo23, hi, xk, xs);
}

// out[r, n0 + c] for MR rows and NP panels from panel p0.
template <int MR, int NP, typename A>
void w6k_tile(const W6kLayout& L, int64_t p0, const float* xf, int64_t xs, const A* bias, A* out, int64_t os,
              int64_t n0, int64_t N) {
  constexpr int NV = NP * kVecs;
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  for (int64_t b = 0; b < L.KB; ++b) {
    for (int g = 0; g < 16; ++g) {
      vu lo01[NV], lo23[NV], hi[NV];
      vf scale[NV];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* blk = L.block(p0 + p, b);
        const uint8_t* sub = blk + g * kW6kSubBytes;
        __builtin_prefetch(sub + 4 * kW6kSubBytes, 0, 3);  // all levels (gemm_w8.h: w8tile)
        const vf d = widen_halfs(reinterpret_cast<const _Float16*>(blk + kW6kDAt));
        for (int v = 0; v < kVecs; ++v) {
          const int j = p * kVecs + v;
          lo01[j] = load_vec<vu>(sub + 4 * v * kLanes);
          lo23[j] = load_vec<vu>(sub + 64 + 4 * v * kLanes);
          hi[j] = load_vec<vu>(sub + 128 + 4 * v * kLanes);
          vf dv;
          if constexpr (kVecs == 1) dv = d;
          else dv = widen_halfs(reinterpret_cast<const _Float16*>(blk + kW6kDAt) + v * kLanes);
          const vf sc = __builtin_convertvector(reinterpret_cast<vi32>(extend8<true>(blk + kW6kScaleAt + g * kPanel + v * kLanes)), vf);
          scale[j] = dv * sc;  // exact
        }
      }
      vf part[MR][NV];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) part[r][j] = vf{};
      w6k_quad_step<MR, NV, 0>(part, lo01, lo23, hi, xf + b * kW6kSuper + g * 16, xs);
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + part[r][j] * scale[j];
    }
  }
  store_rows<MR, NV>(acc, bias, nullptr, 0, out, os, n0, N);
}

template <int MR, int NP, typename A>
void w6k_tile_any(int np, const W6kLayout& L, int64_t p0, const float* xf, int64_t xs, const A* bias, A* out,
                  int64_t os, int64_t n0, int64_t N) {
  if constexpr (NP > 1) {
    if (np < NP) return w6k_tile_any<MR, NP - 1>(np, L, p0, xf, xs, bias, out, os, n0, N);
  }
  w6k_tile<MR, NP>(L, p0, xf, xs, bias, out, os, n0, N);
}

template <typename A, int MR>
void w6k_rows(int np, const W6kLayout& L, int64_t p0, const float* xf, int64_t xs, const A* bias, A* out, int64_t os,
              int64_t n0, int64_t N) {
  w6k_tile_any<MR, w6k_panels(MR)>(np, L, p0, xf, xs, bias, out, os, n0, N);
}

template <typename A>
using W6kRowsFn = void (*)(int, const W6kLayout&, int64_t, const float*, int64_t, const A*, A*, int64_t, int64_t,
                           int64_t);

template <typename A, int... R>
constexpr auto w6k_rows_table(std::integer_sequence<int, R...>) {
  return std::array<W6kRowsFn<A>, sizeof...(R)>{w6k_rows<A, R + 1>...};
}

template <typename A>
int w6k_linear_float(int64_t M, int64_t N, int64_t K, const W6kLayout& L, const A* x, int64_t xs, const A* bias, A* out,
                     int64_t os) {
  const int64_t fs = float_stride(K);
  const float* xf = widened_rows(M, K, fs, x, xs);
  constexpr int kRows = w6k_max_rows();
  static constexpr auto table = w6k_rows_table<A>(std::make_integer_sequence<int, kRows>{});
  for_row_tiles(M, N, K, K, kRows, L.panels, w6k_panels(M >= kRows ? kRows : static_cast<int>(M)),
                [&](int64_t p0, int np, int64_t m0, int mr) {
                  table[mr - 1](np, L, p0, xf + m0 * fs, fs, bias, out + m0 * os, os, p0 * kPanel, N);
                });
  return 0;
}

// Quads J.. of one sub-block's vectors (lanes of 16 columns) as float32 weights (d sc) (q - 32), rounded once (as
// gguf computes them), into the sub-block's 16 float32 panel rows at d.
template <int J>
inline void w6k_store_quads(vu lo01, vu lo23, vu hi, vf scale, float* d) {
  const vu q = w6k_quad<J>(lo01, lo23, hi);
  for (int i = 0; i < 4; ++i) {
    const vf w = scale * (__builtin_convertvector(reinterpret_cast<vi32>((q >> (8 * i)) & 0xffu), vf) - 32.0f);
    __builtin_memcpy(d + (4 * J + i) * kPanel, &w, sizeof w);
  }
  if constexpr (J < 3) w6k_store_quads<J + 1>(lo01, lo23, hi, scale, d);
}

// The float32 panels of gemm_widened.h: panels [p0, p0 + np) dequantized, [np][K][16] at dst.
struct W6kFloatPanels {
  const W6kLayout* L;
  void operator()(int64_t p0, int np, float* dst) const {
    const int64_t pe = L->KB * kW6kSuper * kPanel;
    for (int j = 0; j < np; ++j)
      for (int64_t b = 0; b < L->KB; ++b) {
        const uint8_t* blk = L->block(p0 + j, b);
        for (int g = 0; g < 16; ++g) {
          const uint8_t* sub = blk + g * kW6kSubBytes;
          for (int v = 0; v < kVecs; ++v) {
            const vf d = widen_halfs(reinterpret_cast<const _Float16*>(blk + kW6kDAt) + v * kLanes);
            const vf sc = __builtin_convertvector(reinterpret_cast<vi32>(extend8<true>(blk + kW6kScaleAt + g * kPanel + v * kLanes)), vf);
            w6k_store_quads<0>(load_vec<vu>(sub + 4 * v * kLanes), load_vec<vu>(sub + 64 + 4 * v * kLanes),
                               load_vec<vu>(sub + 128 + 4 * v * kLanes), d * sc,  // d sc: exact
                               dst + j * pe + (b * kW6kSuper + g * 16) * kPanel + v * kLanes);
          }
        }
      }
  }
};

#if HS_HAVE_BF16_DOT
// The weights of the amx path and of the dot-product path of many bf16 rows (gemm_widened.h): a unit is one
// sub-block of 16 k of a panel, widened into the bf16 k-pair layout (8 pairs of 16 columns), each weight
// (d sc) (q - 32) rounded to float32 (as gguf computes it), then to bf16.
struct W6kBlocks {
  const W6kLayout* L;
  int64_t units() const { return L->KB * 16; }
  const char* bytes(int64_t p) const { return reinterpret_cast<const char*>(L->packed + p * L->pe); }
  // units [from, to) of the panels from p on (panel j's unit u is j * units() + u) into dst (panel j at
  // j * 256 KB x 16)
  void widen(int64_t p, int64_t from, int64_t to, uint16_t* dst) const {
    const int64_t U = units(), pe = L->KB * kW6kSuper * kPanel;
    const __m512i bytes = _mm512_set1_epi32(0xff);
    for (int64_t i = from; i < to; ++i) {
      const int64_t j = i / U, u = i - j * U, b = u / 16, g = u % 16;
      const uint8_t* blk = L->block(p + j, b);
      const uint8_t* sub = blk + g * kW6kSubBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kW6kDAt)));
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kW6kScaleAt + g * kPanel))));
      const __m512 scale = _mm512_mul_ps(d, sc);  // exact
      const vu lo01 = load_vec<vu>(sub), lo23 = load_vec<vu>(sub + 64), hi = load_vec<vu>(sub + 128);
      const vu quads[4] = {w6k_quad<0>(lo01, lo23, hi), w6k_quad<1>(lo01, lo23, hi), w6k_quad<2>(lo01, lo23, hi),
                           w6k_quad<3>(lo01, lo23, hi)};
      uint16_t* out = dst + j * pe + u * 16 * kPanel;  // 8 k-pairs of 16 columns
      for (int q = 0; q < 4; ++q) {
        const __m512i w = reinterpret_cast<__m512i>(quads[q]);
        for (int h = 0; h < 2; ++h) {  // k-pair (4 q + 2 h, 4 q + 2 h + 1)
          const auto value = [&](int i) {
            const __m512i c = _mm512_and_si512(_mm512_srli_epi32(w, 8 * i), bytes);
            return _mm512_mul_ps(scale, _mm512_sub_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(32.0f)));
          };
          _mm512_storeu_si512(out + (2 * q + h) * 2 * kPanel, bf16_pairs(value(2 * h), value(2 * h + 1)));
        }
      }
    }
  }
};
#endif

}  // namespace

#include "gemm_w6k_vnni.h"  // few-row calls on int8 activations (AVX-512 VNNI)

namespace {

template <typename A>
int w6k_linear_any(int64_t M, int64_t N, int64_t K, const A* x, int64_t xs, const uint8_t* packed, const A* bias,
                   A* out, int64_t os) {
  if (M < 0 || N < 1 || K < kW6kSuper || K % kW6kSuper != 0) return 1;
  if (M == 0) return 0;
  const W6kLayout L(N, K, packed);
#if HS_HAVE_W6K_A8
  if (M <= kW6kA8MaxRows) return w6k_a8_linear(M, N, K, L, x, xs, bias, out, os);
#endif
#if HS_HAVE_AMX
  if constexpr (std::is_same_v<A, uint16_t>)
    if (M >= kW6kAmxRows) return amx_linear(M, N, K, x, xs, CallWidened<W6kBlocks>{W6kBlocks{&L}, K}, bias, nullptr, out, os);
#endif
#if HS_HAVE_BF16_DOT
  if constexpr (std::is_same_v<A, uint16_t>)
    if (dot_widened_takes(M))
      return dot_widened_linear(M, N, K, x, xs, W6kBlocks{&L}, bias, out, os);
#endif
  if (M >= kWidenedRows) return widened_linear(M, N, K, x, xs, bias, out, os, W6kFloatPanels{&L});
  return w6k_linear_float(M, N, K, L, x, xs, bias, out, os);
}

}  // namespace

extern "C" {

// 2: int8 activations on VNNI, 1: AMX-BF16 tiles over widened codes, 4: bf16 dot products over codes widened once
// per call, 3: float32 panels decoded once per row block, 0: the float32 vector path.
int hs_w6k_path(int act_dtype, int64_t rows) {
#if HS_HAVE_W6K_A8
  if (rows <= kW6kA8MaxRows) return 2;
#endif
#if HS_HAVE_AMX
  if (act_dtype == kBF16 && rows >= kW6kAmxRows) return 1;
#endif
#if HS_HAVE_BF16_DOT
  if (act_dtype == kBF16 && dot_widened_takes(rows)) return 4;
#endif
  (void)act_dtype;
  return rows >= kWidenedRows ? 3 : 0;
}

int hs_linear_w6k(int act_dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t xs, const uint8_t* packed,
                  const void* bias, void* out, int64_t os) {
  switch (act_dtype) {
    case kF32:
      return w6k_linear_any(M, N, K, static_cast<const float*>(x), xs, packed, static_cast<const float*>(bias),
                            static_cast<float*>(out), os);
    case kBF16:
      return w6k_linear_any(M, N, K, static_cast<const uint16_t*>(x), xs, packed, static_cast<const uint16_t*>(bias),
                            static_cast<uint16_t*>(out), os);
    case kF16:
      return w6k_linear_any(M, N, K, static_cast<const _Float16*>(x), xs, packed, static_cast<const _Float16*>(bias),
                            static_cast<_Float16*>(out), os);
    default:
      return 2;
  }
}

}  // extern "C"
