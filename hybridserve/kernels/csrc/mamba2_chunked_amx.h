// The Mamba2 scan of a long prefill sequence in its chunked (SSD) form, with the products on the AMX
// tiles (amx level: AMX-TILE + AMX-BF16), for bf16 activations. Included by recurrent.cpp.
//
// Per head, the tokens go in chunks of kSsdChunk (L) tokens. With a_t = dt_t * A, cs_t the sum of a_u
// over the chunk's tokens u <= t, the incoming state S (N x P, held transposed as in mamba2_scan_head)
// and the chunk's x (L x P), B, C (L x N):
//
//   CB     = C . B^T                                   (L x L)  bf16 x bf16 -> float32, once per group
//   W[t,u] = CB[t,u] * exp(cs_t - cs_u) * dt_u, u <= t (L x L)  rounded to bf16 as an operand
//   y      = W . x + exp(cs_t) * (C . S) + D * x       (L x P)  S split into two bf16 (hi + lo)
//   S'     = exp(cs_last) * S + B^T . (w * x)           (N x P)  w_u = exp(cs_last - cs_u) * dt_u,
//                                                                w * x split into two bf16 (hi + lo)
//
// Every product accumulates in float32 on the tiles; the state stays float32 from chunk to chunk and is
// stored in the pool's dtype at the end. The activations are bf16 already; the decay-weighted W is
// rounded to bf16 (a relative error of at most 2^-8 per term of y, as mamba_ssm's chunked kernels round
// it to the activation dtype). The two operands that carry the state, w * x into it and S out of it, are
// each split into a hi + lo pair of bf16, which keeps 16 of float32's 24 bits: the state itself (what is
// carried from chunk to chunk and stored) stays within about 2^-16 of its float32 value per term. A
// chunk's rows past the sequence end are zero-padded.
//
// A call first packs, per chunk and group, what every head of the group shares (C's rows, B^T, CB), in
// parallel over chunks; then each (sequence, head) runs its chunks in order.
//
// Operand layouts: an A operand is row-major bf16 (k contiguous); a B operand is in the pair layout, one
// 32-bit word per (k pair, column): element (k, n) at b[(k / 2) * 2 * Nc + 2 * n + k % 2].
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HS_MAMBA2_CHUNKED 1
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "amx_tiles.h"

constexpr int64_t kSsdChunk = 64;      // L: tokens per chunk (a multiple of 32: a k-step of the tiles)
constexpr int64_t kSsdMinTokens = 64;  // sequences this long or longer take the chunked path

// Whether head_dim P and d_state N fit the tiles: P a multiple of 16 (output columns), N of 32 (a k-step).
inline bool ssd_shape_ok(int64_t P, int64_t N) { return P > 0 && N > 0 && P % 16 == 0 && N % 32 == 0; }

// Tiles: tmm0, tmm3 float32 sums, tmm1 an A tile, tmm2, tmm4 B tiles.
constexpr int kSsdTiles = 5;

