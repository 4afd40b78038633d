// bf16 linears on the AMX matrix units (the amx level: AMX-TILE + AMX-BF16), y = x @ W.T (+ b), float32
// sums rounded once to bf16. Included by gemm.cpp inside its avx512_bf16 section (it uses kPanel,
// bf16_to_f32 and the 16-bit packing).
//
// The packed bf16 panel [Kp/2][16][2] is already the layout of an AMX B tile: one tile row is one k-pair
// for 16 columns (64 bytes), so a B tile of 16 rows covers 32 k of one panel and loads straight from the
// packed weights (stride 64), with no repacking and no second copy. An A tile is 16 rows of x and 32 k,
// loaded from x itself (its row stride); the last 16-row group of a call, when partial, is first copied
// into a zero-padded scratch so that no load reads past x.
//
// A block is 32 rows x 32 columns: two A tiles, two B tiles, four float32 C tiles (tmm0-3), one
// tdpbf16ps per (A, B) pair and k-step of 32. The k-pairs past the last whole step (K % 32) are added
// to the stored C values with AVX-512 BF16 dot products, then the bias (and the 8-bit weights' column
// scales), and the sum is rounded to bf16 (nearest even), as the dot-product path does.
//
// Loop order per thread: its columns are a contiguous range of 32-column blocks (threads split the
// weights, each reads its own once per row chunk); rows go in chunks whose activations fit in L2
// (kAmxChunkBytes), so a chunk's A tiles come from L2 for every column block, and a column block's
// 2 x K x 16 weights stay in L2 across the chunk's row blocks.
#pragma once

#include <cstring>
#include <vector>

#include "amx_tiles.h"

constexpr int64_t kAmxMinRows = 1;  // rows from which a bf16 linear runs on tiles (fewer: dot products)
constexpr int64_t kAmxChunkBytes = 512 * 1024;  // activations of one row chunk

// Tiles: tmm0-3 C (16 x 16 float32), tmm4-5 A (16 x 32 bf16), tmm6-7 B (16 k-pairs x 16 columns x 2).
constexpr int kAmxLinearTiles = 8;

// The B tiles of one column block (one or two panels) whose bf16 panels lie in memory: panel j at w + j * pe.
struct PanelTiles {
  const uint16_t* w;
  int64_t pe;
  const uint16_t* tile(int j, int64_t step) const { return w + j * pe + step * 32 * kPanel; }
  // the k-pairs from `pair` on, for amx_store's tail, and the panel stride there
  const uint16_t* tail(int64_t pair) const { return w + pair * 2 * kPanel; }
  int64_t tail_stride() const { return pe; }
};

