// Linear layers over 8-bit weights (int8 or fp8 e4m3) with float32 scales, y = x @ (W * s).T (+ b),
// activations bf16, fp16 or float32 (kernels/gemm.py: linear_w8). Included by gemm.cpp after its
// float32 vector helpers (vf, kLanes, load_vec, widen_scalar, store_vec, widen_rows, float_stride).
//
// A weight W (N, K) of 8-bit codes q with scales s (N, G) (G groups of `group` consecutive k; group 0
// means one group, a scale per output channel) is packed once into one byte buffer:
//   [panels][K][16] codes (panel p holds columns 16p .. 16p + 15, k major, pad columns 0), then
//   [panels][G][16] float32 scales (pad columns 0).
// The kernel widens each code to float32 in registers (int8: sign extension and conversion; e4m3: its
// sign, exponent and mantissa moved into a float32's bits, times 2^120, exact, subnormals included),
// sums x * q in float32 over a group, and multiplies the group's sum by its scale once: per channel,
// that is once per output, after the whole sum. The result, plus the bias, is rounded once to the
// activation dtype. (AVX-512 VNNI's int8 dot products would need the activations quantized to 8 bits
// too, which this weight-only path does not do.)
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// (4-bit ones, gemm_w4.h, only in the MoE experts' formats: centred codes with sub-scales (the experts
// --quantization int4 makes), or codes with float16 scales and mins)
enum WeightFormat : int { kNativeWeights = 0, kInt8Weights = 1, kFp8E4m3Weights = 2, kInt4Weights = 3,
                          kInt4MinsWeights = 4 };
constexpr int64_t kW8DotRows = 4;  // rows from which avx512_bf16 runs bf16 activations on dot products

typedef uint8_t vb8 __attribute__((vector_size(kLanes)));
typedef int8_t vi8 __attribute__((vector_size(kLanes)));
typedef int32_t vi32 __attribute__((vector_size(4 * kLanes)));

// kLanes bytes, sign- (int8) or zero-extended (e4m3) to 32-bit lanes. GCC's generic vector
// conversions of byte vectors are scalarized, so the x86 levels use the extension instructions.
template <bool Signed>
inline vu extend8(const uint8_t* p) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vu>(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
#endif
#if defined(__AVX2__)
  if constexpr (kLanes == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vu>(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
#endif
  if constexpr (Signed) return reinterpret_cast<vu>(__builtin_convertvector(load_vec<vi8>(p), vi32));
  else return __builtin_convertvector(load_vec<vb8>(p), vu);
}

// kLanes codes of format F as float32 (the unscaled weight values).
template <int F>
inline vf widen8(const uint8_t* p) {
  if constexpr (F == kInt8Weights) {
    return __builtin_convertvector(reinterpret_cast<vi32>(extend8<true>(p)), vf);
  } else {  // e4m3fn: s eeee mmm -> float32 s, 0000eeee, mmm0...: the value times 2^-120
    const vu b = extend8<false>(p);
    const vu u = ((b & 0x7fu) << 20) | ((b & 0x80u) << 24);
    return reinterpret_cast<vf>(u) * 0x1p120f;
  }
}

// Registers: MR x NP x kVecs sums (twice that when grouped: the group's partial sums), NP x kVecs
// widened weights and one broadcast.
template <bool Grouped>
constexpr int w8_max_rows() {
  return Grouped ? (kLanes == 16 ? 8 : 3) : (kLanes == 16 ? 8 : 6);
}
template <bool Grouped>
constexpr int w8_panels(int MR) {
  const int np = (kRegisters - 1) / (kVecs * ((Grouped ? 2 * MR : MR) + 1));
  return np < 1 ? 1 : (np > 8 ? 8 : np);
}

// out[r, n0 + c] = sum_g s[g, c] sum_{k in g} xf[r, k] q[k, c] + bias for MR rows and NP panels.
// w: the first panel's codes ([K][16] each, pe bytes apart); sc: its scales ([G][16] each, ps apart).
template <int MR, int NP, int F, bool Grouped, typename A>
void w8tile(int64_t K, int64_t gs, const float* xf, int64_t xs, const uint8_t* w, int64_t pe, const float* sc,
            int64_t ps, const A* bias, A* out, int64_t os, int64_t n0, int64_t N) {
  constexpr int NV = NP * kVecs;
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += gs, ++gi) {
    const int64_t g1 = std::min(K, g0 + gs);
    vf part[Grouped ? MR : 1][Grouped ? NV : 1];
    if constexpr (Grouped)
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) part[r][j] = vf{};
    for (int64_t k = g0; k < g1; ++k) {
      vf wv[NV];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* row = w + p * pe + k * kPanel;
        // 16 k ahead, a line per 4 k, into every cache level: the panel is read again by the block's other
        // row tiles (a non-temporal hint made a 512-row int8 linear 6x slower on an Intel Xeon)
        if ((k & 3) == 0) __builtin_prefetch(row + 16 * kPanel, 0, 3);
        for (int v = 0; v < kVecs; ++v) wv[p * kVecs + v] = widen8<F>(row + v * kLanes);
      }
      for (int r = 0; r < MR; ++r) {
        const float x0 = xf[r * xs + k];
        for (int j = 0; j < NV; ++j) {
          if constexpr (Grouped) part[r][j] = part[r][j] + x0 * wv[j];
          else acc[r][j] = acc[r][j] + x0 * wv[j];
        }
      }
    }
    if constexpr (Grouped) {
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < kVecs; ++v) {
          const vf s = load_vec<vf>(sc + p * ps + gi * kPanel + v * kLanes);
          for (int r = 0; r < MR; ++r) acc[r][p * kVecs + v] = acc[r][p * kVecs + v] + part[r][p * kVecs + v] * s;
        }
    }
  }
  // grouped: each group's scales are in acc already
  store_rows<MR, NV>(acc, bias, Grouped ? nullptr : sc, ps, out, os, n0, N);
}