// c (M x Nc float32, row stride ldc) = a (M x K bf16, row stride lda) . b (pair layout, Nc columns), plus
// a . b2 when b2 is given (a second B operand of the same shape, sharing a's tiles). M and Nc multiples of
// 16, K of 32. Two 16-column tiles at a time (tmm0, tmm3) share each A tile (tmm1); B tiles in tmm2, tmm4.
inline void ssd_tile_matmul(int64_t M, int64_t Nc, int64_t K, const uint16_t* a, int64_t lda, const uint32_t* b,
                            float* c, int64_t ldc, const uint32_t* b2 = nullptr) {
  const int nb = b2 != nullptr ? 2 : 1;
  for (int64_t m = 0; m < M; m += 16) {
    int64_t n = 0;
    for (; n + 32 <= Nc; n += 32) {
      _tile_zero(0);
      _tile_zero(3);
      for (int i = 0; i < nb; ++i) {
        const uint32_t* bb = i == 0 ? b : b2;
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(1, a + m * lda + k, lda * 2);
          _tile_loadd(2, bb + (k / 2) * Nc + n, Nc * 4);
          _tile_loadd(4, bb + (k / 2) * Nc + n + 16, Nc * 4);
          _tile_dpbf16ps(0, 1, 2);
          _tile_dpbf16ps(3, 1, 4);
        }
      }
      _tile_stored(0, c + m * ldc + n, ldc * 4);
      _tile_stored(3, c + m * ldc + n + 16, ldc * 4);
    }
    for (; n < Nc; n += 16) {
      _tile_zero(0);
      for (int i = 0; i < nb; ++i) {
        const uint32_t* bb = i == 0 ? b : b2;
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(1, a + m * lda + k, lda * 2);
          _tile_loadd(2, bb + (k / 2) * Nc + n, Nc * 4);
          _tile_dpbf16ps(0, 1, 2);
        }
      }
      _tile_stored(0, c + m * ldc + n, ldc * 4);
    }
  }
}

// 16 floats rounded to bf16 (nearest even, as from_f32<BF16> for finite values), each in the high half of
// its 32-bit lane (the low half zero): as floats, the rounded values themselves.
inline __m512i ssd_bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// The pair words of 16 columns: bf16(even) in the low half, bf16(odd) in the high half.
inline __m512i ssd_pair(__m512 even, __m512 odd) {
  return _mm512_or_si512(_mm512_srli_epi32(ssd_bf16_high(even), 16), ssd_bf16_high(odd));
}

