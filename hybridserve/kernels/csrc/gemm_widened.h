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

}  // namespace