template <int MR, int NP, int F, bool Grouped, typename A>
void w8tile_any(int np, int64_t K, int64_t gs, const float* xf, int64_t xs, const uint8_t* w, int64_t pe,
                const float* sc, int64_t ps, const A* bias, A* out, int64_t os, int64_t n0, int64_t N) {
  if constexpr (NP > 1) {
    if (np < NP) return w8tile_any<MR, NP - 1, F, Grouped>(np, K, gs, xf, xs, w, pe, sc, ps, bias, out, os, n0, N);
  }
  w8tile<MR, NP, F, Grouped>(K, gs, xf, xs, w, pe, sc, ps, bias, out, os, n0, N);
}

template <int F, bool Grouped, typename A, int MR>
void w8rows(int np, int64_t K, int64_t gs, const float* xf, int64_t xs, const uint8_t* w, int64_t pe,
            const float* sc, int64_t ps, const A* bias, A* out, int64_t os, int64_t n0, int64_t N) {
  w8tile_any<MR, w8_panels<Grouped>(MR), F, Grouped>(np, K, gs, xf, xs, w, pe, sc, ps, bias, out, os, n0, N);
}

template <typename A>
using W8RowsFn = void (*)(int, int64_t, int64_t, const float*, int64_t, const uint8_t*, int64_t, const float*,
                          int64_t, const A*, A*, int64_t, int64_t, int64_t);

template <int F, bool Grouped, typename A, int... R>
constexpr auto w8rows_table(std::integer_sequence<int, R...>) {
  return std::array<W8RowsFn<A>, sizeof...(R)>{w8rows<F, Grouped, A, R + 1>...};
}

// Groups of one packed weight: G groups of gs k (group 0: one group of K).
inline int64_t w8_group_size(int64_t K, int64_t group) { return group > 0 && group < K ? group : K; }
inline int64_t w8_groups(int64_t K, int64_t group) {
  const int64_t gs = w8_group_size(K, group);
  return (K + gs - 1) / gs;
}

