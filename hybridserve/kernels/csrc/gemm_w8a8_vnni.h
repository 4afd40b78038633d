// W8A8 sums on AVX-512 VNNI (the avx512_bf16 and amx levels; at amx the path of CPUs without AMX-INT8).
// Included by gemm_w8a8.h inside its anonymous namespace (quantized rows, w8a8_store, the packed [K][16] panels
// of gemm_w8.h).
//
// vpdpbusd adds, in each 32-bit lane, four products of an unsigned byte by a signed byte to an int32 sum.
// The unsigned operand is the weight code plus 128 (its sign bit flipped: 1 .. 255), the signed one four
// quantized activations (a k-quad of one row, broadcast to every lane), so a lane's sum over the k-quads is
//   sum_k (q[k, n] + 128) x_q[m, k] = sum_k q[k, n] x_q[m, k] + 128 sum_k x_q[m, k],
// and the row's term 128 * sum_k x_q[m, k], summed once with the quantization, is subtracted. Every step is
// exact in int32 (wrapping adds, and the result |sum| <= 127 * 127 * K < 2^31), so the sums, and through
// w8a8_store the outputs, are the integer vector path's bit for bit.
//
// The B operand of one k-quad of a panel is a 64-byte vector, column c's four k in bytes 4c .. 4c + 3. The
// packed panel holds the quad as [4 k][16 columns] (64 contiguous bytes): a dword permute and an in-lane byte
// shuffle transpose it (AVX-512 F and BW; VBMI's single byte permute is missing on Cooper Lake). The first
// row tile of a panel group transposes as it computes and stores the vectors to a per-thread scratch (the
// group's K x 16 x NP bytes, L2-resident) that the group's other row tiles read.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr int kVnniRows = 8;    // rows of a tile: 8 x 3 sums, 3 weight vectors and a broadcast in 32 registers
constexpr int kVnniPanels = 3;  // panels of a tile (48 columns)

// One k-quad of a [K][16] panel (64 bytes at p) as vpdpbusd's unsigned operand: codes + 128, column-major.
inline __m512i vnni_quad(const uint8_t* p) {
  // dword 4L + k of the result is the source's dword 4k + L: lane L then holds columns 4L .. 4L + 3 of each k
  const __m512i by_lane = _mm512_permutexvar_epi32(
      _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), _mm512_loadu_si512(p));
  // within a lane, byte 4k + c -> byte 4c + k
  const __m512i cols = _mm512_shuffle_epi8(
      by_lane, _mm512_broadcast_i32x4(_mm_set_epi8(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0)));
  return _mm512_xor_si512(cols, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// The weight vectors of a row tile: transposed from the codes (and kept in the scratch), or read back.
struct TransposedQuads {
  const uint8_t* codes;  // the group's first panel
  int64_t pe;            // bytes of a panel's codes
  uint8_t* scratch;      // panel j's quad s at scratch + (j * quads + s) * 64
  int64_t quads;
  __m512i operator()(int j, int64_t s) const {
    const __m512i v = vnni_quad(codes + j * pe + s * 64);
    _mm512_store_si512(scratch + (j * quads + s) * 64, v);
    return v;
  }
};
struct StoredQuads {
  const uint8_t* scratch;
  int64_t quads;
  __m512i operator()(int j, int64_t s) const { return _mm512_load_si512(scratch + (j * quads + s) * 64); }
};

// MR rows (xq: quantized, Kq bytes apart; rowsum: their sums) by NP panels from `weights`: the int32 sums,
// corrected by the rows' 128 * sum terms, then w8a8_store's epilogue for columns [col, col + 16 NP) ∩ [0, N).
template <int MR, int NP, typename Quads, typename A>
void vnni_tile(int64_t quads, const int8_t* xq, int64_t Kq, const int32_t* rowsum, const float* sx,
               const Quads& weights, const float* sw, const A* bias, A* out, int64_t os, int64_t col, int64_t N) {
  __m512i acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t s = 0; s < quads; ++s) {
    __m512i w[NP];
    for (int j = 0; j < NP; ++j) w[j] = weights(j, s);
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      __builtin_memcpy(&quad, xq + r * Kq + 4 * s, 4);
      const __m512i x = _mm512_set1_epi32(quad);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w[j], x);
    }
  }
  alignas(64) int32_t sums[MR][NP * kPanel];
  for (int r = 0; r < MR; ++r) {
    const __m512i shift = _mm512_set1_epi32(128 * rowsum[r]);
    for (int j = 0; j < NP; ++j) _mm512_store_si512(&sums[r][j * kPanel], _mm512_sub_epi32(acc[r][j], shift));
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t c = col + j * kPanel;
    const int valid = static_cast<int>(N - c < kPanel ? N - c : kPanel);
    w8a8_store(&sums[0][j * kPanel], NP * kPanel, MR, sx, sw + j * kPanel, bias, out, os, c, valid);
  }
}

