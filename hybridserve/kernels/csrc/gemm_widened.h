// Calls of many rows over coded weights (4-bit, Q6_K) at the levels where no matrix-unit or integer dot-product
// path takes them (AVX2, AVX-512 without BF16, and float32 / fp16 activations): the codes of each panel group are
// dequantized once per row block into float32 panels ([K][16] floats each, k major: the float32 weights' layout)
// in the thread's scratch, and the float32 tiles (vtile) run every row tile of the block over them. Decoding a
// code costs a few vector operations where its use in a tile costs one fused multiply-add per row, so decoding it
// once for the block's rows rather than once per row tile pays from a few rows on. Included by gemm.cpp after the
// float32 vector path.
//
// A widened weight is the format's dequantized value rounded once to float32, summed with x in float32 in k order;
// the result, plus the bias, is rounded once to the activation dtype.
#pragma once

namespace {

// Rows from which a coded-weight call that no integer or matrix-unit path takes decodes its codes once per row
// block here rather than once per row tile (4-bit and Q6_K alike: kernels/linear_w4.py and linear_w6k.py
// WIDENED_ROWS).
constexpr int64_t kWidenedRows = 4;

// Rows per block at least (the row block of for_panel_groups otherwise holds ~192 KiB of float32 activations:
// 24 rows at K = 2048, 6 at 8192): each group's panels are decoded once per block, so the decode is shared by at
// least this many rows, and the block's activations (~768 KiB at K = 8192) are read from L2 or L3 by each group.
constexpr int64_t kWidenedMinBlock = 24;

// out (M, N) = x (M, K) @ W.T + bias, with widen(first panel, panels, dst) writing the float32 panels of a group
// ([panels][K][16] at dst). K even.
template <typename A, typename Widen>
int widened_linear(int64_t M, int64_t N, int64_t K, const A* x, int64_t xs, const A* bias, A* out, int64_t os,
                   const Widen& widen) {
  const int64_t pe = K * kPanel, panels = (N + kPanel - 1) / kPanel, fs = float_stride(K);
  const float* xf = widened_rows(M, K, fs, x, xs);
  constexpr int kRows = max_rows<float>();
  static constexpr auto table = vrows_table<float, A>(std::make_integer_sequence<int, kRows>{});
  const int64_t group = vpanels<float>(M >= kRows ? kRows : static_cast<int>(M));
  for_panel_groups(M, N, K, K, kRows, panels, group, kWidenedMinBlock,
                   [&](int64_t p0, int np, int64_t b0, int64_t rows) {
                     static thread_local std::vector<float> scratch;
                     if (static_cast<int64_t>(scratch.size()) < np * pe) scratch.resize(np * pe);
                     widen(p0, np, scratch.data());
                     for (int64_t m0 = b0; m0 < b0 + rows; m0 += kRows) {
                       const int mr = static_cast<int>(std::min<int64_t>(kRows, b0 + rows - m0));
                       table[mr - 1](np, K / 2, xf + m0 * fs, fs, scratch.data(), pe, bias, out + m0 * os, os,
                                     p0 * kPanel, N);
                     }
                   });
  return 0;
}

#if HS_HAVE_BF16_DOT
// Rows from which bf16 calls over coded weights take dot_widened_linear, where the CPU prefers the dot products
// (kernels/linear_w4.py and linear_w6k.py DOT_ROWS); fewer rows stay on the paths that read each code once.
constexpr int64_t kDotWidenedRows = 16;

// Whether a bf16 call of `rows` rows over coded weights takes dot_widened_linear (the kernels' dispatch and the
// path codes they report, hs_w4_path / hs_w6k_path, alike).
inline bool dot_widened_takes(int64_t rows) { return rows >= kDotWidenedRows && bf16_dot_preferred(); }

// Calls of many bf16 rows over coded weights (4-bit, Q6_K) at the avx512_bf16 level on CPUs whose bf16 dot products
// beat the float32 vector path (bf16_dot_preferred: AMD Zen 4/5), where float32 tiles run at half the rate of
// vdpbf16ps: each panel group's codes are dequantized once per call into the 16-bit kernel's bf16 k-pair layout in
// the thread's scratch, each weight rounded once to bf16 (Src::widen, the amx path's weights, the same bits), and
// the 16-bit kernel's row tiles run every row over them (float32 sums, k-pair after k-pair). While the row tiles
// compute, they request the next group's codes into L2, so its widening does not wait on memory. Src widens units
// [from, to) of the panels from p on (Src::units() a panel) to dst (panel j at j * K * 16) and gives the address of
// panel p's codes (Src::bytes; panels contiguous). K even.
template <typename Src>
int dot_widened_linear(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const Src& src,
                       const uint16_t* bias, uint16_t* out, int64_t os) {
  const int64_t K2 = K / 2, pe = K * kPanel, panels = (N + kPanel - 1) / kPanel, units = src.units();
  const int64_t group = max_panels(8), groups = (panels + group - 1) / group, tiles = (M + 7) / 8;
#pragma omp parallel for schedule(static) if (groups > 1)
  for (int64_t g = 0; g < groups; ++g) {
    static thread_local std::vector<uint16_t> scratch;  // this group's bf16 panels
    const int64_t p0 = g * group;
    const int nr = static_cast<int>(std::min(group, panels - p0));
    if (static_cast<int64_t>(scratch.size()) < nr * pe) scratch.resize(nr * pe);
    src.widen(p0, 0, nr * units, scratch.data());
    const int64_t next_panels = g + 1 < groups ? std::min(group, panels - p0 - nr) : 0;
    const char* next = src.bytes(p0 + nr);
    const char* next_end = next_panels > 0 ? src.bytes(p0 + nr + next_panels) : next;
    for (int64_t m0 = 0, t = 0; m0 < M; m0 += 8, ++t) {
      const int mr = M - m0 >= 8 ? 8 : static_cast<int>(M - m0);
      kRows[mr](nr, K2, x + m0 * xs, xs, scratch.data(), pe, bias, nullptr, out + m0 * os, os, p0 * kPanel, N,
                tile_ahead(next, next_end, tiles, K2, t));
    }
  }
  return 0;
}
#endif

}  // namespace