// out (M, N) = x (M, K) @ (q * s).T + bias; x, bias and out in the activation storage type A.
template <int F, bool Grouped, typename A>
int w8linear(int64_t M, int64_t N, int64_t K, int64_t group, const A* x, int64_t xs, const uint8_t* packed,
             const A* bias, A* out, int64_t os) {
  const int64_t gs = w8_group_size(K, group), G = w8_groups(K, group);
  const int64_t panels = (N + kPanel - 1) / kPanel, pe = K * kPanel, ps = G * kPanel;
  const float* scales = reinterpret_cast<const float*>(packed + panels * pe);
  const int64_t fs = float_stride(K + (K & 1));
  const float* xf = widened_rows(M, K, fs, x, xs);
  constexpr int kRows = w8_max_rows<Grouped>();
  static constexpr auto table = w8rows_table<F, Grouped, A>(std::make_integer_sequence<int, kRows>{});
  for_row_tiles(M, N, K, K, kRows, panels, w8_panels<Grouped>(M >= kRows ? kRows : static_cast<int>(M)),
                [&](int64_t p0, int np, int64_t m0, int mr) {
                  table[mr - 1](np, K, gs, xf + m0 * fs, fs, packed + p0 * pe, pe, scales + p0 * ps, ps, bias,
                                out + m0 * os, os, p0 * kPanel, N);
                });
  return 0;
}

#if HS_HAVE_BF16_DOT
// The avx512_bf16 path for bf16 activations, per-channel scales, even K and kW8DotRows rows or more:
// each panel group's codes are widened once per call into a thread's scratch in the bf16 k-pair layout
// (exactly: an int8 code has at most 7 significant bits, an e4m3 one 4, and bf16 holds 8), and every
// row tile runs the 16-bit kernel's vdpbf16ps tile over it, its float32 sums times the column scales.
// Against the float32 vector path at 32 rows: 193 us instead of 433 for a 3224 x 768 weight, 2.5 ms
// instead of 4.4 for the 32000 x 768 LM head (benchmark model shapes, 2 threads, Zen 5).
// The k-pair kk of a [K][16] panel of codes as 16 bf16 pairs (k even in the low half of each lane). A
// code's float32 value has at most 7 significant bits (int8) or 4 (e4m3), so its high half is its exact
// bf16: a shift and a word blend pair the halves up, in place of a rounding conversion and a word permute
// (the 8-bit linears of a 32-row decode step of the benchmark model: 2% less time, Zen 5).
template <int F>
inline __m512i widen_pair_bf16(const uint8_t* panel, int64_t kk) {
  const __m512i even = reinterpret_cast<__m512i>(widen8<F>(panel + 2 * kk * kPanel));
  const __m512i odd = reinterpret_cast<__m512i>(widen8<F>(panel + (2 * kk + 1) * kPanel));
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even, 16), odd);
}

// The weight source of the first row tile of a panel group: the codes widened as the tile goes (the
// conversions overlap the dot products) and stored to `w` for the group's other row tiles.
template <int F>
struct WidenedCodes {
  const uint8_t* codes;
  int64_t pe;
  uint16_t* w;
  int64_t panel_elems;
  __m512bh operator()(int j, int64_t kk) const {
    const __m512i v = widen_pair_bf16<F>(codes + j * pe, kk);
    _mm512_storeu_si512(w + j * panel_elems + kk * 2 * kPanel, v);
    return (__m512bh)v;
  }
};

template <int MR, int NR, int F>
void widen_tile(int64_t K2, const uint16_t* x, int64_t xs, const uint8_t* codes, int64_t pe, uint16_t* w,
                int64_t panel_elems, const uint16_t* bias, const float* scale, uint16_t* out, int64_t os, int64_t n0,
                int64_t N, Ahead ahead) {
  tile_over<MR, NR>(K2, x, xs, WidenedCodes<F>{codes, pe, w, panel_elems}, bias, scale, out, os, n0,
                    N, ahead);
}