// vnni_tile for a run-time row count mr (1 .. kVnniRows) and panel count np (1 .. kVnniPanels).
template <int MR, int NP, typename Quads, typename A>
void vnni_tile_any(int mr, int np, int64_t quads, const int8_t* xq, int64_t Kq, const int32_t* rowsum,
                   const float* sx, const Quads& weights, const float* sw, const A* bias, A* out, int64_t os,
                   int64_t col, int64_t N) {
  if constexpr (MR > 1) {
    if (mr < MR)
      return vnni_tile_any<MR - 1, NP>(mr, np, quads, xq, Kq, rowsum, sx, weights, sw, bias, out, os, col, N);
  }
  if constexpr (NP > 1) {
    if (np < NP)
      return vnni_tile_any<MR, NP - 1>(mr, np, quads, xq, Kq, rowsum, sx, weights, sw, bias, out, os, col, N);
  }
  vnni_tile<MR, NP>(quads, xq, Kq, rowsum, sx, weights, sw, bias, out, os, col, N);
}

// out (M, N) from the quantized rows (xq, Kq bytes apart, zeros past K; rowsum: each row's sum of codes) and
// the packed int8 panels: threads split the panel groups, each group's row tiles go down all M rows.
template <typename A>
void w8a8_vnni(int64_t M, int64_t N, int64_t K, const int8_t* xq, int64_t Kq, const int32_t* rowsum,
               const float* sx, const uint8_t* packed, const A* bias, A* out, int64_t os) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pe = K * kPanel, quads = (K + 3) / 4;
  const int64_t groups = (panels + kVnniPanels - 1) / kVnniPanels;
  const float* scales = reinterpret_cast<const float*>(packed + panels * pe);
  const bool parallel = groups > 1 && M * N * K >= (1 << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    static thread_local std::vector<uint8_t> scratch;
    const int64_t need = kVnniPanels * quads * 64 + 64;
    if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    const int64_t p = g * kVnniPanels, col = p * kPanel;
    const int np = static_cast<int>(std::min<int64_t>(kVnniPanels, panels - p));
    const uint8_t* codes = packed + p * pe;
    // K not a multiple of 4: the last quad reads up to 3 k past the panel (the next panel's codes, or for the
    // last panel the scales after the codes) and multiplies them by the zero activations past K
    for (int64_t m = 0; m < M; m += kVnniRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kVnniRows, M - m));
      if (m == 0)
        vnni_tile_any<kVnniRows, kVnniPanels>(mr, np, quads, xq, Kq, rowsum, sx, TransposedQuads{codes, pe, base, quads},
                                              scales + col, bias, out, os, col, N);
      else
        vnni_tile_any<kVnniRows, kVnniPanels>(mr, np, quads, xq + m * Kq, Kq, rowsum + m, sx + m,
                                              StoredQuads{base, quads}, scales + col, bias, out + m * os, os, col, N);
    }
  }
}

#endif