// Lines of the next column block's weights requested into L2 while a block computes, `per_step` lines per
// k-step from `next` on (advanced), up to `end`. Default: none.
struct TileAhead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  inline void step() {
    for (int64_t l = 0; l < per_step && next < end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// The bytes [begin, end) requested evenly over the `row_steps` k-steps of a block's row blocks.
inline TileAhead lines_ahead(const char* begin, const char* end, int64_t row_steps) {
  const int64_t lines = (end - begin + 63) / 64, n = std::max<int64_t>(row_steps, 1);
  return TileAhead{begin, end, (lines + n - 1) / n};
}

// Weights already in the bf16 panel layout (hs_pack_bf16): a column block's tiles are read where they are.
struct PackedPanels {
  static constexpr int64_t kChunkBytes = kAmxChunkBytes;
  using Block = PanelTiles;
  using Ahead = TileAhead;
  const uint16_t* panels;
  int64_t pe;
  void begin(int64_t, int64_t) const {}
  PanelTiles block(int64_t p, int /*np*/, int64_t /*chunk*/) const { return PanelTiles{panels + p * pe, pe}; }
  // panels [p, p + np) requested while the block before them computes its row_steps k-steps
  TileAhead ahead(int64_t p, int np, int64_t /*chunk*/, int64_t row_steps) const {
    return lines_ahead(reinterpret_cast<const char*>(panels + p * pe), reinterpret_cast<const char*>(panels + (p + np) * pe),
                       row_steps);
  }
};

// Weights of many-row calls widened to bf16 once per call (the 4-bit codes, whose dequantization costs more
// vector work a weight than reading the copy back; 8-bit codes are widened again per row chunk, gemm_w8.h): Src widens the "units"
// [from, to) of the panels starting at p (counted over those panels, units() a panel: k-pairs for 8-bit codes,
// 8-k words for 4-bit ones) into the bf16 k-pair layout at dst (panel j at dst + j * K * kPanel), and gives the
// address of panel p's codes (bytes(p); panels are contiguous).
//
// The thread's scratch holds a widened copy of every column block the thread owns (up to kWholeBytes; past that,
// one block's copy, widened again for every row chunk), kept between calls (the largest layer's share per thread:
// 17 MB for a 2048 x 8512 weight). In the first row chunk, while a block's row blocks compute on the tiles, each
// k-step widens a share of the next block's codes into its copy (Ahead): the vector work overlaps the tile
// products, and only a thread's first block is widened before its tiles start. The later chunks' row blocks read
// the copies, requesting the next block's into L2. So a call widens each weight once whatever its row count.
template <typename Src>
struct CallWidened {
  static constexpr int64_t kChunkBytes = kAmxChunkBytes;
  static constexpr int64_t kWholeBytes = 64 << 20;
  using Block = PanelTiles;
  Src src;
  int64_t K;
  struct Scratch {
    std::vector<uint16_t> data;
    int64_t first = 0;         // the first panel the copies start at
    bool whole = false;        // a copy per block (else one block's, rewritten)
    int64_t ahead_panel = -1;  // the block being widened ahead (its first panel), and its units done so far
    int64_t ahead_done = 0;
  };
  static Scratch& scratch() {
    static thread_local Scratch s;
    return s;
  }
  // The next block's work while a block computes: in the first row chunk (whole copies), widening its codes,
  // per_step units a k-step; otherwise requesting its bytes into L2.
  struct Ahead {
    TileAhead lines{};
    const Src* src = nullptr;
    int64_t p = 0;  // the next block's first panel, its copy, its units (over its panels)
    uint16_t* dst = nullptr;
    int64_t total = 0, per_step = 0;
    int64_t* done = nullptr;  // Scratch::ahead_done
    inline void step() {
      lines.step();
      if (done == nullptr || *done >= total) return;
      const int64_t to = std::min(total, *done + per_step);
      src->widen(p, *done, to, dst);
      *done = to;
    }
  };
  void begin(int64_t p_begin, int64_t p_end) const {  // this thread's panels for this call
    Scratch& s = scratch();
    const int64_t pe = K * kPanel;
    s.first = p_begin;
    s.whole = (p_end - p_begin) * pe * 2 <= kWholeBytes;
    s.ahead_panel = -1;
    const int64_t need = (s.whole ? p_end - p_begin : 2) * pe;
    if (static_cast<int64_t>(s.data.size()) < need) s.data.resize(need);
  }
  Ahead ahead(int64_t p, int np, int64_t chunk, int64_t row_steps) const {
    Scratch& s = scratch();
    const int64_t pe = K * kPanel;  // bf16 elements of a panel's widened copy
    Ahead a;
    if (chunk == 0 && s.whole) {
      s.ahead_panel = p;
      s.ahead_done = 0;
      a.src = &src;
      a.p = p;
      a.dst = s.data.data() + (p - s.first) * pe;
      a.total = np * src.units();
      a.per_step = (a.total + std::max<int64_t>(row_steps, 1) - 1) / std::max<int64_t>(row_steps, 1);
      a.done = &s.ahead_done;
    } else if (s.whole) {  // the widened copies, read again
      const char* begin = reinterpret_cast<const char*>(s.data.data() + (p - s.first) * pe);
      a.lines = lines_ahead(begin, begin + np * pe * 2, row_steps);
    } else {  // the codes
      a.lines = lines_ahead(src.bytes(p), src.bytes(p + np), row_steps);
    }
    return a;
  }
  PanelTiles block(int64_t p, int np, int64_t chunk) const {
    Scratch& s = scratch();
    const int64_t pe = K * kPanel;
    uint16_t* dst = s.whole ? s.data.data() + (p - s.first) * pe : s.data.data();
    if (chunk == 0 || !s.whole) {  // widen what the block before did not
      const int64_t from = chunk == 0 && s.ahead_panel == p ? s.ahead_done : 0;
      src.widen(p, from, np * src.units(), dst);
    }
    return PanelTiles{dst, pe};
  }
};

// C (+)= A x B over `steps` k-steps of 32: MT A tiles (16-row groups at a0, a1, row strides in bytes) by NP
// panels of `b` (its tile(j, step)); ahead.step() once per k-step (the next block's weights).
template <int MT, int NP, typename Tiles, typename Ahead>
inline void amx_block(int64_t steps, const uint16_t* a0, const uint16_t* a1, int64_t a_stride, const Tiles& b,
                      Ahead& ahead) {
  amx_zero_sums<MT, NP>();
  for (int64_t s = 0; s < steps; ++s) {
    ahead.step();
    _tile_loadd(6, b.tile(0, s), 64);
    _tile_loadd(4, a0 + s * 32, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP > 1) {
      _tile_loadd(7, b.tile(1, s), 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT > 1) {
      _tile_loadd(5, a1 + s * 32, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Stores the block's C tiles to c (32 x 32 float32), finishes the k-pairs [k2_done, K2) with dot products
// (their weights at tail, the next panel's tail_pe after), adds bias (and the column scales: the C sums are
// x * codes for 8-bit weights) and writes rows [0, mr) of columns [n0, n0 + 16 NP) ∩ [0, N) as bf16. rows[r]:
// row r of x (for the k tail).
template <int MT, int NP>
inline void amx_store(float (*c)[32], int mr, const uint16_t* const* rows, int64_t k2_done, int64_t K2,
                      const uint16_t* tail, int64_t tail_pe, const uint16_t* bias, const float* scale, uint16_t* out,
                      int64_t os, int64_t n0, int64_t N) {
  amx_store_sums<MT, NP>(c);
  for (int j = 0; j < NP; ++j) {
    const int64_t col = n0 + j * kPanel;
    const int64_t valid = N - col < kPanel ? N - col : kPanel;
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 b = bias != nullptr ? bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + col)) : _mm512_setzero_ps();
    const __m512 s = scale != nullptr ? _mm512_maskz_loadu_ps(mask, scale + col) : _mm512_set1_ps(1.0f);
    const uint16_t* w = tail + j * tail_pe;
    for (int r = 0; r < mr; ++r) {
      __m512 acc = _mm512_loadu_ps(&c[r][j * 16]);
      const int32_t* xr = reinterpret_cast<const int32_t*>(rows[r]);
      for (int64_t kk = k2_done; kk < K2; ++kk)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(xr[kk]),
                               (__m512bh)_mm512_loadu_si512(w + (kk - k2_done) * 2 * kPanel));
      const __m512 sum = scale != nullptr ? _mm512_fmadd_ps(acc, s, b) : _mm512_add_ps(acc, b);
      _mm256_mask_storeu_epi16(out + r * os + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// One block of MT 16-row groups (a0, a1 with row stride a_stride bytes) by NP panels: tiles, then the store
// of its mr valid rows (rows[r]: row r of x) to out.
template <int MT, int NP, typename Tiles, typename Ahead>
inline void amx_rows(int64_t steps, int64_t K2, const uint16_t* a0, const uint16_t* a1, int64_t a_stride,
                     const Tiles& b, float (*c)[32], int mr, const uint16_t* const* rows, const uint16_t* bias,
                     const float* scale, uint16_t* out, int64_t os, int64_t n0, int64_t N, Ahead& ahead) {
  amx_block<MT, NP>(steps, a0, a1, a_stride, b, ahead);
  amx_store<MT, NP>(c, mr, rows, steps * 16, K2, b.tail(steps * 16), b.tail_stride(), bias, scale, out, os, n0, N);
}

template <typename Tiles, typename Ahead>
inline void amx_rows_any(int mt, int np, int64_t steps, int64_t K2, const uint16_t* a0, const uint16_t* a1,
                         int64_t a_stride, const Tiles& b, float (*c)[32], int mr, const uint16_t* const* rows,
                         const uint16_t* bias, const float* scale, uint16_t* out, int64_t os, int64_t n0, int64_t N,
                         Ahead& ahead) {
  if (mt == 2 && np == 2) amx_rows<2, 2>(steps, K2, a0, a1, a_stride, b, c, mr, rows, bias, scale, out, os, n0, N, ahead);
  else if (mt == 2) amx_rows<2, 1>(steps, K2, a0, a1, a_stride, b, c, mr, rows, bias, scale, out, os, n0, N, ahead);
  else if (np == 2) amx_rows<1, 2>(steps, K2, a0, a1, a_stride, b, c, mr, rows, bias, scale, out, os, n0, N, ahead);
  else amx_rows<1, 1>(steps, K2, a0, a1, a_stride, b, c, mr, rows, bias, scale, out, os, n0, N, ahead);
}

// out (M, N) = x (M, K) @ W.T (* scale) + bias on tiles, K even. W comes through `weights` (PackedPanels, or
// gemm_w8.h's 8-bit codes widened to bf16): begin(p_begin, p_end) once per thread with its panels,
// block(p, np, chunk) for the tiles of panels [p, p + np) in row chunk `chunk`, ahead(p, np, chunk, row_steps)
// for the work on panels [p, p + np) done while the block before them computes (its row_steps k-steps call
// step()). Returns 0.
template <typename Weights>
int amx_linear(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const Weights& weights,
               const uint16_t* bias, const float* scale, uint16_t* out, int64_t os) {
  if (M < 0 || N < 1 || K < 2 || K % 2 != 0) return 1;
  if (M == 0) return 0;
  const int64_t K2 = K / 2, steps = K2 / 16, panels = (N + kPanel - 1) / kPanel;
  const int64_t blocks = (panels + 1) / 2;  // 32-column blocks
  const int64_t groups = (M + 15) / 16, full_groups = M / 16;  // 16-row groups
  const int64_t chunk_groups = std::max<int64_t>(2, (Weights::kChunkBytes / (K * 2 * 16)) & ~int64_t(1));
  const bool parallel = blocks > 1 && M * N * K >= (1 << 19);
#pragma omp parallel if (parallel)
  {
    static thread_local std::vector<uint16_t> tail;  // the partial last 16-row group, zero-padded
    const AmxTileScope tiles(AmxTileConfig{kAmxLinearTiles});
    const auto [b_begin, b_end] = thread_share(blocks);
    weights.begin(2 * b_begin, std::min(panels, 2 * b_end));
    if (groups > full_groups && b_begin < b_end) {
      const int64_t valid = M - full_groups * 16;
      if (static_cast<int64_t>(tail.size()) < 16 * K) tail.resize(16 * K);
      for (int64_t r = 0; r < valid; ++r)
        std::memcpy(&tail[r * K], x + (full_groups * 16 + r) * xs, K * sizeof(uint16_t));
      std::memset(&tail[valid * K], 0, (16 - valid) * K * sizeof(uint16_t));
    }
    // 16-row group g: its first row (x itself, or the padded copy) and its row stride in bytes
    auto group_rows = [&](int64_t g) { return g < full_groups ? x + g * 16 * xs : tail.data(); };
    auto group_stride = [&](int64_t g) { return g < full_groups ? xs * 2 : K * 2; };
    alignas(64) float c[32][32];
    const uint16_t* rows[32];
    for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
      const int64_t g1 = std::min(groups, g0 + chunk_groups);
      for (int64_t blk = b_begin; blk < b_end; ++blk) {
        const int64_t p = 2 * blk;
        const int np = panels - p >= 2 ? 2 : 1;
        const int64_t chunk = g0 / chunk_groups;
        const typename Weights::Block b = weights.block(p, np, chunk);
        // while this block computes, its row blocks prepare the next block (request its weights into L2)
        typename Weights::Ahead ahead{};
        if (blk + 1 < b_end) {
          const int np_next = panels - (p + 2) >= 2 ? 2 : 1;
          ahead = weights.ahead(p + 2, np_next, chunk, (g1 - g0 + 1) / 2 * std::max<int64_t>(steps, 1));
        }
        for (int64_t g = g0; g < g1;) {
          // two groups share one A stride unless the second is the padded one: then one group at a time
          const int mt = g + 1 < g1 && group_stride(g) == group_stride(g + 1) ? 2 : 1;
          const int64_t m0 = g * 16;
          const int mr = static_cast<int>(std::min<int64_t>(16 * mt, M - m0));
          for (int r = 0; r < mr; ++r) rows[r] = x + (m0 + r) * xs;
          amx_rows_any(mt, np, steps, K2, group_rows(g), mt > 1 ? group_rows(g + 1) : nullptr, group_stride(g), b,
                       c, mr, rows, bias, scale, out + m0 * os, os, 16 * p, N, ahead);
          g += mt;
        }
      }
    }
  }
  return 0;
}