template <int MR, int NR, int F>
void widen_tile_any(int nr, int64_t K2, const uint16_t* x, int64_t xs, const uint8_t* codes, int64_t pe, uint16_t* w,
                    int64_t panel_elems, const uint16_t* bias, const float* scale, uint16_t* out, int64_t os,
                    int64_t n0, int64_t N, Ahead ahead) {
  if constexpr (NR > 1) {
    if (nr < NR)
      return widen_tile_any<MR, NR - 1, F>(nr, K2, x, xs, codes, pe, w, panel_elems, bias, scale, out, os, n0, N,
                                           ahead);
  }
  widen_tile<MR, NR, F>(K2, x, xs, codes, pe, w, panel_elems, bias, scale, out, os, n0, N, ahead);
}

template <int F, int MR>
void widen_tile_rows(int nr, int64_t K2, const uint16_t* x, int64_t xs, const uint8_t* codes, int64_t pe,
                     uint16_t* w, int64_t panel_elems, const uint16_t* bias, const float* scale, uint16_t* out,
                     int64_t os, int64_t n0, int64_t N, Ahead ahead) {
  widen_tile_any<MR, max_panels(MR), F>(nr, K2, x, xs, codes, pe, w, panel_elems, bias, scale, out, os, n0, N, ahead);
}

template <int F>
using WidenRowsFn = void (*)(int, int64_t, const uint16_t*, int64_t, const uint8_t*, int64_t, uint16_t*, int64_t,
                             const uint16_t*, const float*, uint16_t*, int64_t, int64_t, int64_t, Ahead);
template <int F>
constexpr WidenRowsFn<F> kWidenRows[9] = {nullptr,
                                          widen_tile_rows<F, 1>, widen_tile_rows<F, 2>, widen_tile_rows<F, 3>,
                                          widen_tile_rows<F, 4>, widen_tile_rows<F, 5>, widen_tile_rows<F, 6>,
                                          widen_tile_rows<F, 7>, widen_tile_rows<F, 8>};

template <int F>
int w8_dot_linear(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const uint8_t* packed,
                  const uint16_t* bias, uint16_t* out, int64_t os) {
  const int64_t K2 = K / 2, pe = K * kPanel, panels = (N + kPanel - 1) / kPanel;
  const float* scales = reinterpret_cast<const float*>(packed + panels * pe);  // (panels * 16,): one group
  const int MR = M >= 8 ? 8 : static_cast<int>(M);
  const int64_t group = max_panels(MR), groups = (panels + group - 1) / group;
  const bool parallel = groups > 1 && (N * K >= (1 << 15) || M * N * K >= (1 << 19));
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    static thread_local std::vector<uint16_t> scratch;
    const int nr = static_cast<int>(std::min(group, panels - g * group));
    if (static_cast<int64_t>(scratch.size()) < nr * K * kPanel) scratch.resize(nr * K * kPanel);
    // while the row tiles compute, they request the next group's codes into L2 (a slice each), so its
    // widening does not wait on memory: 8.4 -> 6.1 ms of linears in a 32-sequence decode step of the
    // benchmark model (the 16-bit path's look-ahead, over the 8-bit codes)
    const int64_t tiles = (M + 7) / 8;
    const char* next = reinterpret_cast<const char*>(packed + (g * group + nr) * pe);
    const int64_t next_panels = g + 1 < groups ? std::min(group, panels - (g + 1) * group) : 0;
    const char* next_end = next + next_panels * pe;
    for (int64_t m0 = 0, t = 0; m0 < M; m0 += 8, ++t) {
      const int mr = M - m0 >= 8 ? 8 : static_cast<int>(M - m0);
      const Ahead ahead = tile_ahead(next, next_end, tiles, K2, t);
      if (t == 0)  // widens the group's codes into the scratch as it computes
        kWidenRows<F>[mr](nr, K2, x, xs, packed + g * group * pe, pe, scratch.data(), K * kPanel, bias, scales, out,
                          os, g * group * kPanel, N, ahead);
      else
        kRows[mr](nr, K2, x + m0 * xs, xs, scratch.data(), K * kPanel, bias, scales, out + m0 * os, os,
                  g * group * kPanel, N, ahead);
    }
  }
  return 0;
}