inline __m512 ssd_load_bf16(const BF16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Which tokens of a call's long sequences form which chunk, and the operands each (chunk, group) shares:
// C's rows (L x N, A operand), B^T as rows (N x L, A operand) and CB = C . B^T (L x L float32).
struct SsdPlan {
  int64_t L = kSsdChunk, G = 1, N = 0, chunks = 0;
  std::vector<int64_t> first_chunk;  // per sequence: its first chunk, or -1 (the token path)
  std::vector<int64_t> chunk_start, chunk_len;
  std::vector<uint16_t> c_rows, bt_rows;
  std::vector<float> cb;

  SsdPlan() = default;
  SsdPlan(int64_t num_seqs, const int64_t* cu, int64_t G_, int64_t N_) : G(G_), N(N_), first_chunk(num_seqs, -1) {
    for (int64_t s = 0; s < num_seqs; ++s) {
      if (cu[s + 1] - cu[s] < kSsdMinTokens) continue;
      first_chunk[s] = chunks;
      for (int64_t t = cu[s]; t < cu[s + 1]; t += L, ++chunks) {
        chunk_start.push_back(t);
        chunk_len.push_back(cu[s + 1] - t < L ? cu[s + 1] - t : L);
      }
    }
    c_rows.assign(chunks * G * L * N, 0);
    bt_rows.assign(chunks * G * N * L, 0);
    cb.resize(chunks * G * L * L);
  }
  const uint16_t* c_of(int64_t ci, int64_t g) const { return &c_rows[(ci * G + g) * L * N]; }
  const uint16_t* bt_of(int64_t ci, int64_t g) const { return &bt_rows[(ci * G + g) * N * L]; }
  const float* cb_of(int64_t ci, int64_t g) const { return &cb[(ci * G + g) * L * L]; }

  // Packs chunk ci's operands of group g (zero past the sequence end) and computes its CB on the tiles;
  // bt_pairs: L * N / 2 words of scratch.
  void pack(int64_t ci, int64_t g, const BF16* Bm, int64_t b_stride, const BF16* Cm, int64_t c_stride,
            uint32_t* bt_pairs) {
    const int64_t t0 = chunk_start[ci], lc = chunk_len[ci];
    uint16_t* cr = &c_rows[(ci * G + g) * L * N];
    uint16_t* btr = &bt_rows[(ci * G + g) * N * L];
    std::memset(bt_pairs, 0, L * N / 2 * sizeof(uint32_t));
    for (int64_t u = 0; u < lc; ++u) {
      std::memcpy(cr + u * N, Cm + (t0 + u) * c_stride + g * N, N * sizeof(uint16_t));
      const uint16_t* br = reinterpret_cast<const uint16_t*>(Bm + (t0 + u) * b_stride + g * N);
      const uint32_t* bw = reinterpret_cast<const uint32_t*>(br);  // (B[u][n], B[u][n+1]) is one pair word
      for (int64_t i = 0; i < N / 2; ++i) bt_pairs[i * L + u] = bw[i];
      for (int64_t n = 0; n < N; ++n) btr[n * L + u] = br[n];
    }
    ssd_tile_matmul(L, L, N, cr, N, bt_pairs, &cb[(ci * G + g) * L * L], L);
  }
};

// One thread's scratch for ssd_scan_head (sized for P, N once).
struct SsdScratch {
  std::vector<uint32_t> x_pairs, xw_pairs, s_pairs, bt_pairs;
  std::vector<uint16_t> w;
  std::vector<float> y_intra, y_state, s_add, cs, dts;
  SsdScratch(int64_t P, int64_t N)
      : x_pairs(kSsdChunk / 2 * P), xw_pairs(kSsdChunk * P), s_pairs(N * P), bt_pairs(kSsdChunk * N / 2),
        w(kSsdChunk * kSsdChunk), y_intra(kSsdChunk * P), y_state(kSsdChunk * P), s_add(N * P), cs(kSsdChunk),
        dts(kSsdChunk) {}
};

// The chunks of sequence tokens [t0, t1), its first chunk `ci`, for head h of group g; the state hT (N x P
// float32) in and out. The caller has loaded the tile configuration. dt_of(t) gives token t's step.
template <typename DtFn>
void ssd_scan_head(const SsdPlan& plan, int64_t ci, int64_t t0, int64_t t1, int64_t h, const BF16* x,
                   int64_t x_stride, float* y, int64_t y_stride, int64_t P, int64_t N, int64_t g, float a, float d,
                   const DtFn& dt_of, float* __restrict__ hT, SsdScratch& s) {
  constexpr int64_t L = kSsdChunk;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t c0 = t0; c0 < t1; c0 += L, ++ci) {
    const int64_t lc = t1 - c0 < L ? t1 - c0 : L;  // tokens in this chunk
    float run = 0.0f;
    for (int64_t u = 0; u < L; ++u) {
      const float dtv = u < lc ? dt_of(c0 + u) : 0.0f;
      run += dtv * a;
      s.dts[u] = dtv;
      s.cs[u] = run;
    }
    const float cs_last = s.cs[lc - 1];
    // x in the pair layout, plain and weighted by w_u = exp(cs_last - cs_u) * dt_u as hi + lo (zero past
    // the end)
    for (int64_t j = 0; j < L / 2; ++j) {
      const int64_t u = 2 * j;
      const bool has0 = u < lc, has1 = u + 1 < lc;
      const BF16* x0 = x + (c0 + u) * x_stride + h * P;
      const BF16* x1 = x0 + x_stride;
      const __m512 w0 = _mm512_set1_ps(has0 ? std::exp(cs_last - s.cs[u]) * s.dts[u] : 0.0f);
      const __m512 w1 = _mm512_set1_ps(has1 ? std::exp(cs_last - s.cs[u + 1]) * s.dts[u + 1] : 0.0f);
      for (int64_t p = 0; p < P; p += 16) {
        const __m512 v0 = has0 ? ssd_load_bf16(x0 + p) : zero, v1 = has1 ? ssd_load_bf16(x1 + p) : zero;
        const __m512i plain = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(v0), 16), _mm512_castps_si512(v1));
        _mm512_storeu_si512(&s.x_pairs[j * P + p], plain);
        const __m512 xw0 = _mm512_mul_ps(v0, w0), xw1 = _mm512_mul_ps(v1, w1);
        const __m512i h0 = ssd_bf16_high(xw0), h1 = ssd_bf16_high(xw1);
        _mm512_storeu_si512(&s.xw_pairs[j * P + p], _mm512_or_si512(_mm512_srli_epi32(h0, 16), h1));
        _mm512_storeu_si512(&s.xw_pairs[(L / 2 + j) * P + p],
                            ssd_pair(_mm512_sub_ps(xw0, _mm512_castsi512_ps(h0)), _mm512_sub_ps(xw1, _mm512_castsi512_ps(h1))));
      }
    }
    // the state as two bf16 operands, hi and lo (N / 2 pair rows each: the hi ones, then the lo ones)
    for (int64_t i = 0; i < N / 2; ++i) {
      const float* r0 = hT + 2 * i * P;
      const float* r1 = r0 + P;
      for (int64_t p = 0; p < P; p += 16) {
        const __m512 a0 = _mm512_loadu_ps(r0 + p), a1 = _mm512_loadu_ps(r1 + p);
        const __m512i h0 = ssd_bf16_high(a0), h1 = ssd_bf16_high(a1);
        _mm512_storeu_si512(&s.s_pairs[i * P + p], _mm512_or_si512(_mm512_srli_epi32(h0, 16), h1));
        const __m512 l0 = _mm512_sub_ps(a0, _mm512_castsi512_ps(h0)), l1 = _mm512_sub_ps(a1, _mm512_castsi512_ps(h1));
        _mm512_storeu_si512(&s.s_pairs[(N / 2 + i) * P + p], ssd_pair(l0, l1));
      }
    }
    // W = CB * exp(cs_t - cs_u) * dt_u on and below the diagonal, zero above it and past the end
    const float* cb = plan.cb_of(ci, g);
    for (int64_t t = 0; t < L; ++t) {
      const __m512 cst = _mm512_set1_ps(s.cs[t]);
      for (int64_t u = 0; u < L; u += 16) {
        const __mmask16 keep = t < lc ? static_cast<__mmask16>(t - u >= 15 ? 0xffffu : (t - u < 0 ? 0u : (2u << (t - u)) - 1u)) : 0;
        const __m512 decay = exp16(_mm512_sub_ps(cst, _mm512_loadu_ps(&s.cs[u])));
        const __m512 v = _mm512_maskz_mul_ps(keep, _mm512_mul_ps(_mm512_loadu_ps(cb + t * L + u), decay),
                                             _mm512_loadu_ps(&s.dts[u]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s.w[t * L + u]), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
    const uint16_t* c_rows = plan.c_of(ci, g);
    ssd_tile_matmul(L, P, L, s.w.data(), L, s.x_pairs.data(), s.y_intra.data(), P);  // W . x
    ssd_tile_matmul(L, P, N, c_rows, N, s.s_pairs.data(), s.y_state.data(), P, s.s_pairs.data() + N / 2 * P);  // C . S
    ssd_tile_matmul(N, P, L, plan.bt_of(ci, g), L, s.xw_pairs.data(), s.s_add.data(), P,
                    s.xw_pairs.data() + L / 2 * P);  // B^T . (w x), hi + lo
    for (int64_t t = 0; t < lc; ++t) {
      const float e = std::exp(s.cs[t]);
      const BF16* xr = x + (c0 + t) * x_stride + h * P;
      float* yt = y + (c0 + t) * y_stride + h * P;
      const float* yi = &s.y_intra[t * P];
      const float* ys = &s.y_state[t * P];
#pragma omp simd
      for (int64_t p = 0; p < P; ++p) yt[p] = (yi[p] + e * ys[p]) + d * to_f32(xr[p]);
    }
    const float e_last = std::exp(cs_last);
#pragma omp simd
    for (int64_t i = 0; i < N * P; ++i) hT[i] = e_last * hT[i] + s.s_add[i];
  }
}
#endif