#if HS_HAVE_AMX
// The amx path's weight sources for 8-bit codes ([K][16] per panel, pe bytes apart), widened exactly to the
// bf16 k-pair layout (as above); the tiles sum x * codes and amx_store multiplies by the column scales.
//
// Calls of many rows: each thread widens its column blocks into a ring of two block copies in its scratch
// (2 x 2 x K x 16 bf16: 128 KiB at K = 2048, so they stay in L2), block b into slot b % 2. While a block's row
// blocks compute on the tiles, each k-step widens a share of the next block's codes into the other slot
// (Ahead): the vector work overlaps the tile products, and only a thread's first block of each row chunk is
// widened before its tiles start. Every row chunk (of kChunkBytes of activations) widens its blocks again from
// the codes, so a chunk reads the 8-bit codes from memory (half the bf16 weights' bytes) and no widened copy
// goes through memory.
template <int F>
struct WidenedPanels {
  // Each row chunk widens the codes again, so the chunks are twice the 16-bit path's: 1 MiB of activations and
  // the 128 KiB ring share a 2 MiB L2 (every AMX CPU's): a 1024-row int8 linear (K = 2048, N = 8512, one
  // thread) took 0.92x the time with 512 KiB chunks.
  static constexpr int64_t kChunkBytes = 2 * kAmxChunkBytes;
  using Block = PanelTiles;
  const uint8_t* codes;
  int64_t K;
  struct Scratch {
    std::vector<uint16_t> data;  // the two slots
    int64_t ahead_panel = -1;    // the block being widened ahead (its first panel), and its k-pairs done so far
    int64_t ahead_done = 0;
  };
  static Scratch& scratch() {
    static thread_local Scratch s;
    return s;
  }
  // Widens k-pairs of one panel range [from, to) (counted over the block: panel j's pair kk is j * K/2 + kk)
  static void widen(const uint8_t* first, int64_t K, int64_t from, int64_t to, uint16_t* dst) {
    const int64_t pairs = K / 2, pe = K * kPanel;
    for (int64_t i = from; i < to; ++i) {
      const int64_t j = i / pairs, kk = i - j * pairs;
      _mm512_storeu_si512(dst + j * pe + kk * 2 * kPanel, widen_pair_bf16<F>(first + j * pe, kk));
    }
  }
  // The next block's work while a block computes: widening its codes into its slot, per_step k-pairs a k-step.
  struct Ahead {
    const uint8_t* first = nullptr;  // the next block's codes, its slot, its k-pairs (over its panels)
    uint16_t* dst = nullptr;
    int64_t K = 0, total = 0, per_step = 0;
    int64_t* done = nullptr;  // Scratch::ahead_done
    inline void step() {
      if (done == nullptr || *done >= total) return;
      const int64_t to = std::min(total, *done + per_step);
      widen(first, K, *done, to, dst);
      *done = to;
    }
  };
  // The slot of the block whose first panel is p (blocks are two panels)
  uint16_t* slot(Scratch& s, int64_t p) const { return s.data.data() + ((p / 2) % 2) * 2 * K * kPanel; }
  void begin(int64_t, int64_t) const {  // this thread's panels for this call
    Scratch& s = scratch();
    s.ahead_panel = -1;
    if (static_cast<int64_t>(s.data.size()) < 4 * K * kPanel) s.data.resize(4 * K * kPanel);
  }
  Ahead ahead(int64_t p, int np, int64_t /*chunk*/, int64_t row_steps) const {
    Scratch& s = scratch();
    s.ahead_panel = p;
    s.ahead_done = 0;
    Ahead a;
    a.first = codes + p * K * kPanel;
    a.dst = slot(s, p);
    a.K = K;
    a.total = np * (K / 2);
    a.per_step = (a.total + std::max<int64_t>(row_steps, 1) - 1) / std::max<int64_t>(row_steps, 1);
    a.done = &s.ahead_done;
    return a;
  }
  PanelTiles block(int64_t p, int np, int64_t /*chunk*/) const {
    Scratch& s = scratch();
    uint16_t* dst = slot(s, p);
    const int64_t from = s.ahead_panel == p ? s.ahead_done : 0;  // widen what the block before did not
    widen(codes + p * K * kPanel, K, from, np * (K / 2), dst);
    s.ahead_panel = -1;
    return PanelTiles{dst, K * kPanel};
  }
};

// Calls of one row block (kW8StepRows rows or fewer), where each code is read once: the codes of one k-step
// (32 k of each panel) are widened into an L1 buffer just before its tiles load, so no widened copy of the
// block goes through L2; the k-pairs past the last whole step are widened into a second buffer for the store.
template <int F>
struct StepWidenedTiles {
  const uint8_t* codes;  // the block's first panel
  int64_t pe;            // bytes of a panel's codes
  int64_t K2, tail_pairs;
  uint16_t* step_buf;    // 2 x 16 pairs x 32
  uint16_t* tail_buf;    // 2 x tail_pairs x 32
  const uint16_t* tile(int j, int64_t step) const {
    uint16_t* dst = step_buf + j * 16 * 2 * kPanel;
    for (int64_t i = 0; i < 16; ++i)
      _mm512_storeu_si512(dst + i * 2 * kPanel, widen_pair_bf16<F>(codes + j * pe, step * 16 + i));
    return dst;
  }
  const uint16_t* tail(int64_t /*pair*/) const { return tail_buf; }
  int64_t tail_stride() const { return tail_pairs * 2 * kPanel; }
};

template <int F>
struct StepWidened {
  static constexpr int64_t kChunkBytes = kAmxChunkBytes;
  using Block = StepWidenedTiles<F>;
  using Ahead = TileAhead;
  const uint8_t* codes;
  int64_t K;
  void begin(int64_t, int64_t) const {}
  TileAhead ahead(int64_t p, int np, int64_t /*chunk*/, int64_t row_steps) const {  // the codes
    return lines_ahead(reinterpret_cast<const char*>(codes + p * K * kPanel),
                       reinterpret_cast<const char*>(codes + (p + np) * K * kPanel), row_steps);
  }
  StepWidenedTiles<F> block(int64_t p, int np, int64_t /*chunk*/) const {
    static thread_local std::vector<uint16_t> buffers;
    const int64_t K2 = K / 2, tail_pairs = K2 % 16, pe = K * kPanel;
    if (static_cast<int64_t>(buffers.size()) < 2 * (16 + tail_pairs) * 2 * kPanel + 32)
      buffers.resize(2 * (16 + tail_pairs) * 2 * kPanel + 32);
    // 64-byte aligned: the tiles load whole lines
    uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffers.data()) + 63) & ~uintptr_t(63));
    const StepWidenedTiles<F> b{codes + p * pe, pe, K2, tail_pairs, base, base + 2 * 16 * 2 * kPanel};
    for (int j = 0; j < np; ++j)
      for (int64_t i = 0; i < tail_pairs; ++i)
        _mm512_storeu_si512(b.tail_buf + j * tail_pairs * 2 * kPanel + i * 2 * kPanel,
                            widen_pair_bf16<F>(b.codes + j * pe, K2 - tail_pairs + i));
    return b;
  }
};

constexpr int64_t kW8StepRows = 32;  // rows up to which the codes are widened per k-step (StepWidened)
// rows from which bf16 calls run on the tiles: fewer take the float32 vector path, which streams the codes faster
// (one linear, K = N = 2048, weights from memory, Intel Xeon, 2 threads: 1 row 51 against 40 GFLOP/s, 3 rows 140
// against 117; 4 rows 117 against 156)
constexpr int64_t kW8AmxRows = 4;

template <int F>
int w8_amx_linear(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const uint8_t* packed,
                  const uint16_t* bias, uint16_t* out, int64_t os) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const float* scales = reinterpret_cast<const float*>(packed + panels * K * kPanel);  // (panels * 16,)
  if (M <= kW8StepRows) return amx_linear(M, N, K, x, xs, StepWidened<F>{packed, K}, bias, scales, out, os);
  return amx_linear(M, N, K, x, xs, WidenedPanels<F>{packed, K}, bias, scales, out, os);
}
#endif
#endif

template <typename A>
int w8linear_any(int wfmt, int64_t M, int64_t N, int64_t K, int64_t group, const A* x, int64_t xs,
                 const uint8_t* packed, const A* bias, A* out, int64_t os) {
  if (M < 0 || N < 1 || K < 1 || group < 0) return 1;
  if (M == 0) return 0;
  const bool grouped = w8_groups(K, group) > 1;
#if HS_HAVE_BF16_DOT
  if constexpr (std::is_same_v<A, uint16_t>) {
#if HS_HAVE_AMX
    if (!grouped && K % 2 == 0 && M >= kW8AmxRows) {
      if (wfmt == kInt8Weights) return w8_amx_linear<kInt8Weights>(M, N, K, x, xs, packed, bias, out, os);
      if (wfmt == kFp8E4m3Weights) return w8_amx_linear<kFp8E4m3Weights>(M, N, K, x, xs, packed, bias, out, os);
    }
#endif
    // (the CPU vendor's choice, as for bf16 weights: on Intel the float32 path streams the codes faster, 279-320
    // against 163-227 GFLOP/s at 8-512 rows, K = N = 2048, 2 threads, capped at avx512_bf16)
    if (!grouped && K % 2 == 0 && M >= kW8DotRows && bf16_dot_preferred()) {
      if (wfmt == kInt8Weights) return w8_dot_linear<kInt8Weights>(M, N, K, x, xs, packed, bias, out, os);
      if (wfmt == kFp8E4m3Weights) return w8_dot_linear<kFp8E4m3Weights>(M, N, K, x, xs, packed, bias, out, os);
    }
  }
#endif
  if (wfmt == kInt8Weights)
    return grouped ? w8linear<kInt8Weights, true>(M, N, K, group, x, xs, packed, bias, out, os)
                   : w8linear<kInt8Weights, false>(M, N, K, group, x, xs, packed, bias, out, os);
  if (wfmt == kFp8E4m3Weights)
    return grouped ? w8linear<kFp8E4m3Weights, true>(M, N, K, group, x, xs, packed, bias, out, os)
                   : w8linear<kFp8E4m3Weights, false>(M, N, K, group, x, xs, packed, bias, out, os);
  return 3;
}

}  // namespace

extern "C" {

int hs_pack_w8(int64_t N, int64_t K, int64_t group, const uint8_t* q, int64_t qs, const float* scales,
               uint8_t* out) {
  if (N < 1 || K < 1 || group < 0) return 1;
  const int64_t panels = (N + kPanel - 1) / kPanel, G = w8_groups(K, group), pe = K * kPanel;
  float* sc = reinterpret_cast<float*>(out + panels * pe);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        out[p * pe + k * kPanel + c] = n < N ? q[n * qs + k] : 0;
      }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        sc[(p * G + g) * kPanel + c] = n < N ? scales[n * G + g] : 0.0f;
      }
  }
  return 0;
}

int hs_linear_w8(int act_dtype, int wfmt, int64_t M, int64_t N, int64_t K, int64_t group, const void* x, int64_t xs,
                 const uint8_t* packed, const void* bias, void* out, int64_t os) {
  switch (act_dtype) {
    case kF32:
      return w8linear_any(wfmt, M, N, K, group, static_cast<const float*>(x), xs, packed,
                          static_cast<const float*>(bias), static_cast<float*>(out), os);
    case kBF16:
      return w8linear_any(wfmt, M, N, K, group, static_cast<const uint16_t*>(x), xs, packed,
                          static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), os);
    case kF16:
      return w8linear_any(wfmt, M, N, K, group, static_cast<const _Float16*>(x), xs, packed,
                          static_cast<const _Float16*>(bias), static_cast<_Float16*>(out), os);
    default:
      return 2;
  }
}

}  // extern "C"
