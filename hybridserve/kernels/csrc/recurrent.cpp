// CPU kernels for the recurrent layers: varlen causal depthwise conv and the Mamba2 (SSD) scan.
//
// Both read and write the pooled per-sequence state in place, through slot ids, in the state's own
// dtype (float32, bfloat16 or float16; or 8-bit codes with bfloat16 row scales, the *_coded entry points and
// state_codec.h), and compute in float32. A negative slot id is a padding row (zero_rows): nothing of the
// pool is read or written for it. One call covers a whole group of
// sequences: a decode group (one token each) or a prefill group (a chunk each), given by cu_seqlens.
// The recurrence runs token by token: the (head_dim x d_state) state of one head stays in L1, so
// this costs O(P*N) per token and head, with no padding and no chunk matrices. In the amx build, a
// Mamba2 prefill sequence of kSsdMinTokens or more with bf16 activations takes the chunked (SSD) form
// instead, its products on the AMX tiles (mamba2_chunked_amx.h).
//
// Plain C ABI (loaded with ctypes); OpenMP threads come from the process's OpenMP runtime, which
// is the one torch uses (same soname), so torch.set_num_threads applies.

#include "isa_level.h"
#include "registry.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "flush_denormals.h"
#include "vec16.h"
#include "vecmath.h"
#include "mamba2_chunked_amx.h"
#include "state_codec.h"

namespace {

constexpr int64_t kMaxStateN = 256;  // the longest Mamba1 state row (d_state) hs_mamba1_scan takes

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch: beta 1, threshold 20

// A negative slot marks a padding row of a captured step (engine/decode_capture.py): the row has no
// state, so none is read or written for it, and its output rows [t0, t1), columns [c0, c0 + n), are zeros.
template <typename T>
inline void zero_rows(T* out, int64_t stride, int64_t t0, int64_t t1, int64_t c0, int64_t n) {
  for (int64_t t = t0; t < t1; ++t) std::memset(out + t * stride + c0, 0, n * sizeof(T));
}


// ------------------------------------------------------------------------------------------
// causal depthwise conv over packed sequences, state (slots, D, K-1) updated in place
// ------------------------------------------------------------------------------------------

constexpr int64_t kConvBlock = 128;  // channels per work item
constexpr int64_t kMaxTaps = 16;

#if defined(__AVX512F__)
// One token through a width-4 conv for 16 channels at a time, state rows (c, 3) interleaved in
// memory: three 16-wide loads are de-interleaved into the taps s0, s1, s2 with permutes, and the new
// state (s1, s2, x) is interleaved back the same way. Same arithmetic, in the same order, as the
// generic loop: ((s0*w0 + s1*w1) + s2*w2) + x*w3, then + bias, then the activation.
struct Deinterleave3 {
  __m512i lo[3], hi[3];   // tap k: elements 3j+k < 32 from (v0, v1), the rest from v2
  __mmask16 from_hi[3];
  __m512i out01[3], out2[3];  // output vector m: from (n0, n1), and the n2 lanes
  __mmask16 out_from2[3];
  Deinterleave3() {
    alignas(64) int32_t a[16], b[16];
    for (int k = 0; k < 3; ++k) {
      __mmask16 m = 0;
      for (int j = 0; j < 16; ++j) {
        const int i = 3 * j + k;
        a[j] = i < 32 ? i : 0;
        b[j] = i < 32 ? 0 : i - 32;
        if (i >= 32) m |= static_cast<__mmask16>(1u << j);
      }
      lo[k] = _mm512_load_si512(a);
      hi[k] = _mm512_load_si512(b);
      from_hi[k] = m;
    }
    for (int v = 0; v < 3; ++v) {
      __mmask16 m = 0;
      for (int i = 0; i < 16; ++i) {
        const int p = 16 * v + i, j = p / 3, k = p % 3;
        a[i] = k == 0 ? j : (k == 1 ? 16 + j : 0);
        b[i] = k == 2 ? j : 0;
        if (k == 2) m |= static_cast<__mmask16>(1u << i);
      }
      out01[v] = _mm512_load_si512(a);
      out2[v] = _mm512_load_si512(b);
      out_from2[v] = m;
    }
  }
};

template <typename AT, typename ST>
void conv4_step16(const AT* xt, AT* ot, ST* st, const float* weight_t, const float* bias, int64_t D, int64_t c,
                  int act_silu, const Deinterleave3& perm) {
  const __m512 v0 = load16_ps(st + 3 * c), v1 = load16_ps(st + 3 * c + 16), v2 = load16_ps(st + 3 * c + 32);
  __m512 tap[3];
  for (int k = 0; k < 3; ++k)
    tap[k] = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(v0, perm.lo[k], v1), perm.from_hi[k], perm.hi[k], v2);
  const __m512 xin = load16_ps(xt + c);
  __m512 acc = _mm512_mul_ps(tap[0], _mm512_loadu_ps(weight_t + c));
  acc = _mm512_add_ps(acc, _mm512_mul_ps(tap[1], _mm512_loadu_ps(weight_t + D + c)));
  acc = _mm512_add_ps(acc, _mm512_mul_ps(tap[2], _mm512_loadu_ps(weight_t + 2 * D + c)));
  acc = _mm512_add_ps(acc, _mm512_mul_ps(xin, _mm512_loadu_ps(weight_t + 3 * D + c)));
  if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + c));
  store16_ps(ot + c, act_silu ? silu16(acc) : acc);
  const __m512 n0 = tap[1], n1 = tap[2], n2 = xin;  // the window moves by one token
  for (int v = 0; v < 3; ++v) {
    const __m512 o = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(n0, perm.out01[v], n1), perm.out_from2[v],
                                                perm.out2[v], n2);
    store16_ps(st + 3 * c + 16 * v, o);
  }
}
#endif

// The tokens t0 .. t1 - 1 of one sequence through the conv for channels c0 .. c0 + nc - 1, the window win[k][c]
// (the K-1 previous inputs, oldest first) moved along token by token: taps oldest first, the current token
// last, then the bias, then the activation.
template <int KT, typename AT>
inline void conv_block_tokens(float (*win)[kConvBlock], int64_t t0, int64_t t1, const AT* x, int64_t x_stride,
                              AT* out, int64_t out_stride, const float* weight_t, const float* bias, int act_silu,
                              int64_t D, int64_t K_, int64_t c0, int64_t nc) {
  const int64_t K = KT > 0 ? KT : K_;
  const int64_t W = K - 1;
  float xin[kConvBlock], acc[kConvBlock];
  for (int64_t t = t0; t < t1; ++t) {
    const AT* xt = x + t * x_stride + c0;
    AT* ot = out + t * out_stride + c0;
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) {
      xin[c] = to_f32(xt[c]);
      acc[c] = 0.0f;
    }
    for (int64_t k = 0; k < W; ++k) {
      const float* wk = weight_t + k * D + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) acc[c] += win[k][c] * wk[c];
    }
    const float* wl = weight_t + W * D + c0;
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) acc[c] += xin[c] * wl[c];
    if (bias) {
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) acc[c] += bias[c0 + c];
    }
    for (int64_t k = 0; k + 1 < W; ++k) {
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) win[k][c] = win[k + 1][c];
    }
    if (W > 0) {
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) win[W - 1][c] = xin[c];
    }
    if (act_silu) {
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) acc[c] = silu(acc[c]);
    }
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) ot[c] = from_f32<AT>(acc[c]);
  }
}

// One sequence's tokens t0 .. t1 - 1 through channels c0 .. c0 + nc - 1, st its (nc, K-1) state rows in the
// state dtype, read and written in place (one token of a width-4 conv: the vector path; else the token loop).
template <int KT, typename AT, typename ST>
inline void conv_block(ST* st, int64_t t0, int64_t t1, const AT* x, int64_t x_stride, AT* out, int64_t out_stride,
                       const float* weight_t, const float* bias, int act_silu, int64_t D, int64_t K_, int64_t c0,
                       int64_t nc) {
  const int64_t K = KT > 0 ? KT : K_;
  const int64_t W = K - 1;  // state width
#if defined(__AVX512F__)
  if constexpr (KT == 4) {
    if (t1 - t0 == 1 && nc % 16 == 0) {  // one token: the vector path
      static const Deinterleave3 perm;
      for (int64_t c = 0; c < nc; c += 16)
        conv4_step16(x + t0 * x_stride + c0, out + t0 * out_stride + c0, st, weight_t + c0,
                     bias ? bias + c0 : nullptr, D, c, act_silu, perm);
      return;
    }
  }
#endif
  float win[kMaxTaps][kConvBlock];  // win[k][c]: the K-1 previous inputs, oldest first
  for (int64_t k = 0; k < W; ++k) {
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) win[k][c] = to_f32(st[c * W + k]);
  }
  conv_block_tokens<KT>(win, t0, t1, x, x_stride, out, out_stride, weight_t, bias, act_silu, D, K, c0, nc);
  for (int64_t k = 0; k < W; ++k) {
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) st[c * W + k] = from_f32<ST>(win[k][c]);
  }
}

// Calls fn(s, c0, nc) for every sequence s with a state slot and block of channels c0 .. c0 + nc - 1 (kConvBlock
// channels, the last block fewer), the (sequence, block) pairs shared out among the threads; a padding row's
// (negative slot) outputs are zeros and its fn is not called.
template <typename AT, typename Fn>
inline void for_each_conv_block(int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots, AT* out,
                                int64_t out_stride, int64_t D, const Fn& fn) {
  const int64_t blocks = (D + kConvBlock - 1) / kConvBlock;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t c0 = blk * kConvBlock;
      const int64_t nc = (D - c0) < kConvBlock ? (D - c0) : kConvBlock;
      if (slots[s] < 0)
        zero_rows(out, out_stride, cu_seqlens[s], cu_seqlens[s + 1], c0, nc);
      else
        fn(s, c0, nc);
    }
  }
}

// KT: the kernel width when it is a compile-time size (the tap loops then unroll and the strided state
// accesses vectorize), 0 otherwise. weight_t is (K, D): tap-major, so a tap's weights are contiguous.
template <int KT, typename AT, typename ST>
void causal_conv1d_impl(int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots, const AT* x,
                        int64_t x_stride, ST* states, int64_t slot_stride, const float* weight_t, const float* bias,
                        int act_silu, AT* out, int64_t out_stride, int64_t D, int64_t K_) {
  const int64_t K = KT > 0 ? KT : K_;
  const int64_t W = K - 1;  // state width
  for_each_conv_block(num_seqs, cu_seqlens, slots, out, out_stride, D, [&](int64_t s, int64_t c0, int64_t nc) {
    conv_block<KT>(states + slots[s] * slot_stride + c0 * W, cu_seqlens[s], cu_seqlens[s + 1], x, x_stride, out,
                   out_stride, weight_t, bias, act_silu, D, K, c0, nc);
  });
}

// 8-bit conv state (cache/conv_codec.py): int8 codes (D, K-1) and an int8 power-of-two exponent per channel, (D,),
// per slot. A block of channels is decoded into float32 state rows, run by conv_block as a float32 state is, and
// encoded back: per channel the smallest power of two 2^e with 127 * 2^e >= max|x| (max|x| / 127 with its mantissa
// rounded up into the exponent; e = 0 for zeros), codes x * 2^-e rounded to nearest even. Decoding and the
// scaling are exact, so a decoded state whose exponent stays encodes to the same codes.

// The scale 2^e of a channel as float bits, and the exponent of the smallest power of two >= q >= 0 (0 for q = 0),
// in integer operations on the float bits (branch-free, so that the channel loops below vectorize).
inline float power_of_two_bits(int32_t e) {  // 2^e, e in [-126, 127]
  return __builtin_bit_cast(float, static_cast<uint32_t>(e + 127) << 23);
}

inline int32_t power_of_two_exponent_bits(float q) {
  const uint32_t b = __builtin_bit_cast(uint32_t, q);
  const uint32_t up = (b & 0x007FFFFFu) ? (b & 0x7F800000u) + 0x00800000u : b;
  return b == 0 ? 0 : static_cast<int32_t>(up >> 23) - 127;
}

#if defined(__AVX512F__)
// Width-3 rows (kernel 4), 16 channels at a time: their 48 values interleaved (c, 3) in three vectors; lane j of
// vector v is element 16 v + j, of channel (16 v + j) / 3. channel_of[v] spreads a vector of 16 per-channel values
// over that order.
struct Spread3 {
  __m512i channel_of[3];
  Spread3() {
    alignas(64) int32_t a[16];
    for (int v = 0; v < 3; ++v) {
      for (int j = 0; j < 16; ++j) a[j] = (16 * v + j) / 3;
      channel_of[v] = _mm512_load_si512(a);
    }
  }
};

inline __m512 power_of_two16(__m512i e) {  // 2^e per lane, e in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23));
}

inline void conv_decode_rows3x16(const int8_t* cd, const int8_t* ex, float* rows, const Spread3& spread) {
  const __m512 scale = power_of_two16(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ex))));
  for (int v = 0; v < 3; ++v) {
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(cd + 16 * v))));
    _mm512_storeu_ps(rows + 16 * v, _mm512_mul_ps(codes, _mm512_permutexvar_ps(spread.channel_of[v], scale)));
  }
}

inline void conv_encode_rows3x16(const float* rows, int8_t* cd, int8_t* ex, const Spread3& spread,
                                 const Deinterleave3& perm) {
  const __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(rows)), v1 = _mm512_abs_ps(_mm512_loadu_ps(rows + 16)),
               v2 = _mm512_abs_ps(_mm512_loadu_ps(rows + 32));
  __m512 amax = _mm512_setzero_ps();
  for (int k = 0; k < 3; ++k)  // tap k of the 16 channels
    amax = _mm512_max_ps(amax, _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(v0, perm.lo[k], v1),
                                                          perm.from_hi[k], perm.hi[k], v2));
  const __m512i bits = _mm512_castps_si512(_mm512_div_ps(amax, _mm512_set1_ps(127.0f)));
  const __mmask16 inexact = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007FFFFF));
  const __m512i up = _mm512_mask_add_epi32(bits, inexact, _mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000)),
                                           _mm512_set1_epi32(0x00800000));
  const __mmask16 zero = _mm512_testn_epi32_mask(bits, bits);
  const __m512i e = _mm512_maskz_sub_epi32(static_cast<__mmask16>(~zero), _mm512_srli_epi32(up, 23),
                                           _mm512_set1_epi32(127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(ex), _mm512_cvtepi32_epi8(e));
  const __m512 inv = power_of_two16(_mm512_sub_epi32(_mm512_setzero_si512(), e));
  for (int v = 0; v < 3; ++v) {
    const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(rows + 16 * v),
                                        _mm512_permutexvar_ps(spread.channel_of[v], inv));
    const __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cd + 16 * v), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rounded)));
  }
}
#endif

// codes (nc, W) int8 and exponents (nc,) -> rows (nc, W) float32 (16 channels at a time for kernel 4 on AVX-512).
template <int KT>
inline void conv_decode_rows(const int8_t* cd, const int8_t* ex, float* rows, int64_t nc, int64_t W_) {
  const int64_t W = KT > 0 ? KT - 1 : W_;
  int64_t c0 = 0;
#if defined(__AVX512F__)
  if constexpr (KT == 4) {
    static const Spread3 spread;
    for (; c0 + 16 <= nc; c0 += 16) conv_decode_rows3x16(cd + c0 * 3, ex + c0, rows + c0 * 3, spread);
  }
#endif
  for (int64_t c = c0; c < nc; ++c) {
    const float scale = power_of_two_bits(ex[c]);
    for (int64_t k = 0; k < W; ++k) rows[c * W + k] = static_cast<float>(cd[c * W + k]) * scale;
  }
}

// rows (nc, W) float32 -> codes (nc, W) int8 and exponents (nc,): per channel the smallest power of two 2^e with
// 127 * 2^e >= max|x|, codes x * 2^-e rounded to nearest even.
template <int KT>
inline void conv_encode_rows(const float* rows, int8_t* cd, int8_t* ex, int64_t nc, int64_t W_) {
  const int64_t W = KT > 0 ? KT - 1 : W_;
  int64_t c0 = 0;
#if defined(__AVX512F__)
  if constexpr (KT == 4) {
    static const Spread3 spread;
    static const Deinterleave3 perm;
    for (; c0 + 16 <= nc; c0 += 16) conv_encode_rows3x16(rows + c0 * 3, cd + c0 * 3, ex + c0, spread, perm);
  }
#endif
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: (v + kRound) - kRound is v rounded to nearest even, |v| < 2^22
  for (int64_t c = c0; c < nc; ++c) {
    float amax = 0.0f;
    for (int64_t k = 0; k < W; ++k) {
      const float a = __builtin_fabsf(rows[c * W + k]);
      amax = a > amax ? a : amax;
    }
    const int32_t e = power_of_two_exponent_bits(amax / 127.0f);
    const float inv = power_of_two_bits(-e);
    ex[c] = static_cast<int8_t>(e);
    for (int64_t k = 0; k < W; ++k) {  // |x| * 2^-e <= 127: no code clips
      const float shifted = rows[c * W + k] * inv + kRound;  // (the product is exact: fused or not alike)
      cd[c * W + k] = static_cast<int8_t>(static_cast<int32_t>(shifted - kRound));
    }
  }
}

template <int KT, typename AT>
void causal_conv1d_coded_impl(int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots, const AT* x,
                              int64_t x_stride, int8_t* codes, int64_t code_slot_stride, int8_t* exponents,
                              int64_t exponent_slot_stride, const float* weight_t, const float* bias, int act_silu,
                              AT* out, int64_t out_stride, int64_t D, int64_t K_) {
  const int64_t K = KT > 0 ? KT : K_;
  const int64_t W = K - 1;
  for_each_conv_block(num_seqs, cu_seqlens, slots, out, out_stride, D, [&](int64_t s, int64_t c0, int64_t nc) {
    int8_t* cd = codes + slots[s] * code_slot_stride + c0 * W;      // (nc, W)
    int8_t* ex = exponents + slots[s] * exponent_slot_stride + c0;  // (nc,)
    alignas(64) float rows[kConvBlock * (kMaxTaps - 1)];            // (nc, W) float32: the float path's state rows
    conv_decode_rows<KT>(cd, ex, rows, nc, W);
    conv_block<KT>(rows, cu_seqlens[s], cu_seqlens[s + 1], x, x_stride, out, out_stride, weight_t, bias, act_silu,
                   D, K, c0, nc);
    conv_encode_rows<KT>(rows, cd, ex, nc, W);
  });
}

template <typename AT>
void causal_conv1d_coded_any(int64_t num_seqs, const int64_t* cu, const int64_t* slots, const AT* x, int64_t xs,
                             int8_t* codes, int64_t cs, int8_t* scales, int64_t ss, const float* w, const float* b,
                             int silu_flag, AT* out, int64_t os, int64_t D, int64_t K) {
  switch (K) {
    case 2: causal_conv1d_coded_impl<2>(num_seqs, cu, slots, x, xs, codes, cs, scales, ss, w, b, silu_flag, out, os, D,
                                        K); break;
    case 3: causal_conv1d_coded_impl<3>(num_seqs, cu, slots, x, xs, codes, cs, scales, ss, w, b, silu_flag, out, os, D,
                                        K); break;
    case 4: causal_conv1d_coded_impl<4>(num_seqs, cu, slots, x, xs, codes, cs, scales, ss, w, b, silu_flag, out, os, D,
                                        K); break;
    default: causal_conv1d_coded_impl<0>(num_seqs, cu, slots, x, xs, codes, cs, scales, ss, w, b, silu_flag, out, os,
                                         D, K);
  }
}

template <typename AT, typename ST>
void causal_conv1d_any(int64_t num_seqs, const int64_t* cu, const int64_t* slots, const AT* x, int64_t xs, ST* states,
                       int64_t ss, const float* w, const float* b, int silu_flag, AT* out, int64_t os, int64_t D,
                       int64_t K) {
  switch (K) {
    case 2: causal_conv1d_impl<2>(num_seqs, cu, slots, x, xs, states, ss, w, b, silu_flag, out, os, D, K); break;
    case 3: causal_conv1d_impl<3>(num_seqs, cu, slots, x, xs, states, ss, w, b, silu_flag, out, os, D, K); break;
    case 4: causal_conv1d_impl<4>(num_seqs, cu, slots, x, xs, states, ss, w, b, silu_flag, out, os, D, K); break;
    default: causal_conv1d_impl<0>(num_seqs, cu, slots, x, xs, states, ss, w, b, silu_flag, out, os, D, K);
  }
}

// ------------------------------------------------------------------------------------------
// Mamba2 scan over packed sequences, state (slots, H, P, N) updated in place
// ------------------------------------------------------------------------------------------

struct ScanParams {
  const float* A;        // (H,)
  const float* D;        // (H,) or null
  const float* dt_bias;  // (H,) or null
  int dt_softplus;
  int dt_clamp;
  float dt_lo, dt_hi;
  int64_t H, P, G, N;
};

// One head of one sequence. The state is held transposed, hT[n][p], so that the loops run over p
// in vector lanes: the update and y = h . C need no horizontal sums. PT is P when it is a compile-time
// size (the accumulator then stays in registers), 0 otherwise.
template <int PT, typename AT, typename ST>
void mamba2_scan_head(int64_t t0, int64_t t1, int64_t h, const AT* x, int64_t x_stride, const AT* Bm,
                      int64_t b_stride, const AT* Cm, int64_t c_stride, const AT* dt, int64_t dt_stride, ST* st,
                      float* y, int64_t y_stride, const ScanParams& p, float* __restrict__ hT,
                      float* __restrict__ work) {
  const int64_t P = PT > 0 ? PT : p.P, N = p.N, g = h / (p.H / p.G);
  float* __restrict__ xv = work;          // (P,) x_t of this head
  float* __restrict__ xdt = work + P;     // (P,) x_t * dt_t
  float* __restrict__ acc = work + 2 * P; // (P,) h_t . C_t
  for (int64_t q = 0; q < P; ++q)
    for (int64_t n = 0; n < N; ++n) hT[n * P + q] = to_f32(st[q * N + n]);
  const float a = p.A[h];
  const float d = p.D ? p.D[h] : 0.0f;
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    float dtv = to_f32(dt[t * dt_stride + h]) + bias;
    if (p.dt_softplus) dtv = softplus(dtv);
    if (p.dt_clamp) dtv = dtv < p.dt_lo ? p.dt_lo : (dtv > p.dt_hi ? p.dt_hi : dtv);
    const float decay = std::exp(dtv * a);
    const AT* xt = x + t * x_stride + h * P;
    const AT* bt = Bm + t * b_stride + g * N;
    const AT* ct = Cm + t * c_stride + g * N;
#pragma omp simd
    for (int64_t q = 0; q < P; ++q) {
      xv[q] = to_f32(xt[q]);
      xdt[q] = xv[q] * dtv;
      acc[q] = 0.0f;
    }
    if constexpr (PT > 0 && PT % kNativeLanes == 0) {
      // x*dt and the accumulators stay in vector registers across the n loop (register-wide vectors:
      // 16 lanes on AVX-512, 8 below).
      constexpr int NV = PT / kNativeLanes;
      vnf xd[NV], ac[NV];
      for (int i = 0; i < NV; ++i) {
        xd[i] = *reinterpret_cast<const vnf*>(xdt + kNativeLanes * i);
        ac[i] = vnf{};
      }
      for (int64_t n = 0; n < N; ++n) {
        const float bn = to_f32(bt[n]), cn = to_f32(ct[n]);
        vnf* row = reinterpret_cast<vnf*>(hT + n * PT);
        for (int i = 0; i < NV; ++i) {
          const vnf v = row[i] * decay + xd[i] * bn;
          row[i] = v;
          ac[i] += v * cn;
        }
      }
      for (int i = 0; i < NV; ++i) *reinterpret_cast<vnf*>(acc + kNativeLanes * i) = ac[i];
    } else {
      for (int64_t n = 0; n < N; ++n) {
        const float bn = to_f32(bt[n]), cn = to_f32(ct[n]);
        float* __restrict__ row = hT + n * P;
#pragma omp simd
        for (int64_t q = 0; q < P; ++q) {
          const float v = row[q] * decay + xdt[q] * bn;
          row[q] = v;
          acc[q] += v * cn;
        }
      }
    }
    float* yt = y + t * y_stride + h * P;
#pragma omp simd
    for (int64_t q = 0; q < P; ++q) yt[q] = acc[q] + d * xv[q];
  }
  for (int64_t q = 0; q < P; ++q)
    for (int64_t n = 0; n < N; ++n) st[q * N + n] = from_f32<ST>(hT[n * P + q]);
}

// One head of one sequence that has a single token: the state is read, updated and written back
// in one pass, in place (y is taken from the float32 new state, before it is rounded to ST).
template <typename AT, typename ST>
void mamba2_step_head(int64_t t, int64_t h, const AT* x, int64_t x_stride, const AT* Bm, int64_t b_stride,
                      const AT* Cm, int64_t c_stride, const AT* dt, int64_t dt_stride, ST* st, float* y,
                      int64_t y_stride, const ScanParams& p, float* work) {
  const int64_t P = p.P, N = p.N, g = h / (p.H / p.G);
  float* bt = work;
  float* ct = work + N;
  float dtv = to_f32(dt[t * dt_stride + h]) + (p.dt_bias ? p.dt_bias[h] : 0.0f);
  if (p.dt_softplus) dtv = softplus(dtv);
  if (p.dt_clamp) dtv = dtv < p.dt_lo ? p.dt_lo : (dtv > p.dt_hi ? p.dt_hi : dtv);
  const float decay = std::exp(dtv * p.A[h]);
  const float d = p.D ? p.D[h] : 0.0f;
  const AT* bsrc = Bm + t * b_stride + g * N;
  const AT* csrc = Cm + t * c_stride + g * N;
#pragma omp simd
  for (int64_t n = 0; n < N; ++n) {
    bt[n] = to_f32(bsrc[n]);
    ct[n] = to_f32(csrc[n]);
  }
  const AT* xt = x + t * x_stride + h * P;
  float* yt = y + t * y_stride + h * P;
  for (int64_t q = 0; q < P; ++q) {
    const float xv = to_f32(xt[q]);
    const float xdt = xv * dtv;
    ST* row = st + q * N;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < N; ++n) {
      const float v = to_f32(row[n]) * decay + xdt * bt[n];
      row[n] = from_f32<ST>(v);
      acc += v * ct[n];
    }
    yt[q] = acc + d * xv;
  }
}

#if defined(__AVX512F__)
// The single-token step with N a multiple of 16 (NV vectors): B and C stay in registers, each state
// row is read, updated and written back as NV vectors, and the next head's row is prefetched, so the
// pass runs at memory speed. Same arithmetic as mamba2_step_head.
template <int NV, typename AT, typename ST>
void mamba2_step_head_v(int64_t t, int64_t h, const AT* x, int64_t x_stride, const AT* Bm, int64_t b_stride,
                        const AT* Cm, int64_t c_stride, const AT* dt, int64_t dt_stride, ST* st, const ST* next,
                        float* y, int64_t y_stride, const ScanParams& p) {
  constexpr int64_t N = 16 * NV;
  const int64_t P = p.P, g = h / (p.H / p.G);
  float dtv = to_f32(dt[t * dt_stride + h]) + (p.dt_bias ? p.dt_bias[h] : 0.0f);
  if (p.dt_softplus) dtv = softplus(dtv);
  if (p.dt_clamp) dtv = dtv < p.dt_lo ? p.dt_lo : (dtv > p.dt_hi ? p.dt_hi : dtv);
  const __m512 decay = _mm512_set1_ps(std::exp(dtv * p.A[h]));
  const float d = p.D ? p.D[h] : 0.0f;
  __m512 bv[NV], cv[NV];
  for (int i = 0; i < NV; ++i) {
    bv[i] = load16_ps(Bm + t * b_stride + g * N + 16 * i);
    cv[i] = load16_ps(Cm + t * c_stride + g * N + 16 * i);
  }
  const AT* xt = x + t * x_stride + h * P;
  float* yt = y + t * y_stride + h * P;
  constexpr int64_t kLines = (N * sizeof(ST) + 63) / 64;  // cache lines per state row
  for (int64_t q = 0; q < P; ++q) {
    const float xv = to_f32(xt[q]);
    const __m512 xdt = _mm512_set1_ps(xv * dtv);
    ST* row = st + q * N;
    if (next != nullptr)
      for (int64_t l = 0; l < kLines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next + q * N) + 64 * l, _MM_HINT_T0);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < NV; ++i) {
      const __m512 v = _mm512_fmadd_ps(load16_ps(row + 16 * i), decay, _mm512_mul_ps(xdt, bv[i]));
      store16_ps(row + 16 * i, v);
      acc = _mm512_fmadd_ps(v, cv[i], acc);
    }
    yt[q] = _mm512_reduce_add_ps(acc) + d * xv;
  }
}
#endif

#if defined(HS_MAMBA2_CHUNKED)
// One head of one long prefill sequence in the chunked form: the state read into hT (N x P float32,
// transposed as in mamba2_scan_head), the chunks on the tiles, the state stored back in its dtype.
template <typename ST>
void mamba2_chunked_head(const SsdPlan& plan, int64_t s, int64_t t0, int64_t t1, int64_t h, const BF16* x,
                         int64_t x_stride, const BF16* dt, int64_t dt_stride, ST* st, float* y, int64_t y_stride,
                         const ScanParams& p, float* __restrict__ hT, SsdScratch& scratch) {
  const int64_t P = p.P, N = p.N;
  for (int64_t q = 0; q < P; ++q)
    for (int64_t n = 0; n < N; ++n) hT[n * P + q] = to_f32(st[q * N + n]);
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.0f;
  auto dt_of = [&](int64_t t) {
    float dtv = to_f32(dt[t * dt_stride + h]) + bias;
    if (p.dt_softplus) dtv = softplus(dtv);
    if (p.dt_clamp) dtv = dtv < p.dt_lo ? p.dt_lo : (dtv > p.dt_hi ? p.dt_hi : dtv);
    return dtv;
  };
  ssd_scan_head(plan, plan.first_chunk[s], t0, t1, h, x, x_stride, y, y_stride, P, N, h / (p.H / p.G), p.A[h],
                p.D ? p.D[h] : 0.0f, dt_of, hT, scratch);
  for (int64_t q = 0; q < P; ++q)
    for (int64_t n = 0; n < N; ++n) st[q * N + n] = from_f32<ST>(hT[n * P + q]);
}
#endif

#if defined(HS_MAMBA2_CHUNKED)
using SsdPlanPtr = const SsdPlan*;
#else
using SsdPlanPtr = const void*;
#endif

// One head of one sequence over its tokens, on a state st (P, N) in ST: the chunked form for a long bf16
// sequence on AMX, the in-place step for one token, else the token-by-token scan. next: the state this thread
// takes next (prefetched by the AVX-512 step), or null.
template <typename AT, typename ST>
void mamba2_head(SsdPlanPtr plan, void* scratch, int64_t s, int64_t t0, int64_t t1, int64_t h, const AT* x,
                 int64_t x_stride, const AT* Bm, int64_t b_stride, const AT* Cm, int64_t c_stride, const AT* dt,
                 int64_t dt_stride, ST* st, const ST* next, float* y, int64_t y_stride, const ScanParams& p,
                 float* hbuf, float* wbuf) {
  const int64_t P = p.P, N = p.N;
#if defined(HS_MAMBA2_CHUNKED)
  if constexpr (std::is_same_v<AT, BF16>) {
    if (plan != nullptr && plan->chunks > 0 && plan->first_chunk[s] >= 0) {
      mamba2_chunked_head(*plan, s, t0, t1, h, x, x_stride, dt, dt_stride, st, y, y_stride, p, hbuf,
                          *static_cast<SsdScratch*>(scratch));
      return;
    }
  }
#else
  (void)plan;
  (void)scratch;
  (void)s;
#endif
#if defined(__AVX512F__)
  if (t1 - t0 == 1 && (N == 64 || N == 128)) {
    if (N == 64)
      mamba2_step_head_v<4>(t0, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, st, next, y, y_stride, p);
    else
      mamba2_step_head_v<8>(t0, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, st, next, y, y_stride, p);
    return;
  }
#else
  (void)next;
#endif
  if (t1 - t0 == 1)
    mamba2_step_head(t0, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, st, y, y_stride, p, wbuf);
  else if (P == 64)
    mamba2_scan_head<64>(t0, t1, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, st, y, y_stride, p, hbuf,
                         wbuf);
  else
    mamba2_scan_head<0>(t0, t1, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, st, y, y_stride, p, hbuf,
                        wbuf);
}

// A head of the pool: its sequence's slot (negative: none) and its index.
struct NextHead {
  int64_t slot;
  int64_t head;
};

// The single-token step of one head on an 8-bit state, in place, kNativeLanes rows at a time: each row's N codes
// (NV vectors) are decoded with its scale and updated in float32 in registers, read by y and for their largest
// magnitude, and kept in an L1 scratch; then the block's y sums and maxima (reduce_rows_add / _max: the rows
// transposed, the same sums) and its new row scales and their reciprocals at once, in vectors (row_scales): the
// per-row horizontal reductions, scalar divisions and roundings were about a third of a row's instructions; then
// each row is encoded back from the scratch with the seeded stochastic rounding (state_codec.h: encode_vecs).
// The codes and scales of the head this thread takes next (next: its pool slot, or negative for none) are
// prefetched meanwhile, so the pass over the pool runs at memory speed.
template <int KIND, int NV, typename AT>
void mamba2_step_head_coded(int64_t t, int64_t s, int64_t h, const AT* x, int64_t x_stride, const AT* Bm,
                            int64_t b_stride, const AT* Cm, int64_t c_stride, const AT* dt, int64_t dt_stride,
                            const CodedState& cs, const NextHead& next, float* y, int64_t y_stride,
                            const ScanParams& p) {
  constexpr int64_t N = kNativeLanes * NV;
  const int64_t P = p.P, g = h / (p.H / p.G);
  float dtv = to_f32(dt[t * dt_stride + h]) + (p.dt_bias ? p.dt_bias[h] : 0.0f);
  if (p.dt_softplus) dtv = softplus(dtv);
  if (p.dt_clamp) dtv = dtv < p.dt_lo ? p.dt_lo : (dtv > p.dt_hi ? p.dt_hi : dtv);
  const float decay = std::exp(dtv * p.A[h]);
  const float d = p.D ? p.D[h] : 0.0f;
  alignas(64) float bt[N], ct[N];
  for (int64_t n = 0; n < N; ++n) {
    bt[n] = to_f32(Bm[t * b_stride + g * N + n]);
    ct[n] = to_f32(Cm[t * c_stride + g * N + n]);
  }
  const vnf* bv = reinterpret_cast<const vnf*>(bt);
  const vnf* cv = reinterpret_cast<const vnf*>(ct);
  uint8_t* codes = cs.codes + cs.slots[s] * cs.code_stride + h * P * N;
  uint16_t* scales = cs.scales + cs.slots[s] * cs.scale_stride + h * P;
  const AT* xt = x + t * x_stride + h * P;
  float* yt = y + t * y_stride + h * P;
  const uint8_t* next_codes = next.slot < 0 ? nullptr : cs.codes + next.slot * cs.code_stride + next.head * P * N;
  if (next_codes != nullptr) {
    const auto* next_scales = reinterpret_cast<const char*>(cs.scales + next.slot * cs.scale_stride + next.head * P);
    for (int64_t b = 0; b < P * static_cast<int64_t>(sizeof(uint16_t)); b += 64) __builtin_prefetch(next_scales + b);
  }
  const uint32_t base = cs.base(s);
  NoiseBytesOf<kNativeLanes * N> noise(cs.stochastic);  // the block's, hashed at once (consecutive elements)
  alignas(64) float block[kNativeLanes * N];  // the block's updated rows, float32
  vnf acc[kNativeLanes], mx[kNativeLanes];  // each row's y products and largest magnitudes, lane by lane
  alignas(64) float sums[kNativeLanes], amax[kNativeLanes], inv[kNativeLanes];
  for (int64_t q0 = 0; q0 < P; q0 += kNativeLanes) {
    const int rows = static_cast<int>(P - q0 < kNativeLanes ? P - q0 : kNativeLanes);
    for (int r = 0; r < rows; ++r) {
      const int64_t q = q0 + r;
      const float xdt = to_f32(xt[q]) * dtv;
      const uint8_t* row = codes + q * N;
      if (next_codes != nullptr)
        for (int64_t b = 0; b < N; b += 64) __builtin_prefetch(next_codes + q * N + b);
      const float scale = scale_value(scales[q]);
      vnf* v = reinterpret_cast<vnf*>(block + r * N);
      acc[r] = vnf{};
      mx[r] = vnf{};
      for (int i = 0; i < NV; ++i) {
        const vnf u = decode_vec<KIND>(row + kNativeLanes * i, scale) * decay + xdt * bv[i];
        v[i] = u;
        acc[r] += u * cv[i];
        mx[r] = max_abs(mx[r], u);
      }
    }
    reduce_rows_add(acc, rows, sums);
    reduce_rows_max(mx, rows, amax);
    for (int r = 0; r < rows; ++r) yt[q0 + r] = sums[r] + d * to_f32(xt[q0 + r]);
    row_scales<KIND>(amax, rows, scales + q0, inv);
    const uint8_t* u = noise.fill(base, static_cast<uint32_t>(cs.offset + (h * P + q0) * N), rows * N);
    for (int r = 0; r < rows; ++r)
      encode_vecs<KIND, NV>(reinterpret_cast<const vnf*>(block + r * N), inv[r], u + r * N, codes + (q0 + r) * N);
  }
}

// Whether the coded single-token step takes rows of N (a compile-time number of register-wide vectors).
inline bool coded_step_fits(int64_t N) {
  const int64_t nv = N / kNativeLanes;
  return N % kNativeLanes == 0 && (nv == 1 || nv == 2 || nv == 4 || nv == 8 || nv == 16);
}

template <int KIND, typename AT>
void mamba2_step_coded(int64_t t, int64_t s, int64_t h, const AT* x, int64_t x_stride, const AT* Bm, int64_t b_stride,
                       const AT* Cm, int64_t c_stride, const AT* dt, int64_t dt_stride, const CodedState& cs,
                       const NextHead& next, float* y, int64_t y_stride, const ScanParams& p) {
  switch (p.N / kNativeLanes) {
    case 1: mamba2_step_head_coded<KIND, 1>(t, s, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, cs, next, y, y_stride, p); break;
    case 2: mamba2_step_head_coded<KIND, 2>(t, s, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, cs, next, y, y_stride, p); break;
    case 4: mamba2_step_head_coded<KIND, 4>(t, s, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, cs, next, y, y_stride, p); break;
    case 8: mamba2_step_head_coded<KIND, 8>(t, s, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, cs, next, y, y_stride, p); break;
    default: mamba2_step_head_coded<KIND, 16>(t, s, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, cs, next, y, y_stride, p);
  }
}

// IO: PlainRows<ST> (the state in place in its float dtype) or CodedRows<KIND> (8-bit: the single-token step
// works on the codes in place; a prefill head decodes its state to a float32 scratch once, runs its tokens and
// encodes the final state once).
template <typename AT, typename IO>
void mamba2_scan_impl(int64_t num_seqs, const int64_t* cu_seqlens, const AT* x, int64_t x_stride, const AT* Bm,
                      int64_t b_stride, const AT* Cm, int64_t c_stride, const AT* dt, int64_t dt_stride, const IO& io,
                      float* y, int64_t y_stride, const ScanParams& p) {
  const int64_t H = p.H, P = p.P, N = p.N;
  SsdPlanPtr plan_ptr = nullptr;
#if defined(HS_MAMBA2_CHUNKED)
  SsdPlan plan;  // the long sequences' chunks and their shared operands (none: every sequence token by token)
  if (std::is_same_v<AT, BF16> && ssd_shape_ok(P, N)) plan = SsdPlan(num_seqs, cu_seqlens, p.G, N);
  plan_ptr = &plan;
#endif
#pragma omp parallel
  {
    const FlushDenormals flush;  // decays exp(dt * A) can be subnormal: no slow assists on them
    std::vector<float> hbuf(P * N), wbuf(3 * P + 2 * N), sbuf(IO::coded ? P * N : 0);
    void* scratch_ptr = nullptr;
#if defined(HS_MAMBA2_CHUNKED)
    std::unique_ptr<SsdScratch> scratch;
    std::optional<AmxTileScope> tiles;  // configured while the chunked form runs, released at the region's end
    if (plan.chunks > 0) {  // the same on every thread
      scratch = std::make_unique<SsdScratch>(P, N);
      scratch_ptr = scratch.get();
      tiles.emplace(AmxTileConfig{kSsdTiles});
      if constexpr (std::is_same_v<AT, BF16>) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < plan.chunks * p.G; ++i)
          plan.pack(i / p.G, i % p.G, Bm, b_stride, Cm, c_stride, scratch->bt_pairs.data());
      }
    }
#endif
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
        if (io.slot(s) < 0) {  // a padding row: nothing of the pool is read or written
          zero_rows(y, y_stride, t0, t1, h * P, P);
          continue;
        }
        if constexpr (IO::coded) {
          if (t1 - t0 == 1 && coded_step_fits(N)) {
            // the head this thread takes next: the next head, or the first head of the next sequence
            const NextHead next = h + 1 < H ? NextHead{io.slot(s), h + 1}
                                            : NextHead{s + 1 < num_seqs ? io.slot(s + 1) : -1, 0};
            mamba2_step_coded<IO::kind>(t0, s, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, io.cs, next,
                                        y, y_stride, p);
            continue;
          }
          io.load(s, h * P * N, P, N, sbuf.data());
          mamba2_head(plan_ptr, scratch_ptr, s, t0, t1, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride,
                      sbuf.data(), static_cast<const float*>(nullptr), y, y_stride, p, hbuf.data(), wbuf.data());
          io.store(s, h * P * N, P, N, sbuf.data());
        } else {
          auto* st = io.base + io.slots[s] * io.slot_stride + h * P * N;
          // the state this thread takes next: the next head, or the first head of the next sequence
          const auto* next = h + 1 < H ? st + P * N : (s + 1 < num_seqs && io.slots[s + 1] >= 0 ? io.base + io.slots[s + 1] * io.slot_stride
                                                                           : nullptr);
          mamba2_head(plan_ptr, scratch_ptr, s, t0, t1, h, x, x_stride, Bm, b_stride, Cm, c_stride, dt, dt_stride, st,
                      next, y, y_stride, p, hbuf.data(), wbuf.data());
        }
      }
    }
  }
}

// Mamba1 selective scan, one (sequence, channel) per iteration: the channel's state row h (N,) in
// float32 through the sequence's tokens, stored back in the state dtype at its end.
//   dt = softplus(dt_raw + dt_bias); h = exp(dt * A) * h + (dt * x) * B; y = (h . C + D * x) * silu(z)
template <typename AT, typename IO>
void mamba1_scan_impl(int64_t num_seqs, const int64_t* cu_seqlens, const AT* x, int64_t xs, const AT* dt, int64_t dts,
                      const float* A, const AT* Bm, int64_t bs, const AT* Cm, int64_t cs, const float* D, const AT* z,
                      int64_t zs, const float* dt_bias, int dt_softplus, const IO& io, AT* y, int64_t ys, int64_t Dm,
                      int64_t N) {
#pragma omp parallel
  {
    const FlushDenormals flush;  // decays exp(dt * A) can be subnormal: no slow assists on them
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t d = 0; d < Dm; ++d) {
        if (io.slot(s) < 0) {  // a padding row: nothing of the pool is read or written
          zero_rows(y, ys, cu_seqlens[s], cu_seqlens[s + 1], d, 1);
          continue;
        }
        const float* a = A + d * N;
        float h[kMaxStateN];
        io.load(s, d * N, 1, N, h);
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
          float dtv = to_f32(dt[t * dts + d]) + (dt_bias != nullptr ? dt_bias[d] : 0.0f);
          if (dt_softplus) dtv = softplus(dtv);
          const float xv = to_f32(x[t * xs + d]);
          const float dx = dtv * xv;
          const AT* Br = Bm + t * bs;
          const AT* Cr = Cm + t * cs;
          float acc = 0.0f;
          for (int64_t n = 0; n < N; ++n) {
            h[n] = std::exp(dtv * a[n]) * h[n] + dx * to_f32(Br[n]);
            acc += h[n] * to_f32(Cr[n]);
          }
          float out = acc + (D != nullptr ? D[d] * xv : 0.0f);
          if (z != nullptr) {
            const float zv = to_f32(z[t * zs + d]);
            out *= zv / (1.0f + std::exp(-zv));
          }
          y[t * ys + d] = from_f32<AT>(out);
        }
        io.store(s, d * N, 1, N, h);
      }
    }
  }
}

// xLSTM's mLSTM cell, one (sequence, head) per iteration: the head's matrix memory C (Dk, Dv), normalizer
// n (Dk) and max state m in float32 through the sequence's tokens, stored back at its end. Per token, from
// q, k (Dk), v, o (Dv) and the raw gate pre-activations i, f (one each per head), in the activation dtype
// (each op on them rounded to it, as HF's soft cap and output gate run in the model's dtype):
//   i, f <- cap * tanh(i / cap), cap * tanh(f / cap)   (cap > 0; none when cap <= 0)
//   m' = max(logsigmoid(f) + m, i); C = exp(logsigmoid(f) + m - m') C + exp(i - m') k v^T; n likewise with k
//   h = (q C) Dk^-1/2 / (max(|q n| Dk^-1/2, exp(-m')) + eps), rounded to the activation dtype
//   out = sigmoid(o) * (layer_norm(h) * w + b)   over the head's Dv values, norm in float32
// At the end, m is rounded to the state dtype and C, n scaled by exp(m - rounded m): the same state, m exact.
template <typename AT, typename CIO, typename NIO, typename MT>
void mlstm_impl(int64_t num_seqs, const int64_t* cu_seqlens, const AT* q, int64_t qs, const AT* k, int64_t ks,
                const AT* v, int64_t vs, const AT* o, int64_t os, const AT* ig, int64_t igs, const AT* fg, int64_t fgs,
                float cap, const CIO& c_io, const NIO& n_io, const PlainRows<MT>& m_io, const AT* norm_w, const AT* norm_b, float norm_eps, float eps, AT* out, int64_t out_stride, int64_t H,
                int64_t Dk, int64_t Dv) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  auto rnd = [](float x) { return to_f32(from_f32<AT>(x)); };
  auto capped = [&](float x) { return cap > 0.0f ? rnd(cap * rnd(std::tanh(rnd(x / cap)))) : x; };
#pragma omp parallel
  {
    std::vector<float> C(Dk * Dv), n(Dk), qv(Dk), kv(Dk), num(Dv), hv(Dv);
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < H; ++h) {
        if (c_io.slot(s) < 0) {  // a padding row: nothing of the pool is read or written
          zero_rows(out, out_stride, cu_seqlens[s], cu_seqlens[s + 1], h * Dv, Dv);
          continue;
        }
        c_io.load(s, h * Dk * Dv, Dk, Dv, C.data());
        n_io.load(s, h * Dk, 1, Dk, n.data());
        float m;
        m_io.load(s, h, 1, 1, &m);
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
          const AT* qr = q + t * qs + h * Dk;
          const AT* kr = k + t * ks + h * Dk;
          const AT* vr = v + t * vs + h * Dv;
          const float i = capped(to_f32(ig[t * igs + h])), f = capped(to_f32(fg[t * fgs + h]));
          const float logf = std::fmin(f, 0.0f) - std::log1p(std::exp(-std::fabs(f)));  // torch's log_sigmoid
          const float m_new = std::fmax(logf + m, i);
          const float fa = std::exp(logf + m - m_new), ia = std::exp(i - m_new);
          m = m_new;
          for (int64_t j = 0; j < Dv; ++j) num[j] = 0.0f;
          float den = 0.0f;
          for (int64_t a = 0; a < Dk; ++a) {
            const float ka = to_f32(kr[a]), qa = to_f32(qr[a]) * scale;
            float* Ca = &C[a * Dv];
            for (int64_t j = 0; j < Dv; ++j) {
              Ca[j] = fa * Ca[j] + ia * (ka * to_f32(vr[j]));
              num[j] += qa * Ca[j];
            }
            n[a] = fa * n[a] + ia * ka;
            den += qa * n[a];
          }
          const float denom = std::fmax(std::fabs(den), std::exp(-m)) + eps;
          float mean = 0.0f;
          for (int64_t j = 0; j < Dv; ++j) {
            hv[j] = rnd(num[j] / denom);
            mean += hv[j];
          }
          mean /= static_cast<float>(Dv);
          float var = 0.0f;
          for (int64_t j = 0; j < Dv; ++j) var += (hv[j] - mean) * (hv[j] - mean);
          const float inv = 1.0f / std::sqrt(var / static_cast<float>(Dv) + norm_eps);
          const AT* orow = o + t * os + h * Dv;
          AT* yr = out + t * out_stride + h * Dv;
          for (int64_t j = 0; j < Dv; ++j) {
            float y = rnd(rnd((hv[j] - mean) * inv) * to_f32(norm_w[h * Dv + j]));
            if (norm_b != nullptr) y = rnd(y + to_f32(norm_b[h * Dv + j]));
            const float gate = rnd(1.0f / (1.0f + std::exp(-to_f32(orow[j]))));
            yr[j] = from_f32<AT>(gate * y);
          }
        }
        // m stored exactly: its rounding to its dtype moves into C and n (the same state)
        const float m_fit = to_f32(from_f32<MT>(m)), fit = std::exp(m - m_fit);
        if (fit != 1.0f) {
          for (int64_t a = 0; a < Dk * Dv; ++a) C[a] *= fit;
          for (int64_t a = 0; a < Dk; ++a) n[a] *= fit;
        }
        c_io.store(s, h * Dk * Dv, Dk, Dv, C.data());
        n_io.store(s, h * Dk, 1, Dk, n.data());
        m_io.store(s, h, 1, 1, &m_fit);
      }
    }
  }
}

// Decayed linear attention (MiniMax's lightning attention), one (sequence, head) per iteration: the
// head's state S (Dk, Dv) in float32 through the sequence's tokens, stored back at its end.
//   S = exp(-decay) * S + k v^T;  y = q S
template <typename AT, typename IO>
void linear_attention_impl(int64_t num_seqs, const int64_t* cu_seqlens, const AT* q, const AT* k, const AT* v,
                           int64_t row_stride, int64_t head_stride, const float* decay, const IO& io, AT* y,
                           int64_t ys, int64_t H, int64_t Dk, int64_t Dv) {
#pragma omp parallel
  {
    std::vector<float> S(Dk * Dv), out(Dv);
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < H; ++h) {
        if (io.slot(s) < 0) {  // a padding row: nothing of the pool is read or written
          zero_rows(y, ys, cu_seqlens[s], cu_seqlens[s + 1], h * Dv, Dv);
          continue;
        }
        const float f = std::exp(-decay[h]);
        io.load(s, h * Dk * Dv, Dk, Dv, S.data());
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
          const AT* qr = q + t * row_stride + h * head_stride;
          const AT* kr = k + t * row_stride + h * head_stride;
          const AT* vr = v + t * row_stride + h * head_stride;
          for (int64_t j = 0; j < Dv; ++j) out[j] = 0.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            const float ki = to_f32(kr[i]), qi = to_f32(qr[i]);
            float* Si = &S[i * Dv];
            for (int64_t j = 0; j < Dv; ++j) {
              Si[j] = f * Si[j] + ki * to_f32(vr[j]);
              out[j] += qi * Si[j];
            }
          }
          AT* yr = y + t * ys + h * Dv;
          for (int64_t j = 0; j < Dv; ++j) yr[j] = from_f32<AT>(out[j]);
        }
        io.store(s, h * Dk * Dv, Dk, Dv, S.data());
      }
    }
  }
}

// Qwen3-Next's gated delta rule, one (sequence, value head) per iteration: the head's state S (Dk,
// Dv) in float32 through the sequence's tokens, stored back at its end. Value head h reads key head
// h / R (R = Hv / Hk). Per token, from the conv output [q (Hk Dk) | k (Hk Dk) | v (Hv Dv)] and the
// b, a projection (per key head [b (R) | a (R)]):
//   beta = beta_scale * sigmoid(b) (OLMo-Hybrid's negative eigenvalues: beta_scale 2);
//   g = -exp(A_log) * softplus(a + dt_bias); q, k l2-normalized (eps 1e-6), q *= Dk^-1/2
//   S *= exp(g); u = beta * (v - S^T k); S += k u^T; out = S^T q
template <typename AT, typename IO>
void gated_delta_impl(int64_t num_seqs, const int64_t* cu_seqlens, const AT* conv, int64_t cs, const AT* ba,
                      int64_t bas, const float* A_log, const float* dt_bias, int l2norm, float beta_scale, const IO& io,
                      AT* out, int64_t os, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  const int64_t R = Hv / Hk;
  const float qscale = 1.0f / std::sqrt(static_cast<float>(Dk));
#pragma omp parallel
  {
    std::vector<float> S(Dk * Dv), q(Dk), k(Dk), u(Dv);
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < Hv; ++h) {
        const int64_t kh = h / R, r = h % R;
        if (io.slot(s) < 0) {  // a padding row: nothing of the pool is read or written
          zero_rows(out, os, cu_seqlens[s], cu_seqlens[s + 1], h * Dv, Dv);
          continue;
        }
        io.load(s, h * Dk * Dv, Dk, Dv, S.data());
        const float A = std::exp(A_log[h]);
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
          const AT* row = conv + t * cs;
          float qq = 0.0f, kk = 0.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            q[i] = to_f32(row[kh * Dk + i]);
            k[i] = to_f32(row[Hk * Dk + kh * Dk + i]);
            qq += q[i] * q[i];
            kk += k[i] * k[i];
          }
          const float qn = l2norm ? 1.0f / std::sqrt(qq + 1e-6f) : 1.0f, kn = l2norm ? 1.0f / std::sqrt(kk + 1e-6f) : 1.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            q[i] = q[i] * qn * qscale;
            k[i] = k[i] * kn;
          }
          const AT* bar = ba + t * bas + kh * 2 * R;
          const float beta = beta_scale / (1.0f + std::exp(-to_f32(bar[r])));
          const float decay = std::exp(-A * softplus(to_f32(bar[R + r]) + dt_bias[h]));
          const AT* v = row + 2 * Hk * Dk + h * Dv;
          for (int64_t j = 0; j < Dv; ++j) u[j] = 0.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            float* Si = &S[i * Dv];
            for (int64_t j = 0; j < Dv; ++j) {
              Si[j] *= decay;
              u[j] += Si[j] * k[i];
            }
          }
          for (int64_t j = 0; j < Dv; ++j) u[j] = beta * (to_f32(v[j]) - u[j]);
          AT* o = out + t * os + h * Dv;
          float acc[1024];
          for (int64_t j = 0; j < Dv; ++j) acc[j] = 0.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            float* Si = &S[i * Dv];
            for (int64_t j = 0; j < Dv; ++j) {
              Si[j] += k[i] * u[j];
              acc[j] += Si[j] * q[i];
            }
          }
          for (int64_t j = 0; j < Dv; ++j) o[j] = from_f32<AT>(acc[j]);
        }
        io.store(s, h * Dk * Dv, Dk, Dv, S.data());
      }
    }
  }
}

// Kimi delta attention (KDA), one (sequence, head) per iteration: the head's state S (Dk, Dv) in float32
// through the sequence's tokens, stored back at its end. Per token, from q, k (H Dk), v (H Dv), the forget
// projection f (H Dk) and the beta projection b (H), in the activation dtype:
//   g = -exp(A_log[h]) * softplus(f + dt_bias) (one per key channel); beta = sigmoid(b)
//   q, k l2-normalized (eps 1e-6) when l2norm, q *= Dk^-1/2
//   S = diag(exp(g)) S; u = beta * (v - S^T k); S += k u^T; o = S^T q, rounded to the activation dtype
// then, with a gate (H Dv), the sigmoid-gated norm over the head's Dv values, in float32:
//   out = norm_w * (o * rsqrt(mean(o^2) + eps)) * sigmoid(gate); without one, out = o.
template <typename AT, typename IO>
void kda_impl(int64_t num_seqs, const int64_t* cu_seqlens, const AT* q, int64_t qs, const AT* k, int64_t ks,
              const AT* v, int64_t vs, const AT* f, int64_t fs, const AT* b, int64_t bs, const float* A_log,
              const float* dt_bias, int l2norm, const IO& io, const AT* gate, int64_t gs,
              const float* norm_w, float norm_eps, AT* out, int64_t os, int64_t H, int64_t Dk, int64_t Dv) {
  const float qscale = 1.0f / std::sqrt(static_cast<float>(Dk));
#pragma omp parallel
  {
    std::vector<float> S(Dk * Dv), qv(Dk), kv(Dk), decay(Dk), u(Dv), o(Dv);
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < H; ++h) {
        if (io.slot(s) < 0) {  // a padding row: nothing of the pool is read or written
          zero_rows(out, os, cu_seqlens[s], cu_seqlens[s + 1], h * Dv, Dv);
          continue;
        }
        io.load(s, h * Dk * Dv, Dk, Dv, S.data());
        const float A = std::exp(A_log[h]);
        const float* bias = dt_bias + h * Dk;
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
          const AT* qr = q + t * qs + h * Dk;
          const AT* kr = k + t * ks + h * Dk;
          const AT* fr = f + t * fs + h * Dk;
          float qq = 0.0f, kk = 0.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            qv[i] = to_f32(qr[i]);
            kv[i] = to_f32(kr[i]);
            qq += qv[i] * qv[i];
            kk += kv[i] * kv[i];
            decay[i] = std::exp(-A * softplus(to_f32(fr[i]) + bias[i]));
          }
          const float qn = l2norm ? 1.0f / std::sqrt(qq + 1e-6f) : 1.0f;
          const float kn = l2norm ? 1.0f / std::sqrt(kk + 1e-6f) : 1.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            qv[i] = qv[i] * qn * qscale;
            kv[i] = kv[i] * kn;
          }
          const float beta = 1.0f / (1.0f + std::exp(-to_f32(b[t * bs + h])));
          const AT* vr = v + t * vs + h * Dv;
          for (int64_t j = 0; j < Dv; ++j) u[j] = 0.0f;
          for (int64_t i = 0; i < Dk; ++i) {
            float* Si = &S[i * Dv];
            const float di = decay[i], ki = kv[i];
#pragma omp simd
            for (int64_t j = 0; j < Dv; ++j) {
              Si[j] *= di;
              u[j] += Si[j] * ki;
            }
          }
          for (int64_t j = 0; j < Dv; ++j) {
            u[j] = beta * (to_f32(vr[j]) - u[j]);
            o[j] = 0.0f;
          }
          for (int64_t i = 0; i < Dk; ++i) {
            float* Si = &S[i * Dv];
            const float ki = kv[i], qi = qv[i];
#pragma omp simd
            for (int64_t j = 0; j < Dv; ++j) {
              Si[j] += ki * u[j];
              o[j] += Si[j] * qi;
            }
          }
          AT* yr = out + t * os + h * Dv;
          if (gate == nullptr) {
            for (int64_t j = 0; j < Dv; ++j) yr[j] = from_f32<AT>(o[j]);
            continue;
          }
          float ms = 0.0f;
          for (int64_t j = 0; j < Dv; ++j) {
            o[j] = to_f32(from_f32<AT>(o[j]));  // the recurrence's output in the activation dtype
            ms += o[j] * o[j];
          }
          const float r = 1.0f / std::sqrt(ms / static_cast<float>(Dv) + norm_eps);
          const AT* gr = gate + t * gs + h * Dv;
          for (int64_t j = 0; j < Dv; ++j) {
            const float sig = 1.0f / (1.0f + std::exp(-to_f32(gr[j])));
            yr[j] = from_f32<AT>(norm_w[j] * (o[j] * r) * sig);
          }
        }
        io.store(s, h * Dk * Dv, Dk, Dv, S.data());
      }
    }
  }
}

}  // namespace

extern "C" {

// Kimi delta attention, varlen (see kda_impl). q, k, f: (T, H Dk) rows, v: (T, H Dv) rows, b: (T, H) rows,
// gate: (T, H Dv) rows or null, all act dtype with their own strides; A_log: (H,), dt_bias: (H Dk,),
// norm_w: (Dv,) float32 (unread without a gate); states: slot s at states + slots[s] * slot_stride, (H, Dk,
// Dv) contiguous, state dtype; out: (T, H Dv) act dtype rows.
int hs_kda(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
           const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* f, int64_t fs,
           const void* b, int64_t bs, const float* A_log, const float* dt_bias, int l2norm, void* states,
           int64_t slot_stride, const void* gate, int64_t gs, const float* norm_w, float norm_eps, void* out,
           int64_t os, int64_t H, int64_t Dk, int64_t Dv) {
  if (H < 1 || Dk < 1 || Dv < 1 || (gate != nullptr && norm_w == nullptr)) return 1;
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    kda_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(q), qs, static_cast<const AT*>(k), ks,
                 static_cast<const AT*>(v), vs, static_cast<const AT*>(f), fs, static_cast<const AT*>(b), bs, A_log,
                 dt_bias, l2norm, PlainRows<ST>{static_cast<ST*>(states), slot_stride, slots},
                 static_cast<const AT*>(gate), gs, norm_w, norm_eps, static_cast<AT*>(out), os, H, Dk, Dv);
  });
}

// Qwen3-Next's gated delta rule, varlen (see gated_delta_impl). conv: (T, 2 Hk Dk + Hv Dv) rows (the
// conv output), ba: (T, 2 Hv) rows, both act dtype; A_log, dt_bias: (Hv,) float32; beta_scale: beta's
// multiplier (1, or 2 for OLMo-Hybrid); states: slot s at states + slots[s] * slot_stride, (Hv, Dk, Dv)
// contiguous; out: (T, Hv Dv) act dtype rows.
int hs_gated_delta_rule(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                        const int64_t* slots, const void* conv, int64_t cs, const void* ba, int64_t bas,
                        const float* A_log, const float* dt_bias, int l2norm, float beta_scale, void* states,
                        int64_t slot_stride, void* out, int64_t os, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  if (Hk < 1 || Hv % Hk != 0 || Dv > 1024) return 1;
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    gated_delta_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(conv), cs, static_cast<const AT*>(ba), bas,
                         A_log, dt_bias, l2norm, beta_scale, PlainRows<ST>{static_cast<ST*>(states), slot_stride, slots},
                         static_cast<AT*>(out), os, Hk, Hv, Dk, Dv);
  });
}

// The gated delta net's projection split (per key head [q (Dk) | k (Dk) | v (R Dv) | z (R Dv)]) into
// the conv input [all q | all k | all v] (T, 2 Hk Dk + Hk R Dv) and z (T, Hk R Dv), both contiguous.
int hs_gdn_split(int dtype, int64_t T, int64_t Hk, int64_t Dk, int64_t RDv, const void* qkvz, int64_t qs, void* mixed,
                 void* z) {
  return dispatch_dtype(dtype, [&](auto tag) {
    using AT = decltype(tag);
    const int64_t group = 2 * Dk + 2 * RDv, width = 2 * Hk * Dk + Hk * RDv;
    for (int64_t t = 0; t < T; ++t) {
      const AT* src = static_cast<const AT*>(qkvz) + t * qs;
      AT* m = static_cast<AT*>(mixed) + t * width;
      AT* zr = static_cast<AT*>(z) + t * Hk * RDv;
      for (int64_t h = 0; h < Hk; ++h) {
        const AT* g = src + h * group;
        std::memcpy(m + h * Dk, g, Dk * sizeof(AT));
        std::memcpy(m + Hk * Dk + h * Dk, g + Dk, Dk * sizeof(AT));
        std::memcpy(m + 2 * Hk * Dk + h * RDv, g + 2 * Dk, RDv * sizeof(AT));
        std::memcpy(zr + h * RDv, g + 2 * Dk + RDv, RDv * sizeof(AT));
      }
    }
  });
}

// xLSTM's mLSTM cell with its multi-head norm and output gate, varlen. q, k (H Dk), v, o (H Dv), ig, fg (H):
// token t at base + t * its stride, act dtype; states: slot s at {c,n,m}_states + slots[s] * slot_stride,
// C (H, Dk, Dv), n (H, Dk), m (H) contiguous, state dtype; norm_w, norm_b (H Dv, norm_b may be null): act
// dtype; out: (T, H Dv) act dtype rows.
int hs_mlstm(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
             const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* o,
             int64_t os, const void* ig, int64_t igs, const void* fg, int64_t fgs, float gate_cap, void* c_states,
             void* n_states, void* m_states, int64_t slot_stride, const void* norm_w, const void* norm_b,
             float norm_eps, float eps, void* out, int64_t out_stride, int64_t H, int64_t Dk, int64_t Dv) {
  if (H < 1 || Dk < 1 || Dv < 1) return 1;
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    mlstm_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(q), qs, static_cast<const AT*>(k), ks,
                   static_cast<const AT*>(v), vs, static_cast<const AT*>(o), os, static_cast<const AT*>(ig), igs,
                   static_cast<const AT*>(fg), fgs, gate_cap,
                   PlainRows<ST>{static_cast<ST*>(c_states), slot_stride, slots},
                   PlainRows<ST>{static_cast<ST*>(n_states), slot_stride, slots},
                   PlainRows<ST>{static_cast<ST*>(m_states), slot_stride, slots}, static_cast<const AT*>(norm_w),
                   static_cast<const AT*>(norm_b), norm_eps, eps, static_cast<AT*>(out), out_stride, H, Dk, Dv);
  });
}

// Decayed linear attention, varlen (MiniMax). q, k, v: token t, head h at base + t * row_stride +
// h * head_stride (act dtype; interleaved [q | k | v] heads of one projection, say); decay: (H,)
// float32 rates; states: slot s at states + slots[s] * slot_stride, (H, Dk, Dv) contiguous, state
// dtype; y: (T, H * Dv) act dtype rows.
int hs_linear_attention(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                        const int64_t* slots, const void* q, const void* k, const void* v, int64_t row_stride,
                        int64_t head_stride, const float* decay, void* states, int64_t slot_stride, void* y,
                        int64_t ys, int64_t H, int64_t Dk, int64_t Dv) {
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    linear_attention_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(q), static_cast<const AT*>(k),
                              static_cast<const AT*>(v), row_stride, head_stride, decay,
                              PlainRows<ST>{static_cast<ST*>(states), slot_stride, slots}, static_cast<AT*>(y), ys, H,
                              Dk, Dv);
  });
}

// Mamba1 selective scan, varlen (Mamba, FalconMamba, Jamba). x, dt (raw, before bias and softplus),
// z: (T, Dm) rows; B, C: (T, N) rows; all act dtype with their own strides; A: (Dm, N) float32 (A =
// -exp(A_log)); D, dt_bias: (Dm,) float32 or null; z null for no gate; states: slot s at states +
// slots[s] * slot_stride, (Dm, N) contiguous, state dtype; y: (T, Dm) act dtype rows.
int hs_mamba1_scan(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                   const void* x, int64_t xs, const void* dt, int64_t dts, const float* A, const void* B, int64_t bs,
                   const void* C, int64_t cs, const float* D, const void* z, int64_t zs, const float* dt_bias,
                   int dt_softplus, void* states, int64_t slot_stride, void* y, int64_t ys, int64_t Dm, int64_t N) {
  if (N < 1 || N > kMaxStateN) return 1;
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    mamba1_scan_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(x), xs, static_cast<const AT*>(dt), dts, A,
                         static_cast<const AT*>(B), bs, static_cast<const AT*>(C), cs, D, static_cast<const AT*>(z), zs,
                         dt_bias, dt_softplus, PlainRows<ST>{static_cast<ST*>(states), slot_stride, slots},
                         static_cast<AT*>(y), ys, Dm, N);
  });
}

// Causal depthwise conv, varlen. x, out: (T, D) rows with strides x_stride / out_stride (elements),
// act dtype; states: slot s at states + slots[s] * slot_stride, (D, K-1) contiguous, state dtype;
// weight_t: (K, D) float32 (tap-major); bias: (D,) float32 or null. Returns 0, or nonzero for an
// unsupported call.
int hs_causal_conv1d(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                     const int64_t* slots, const void* x, int64_t x_stride, void* states, int64_t slot_stride,
                     const float* weight_t, const float* bias, int act_silu, void* out, int64_t out_stride,
                     int64_t D, int64_t K) {
  if (K < 1 || K > kMaxTaps) return 1;
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    causal_conv1d_any<AT, ST>(num_seqs, cu_seqlens, slots, static_cast<const AT*>(x), x_stride,
                              static_cast<ST*>(states), slot_stride, weight_t, bias, act_silu, static_cast<AT*>(out),
                              out_stride, D, K);
  });
}

// The same over 8-bit conv state: codes (D, K-1) int8 at codes + slots[s] * code_slot_stride, exponents (D,)
// int8 at exponents + slots[s] * exponent_slot_stride (cache/conv_codec.py).
int hs_causal_conv1d_coded(int act_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                           const void* x, int64_t x_stride, void* codes, int64_t code_slot_stride, void* exponents,
                           int64_t exponent_slot_stride, const float* weight_t, const float* bias, int act_silu,
                           void* out, int64_t out_stride, int64_t D, int64_t K) {
  if (K < 2 || K > kMaxTaps) return 1;
  return dispatch_dtype(act_dtype, [&](auto act) {
    using AT = decltype(act);
    causal_conv1d_coded_any<AT>(num_seqs, cu_seqlens, slots, static_cast<const AT*>(x), x_stride,
                                static_cast<int8_t*>(codes), code_slot_stride, static_cast<int8_t*>(exponents),
                                exponent_slot_stride, weight_t,
                                bias, act_silu, static_cast<AT*>(out), out_stride, D, K);
  });
}

// Mamba2 scan, varlen. x: (T, H*P) rows, B, C: (T, G*N) rows, dt: (T, H) rows, all act dtype with
// their own row strides; states: slot s at states + slots[s] * slot_stride, (H, P, N) contiguous;
// y: (T, H*P) float32 rows with stride y_stride, gets h_t . C_t + D * x_t.
int hs_mamba2_scan(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                   const int64_t* slots, const void* x, int64_t x_stride, const void* B, int64_t b_stride,
                   const void* C, int64_t c_stride, const void* dt, int64_t dt_stride, const float* A,
                   const float* D, const float* dt_bias, int dt_softplus, int dt_clamp, float dt_lo, float dt_hi,
                   void* states, int64_t slot_stride, float* y, int64_t y_stride, int64_t H, int64_t P,
                   int64_t G, int64_t N) {
  if (G < 1 || H % G != 0) return 1;
  const ScanParams p{A, D, dt_bias, dt_softplus, dt_clamp, dt_lo, dt_hi, H, P, G, N};
  return dispatch_dtype_pair(act_dtype, state_dtype, [&](auto act, auto state) {
    using AT = decltype(act);
    using ST = decltype(state);
    mamba2_scan_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(x), x_stride, static_cast<const AT*>(B),
                         b_stride, static_cast<const AT*>(C), c_stride, static_cast<const AT*>(dt), dt_stride,
                         PlainRows<ST>{static_cast<ST*>(states), slot_stride, slots}, y, y_stride, p);
  });
}


// ---- 8-bit (coded) state: the same recurrences over codes and row scales (state_codec.h). Each takes, in
// place of a float state and its slot stride: codes (int8 or e4m3 bytes, code_dtype 3 or 4) with their slot
// stride, the bfloat16 row scales (the state's shape less its last axis) with theirs, the sequences' rounding
// keys (null: all 0) and positions (tokens absorbed after this call) and the layer index, which seed the
// stochastic rounding, and whether the rounding is stochastic (0: to nearest, the state kind's choice). A
// decode head is updated row by row in place (Mamba2) or through a float32 scratch of one head (the others); a
// prefill head's state is decoded once and its final state encoded once.

int hs_mamba2_scan_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                         const int64_t* slots, const void* x, int64_t x_stride, const void* B, int64_t b_stride,
                         const void* C, int64_t c_stride, const void* dt, int64_t dt_stride, const float* A,
                         const float* D, const float* dt_bias, int dt_softplus, int dt_clamp, float dt_lo, float dt_hi,
                         void* codes, int64_t code_stride, uint16_t* scales, int64_t scale_stride, const int64_t* keys,
                         const int64_t* positions, int64_t layer, int64_t offset, int64_t stochastic, float* y,
                         int64_t y_stride, int64_t H, int64_t P, int64_t G, int64_t N) {
  if (G < 1 || H % G != 0) return 1;
  const ScanParams p{A, D, dt_bias, dt_softplus, dt_clamp, dt_lo, dt_hi, H, P, G, N};
  const CodedState cs{static_cast<uint8_t*>(codes), code_stride, scales, scale_stride, slots, keys, positions,
                      layer, offset, stochastic != 0};
  return dispatch_act_coded(act_dtype, code_dtype, cs, [&](auto act, const auto& io) {
    using AT = decltype(act);
    mamba2_scan_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(x), x_stride, static_cast<const AT*>(B),
                         b_stride, static_cast<const AT*>(C), c_stride, static_cast<const AT*>(dt), dt_stride, io, y,
                         y_stride, p);
  });
}

int hs_mamba1_scan_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                         const int64_t* slots, const void* x, int64_t xs, const void* dt, int64_t dts, const float* A,
                         const void* B, int64_t bs, const void* C, int64_t cs, const float* D, const void* z,
                         int64_t zs, const float* dt_bias, int dt_softplus, void* codes, int64_t code_stride,
                         uint16_t* scales, int64_t scale_stride, const int64_t* keys, const int64_t* positions,
                         int64_t layer, int64_t offset, int64_t stochastic, void* y, int64_t ys, int64_t Dm,
                         int64_t N) {
  if (N < 1 || N > kMaxStateN) return 1;
  const CodedState st{static_cast<uint8_t*>(codes), code_stride, scales, scale_stride, slots, keys, positions,
                      layer, offset, stochastic != 0};
  return dispatch_act_coded(act_dtype, code_dtype, st, [&](auto act, const auto& io) {
    using AT = decltype(act);
    mamba1_scan_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(x), xs, static_cast<const AT*>(dt), dts, A,
                         static_cast<const AT*>(B), bs, static_cast<const AT*>(C), cs, D, static_cast<const AT*>(z), zs,
                         dt_bias, dt_softplus, io, static_cast<AT*>(y), ys, Dm, N);
  });
}

int hs_linear_attention_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                              const int64_t* slots, const void* q, const void* k, const void* v, int64_t row_stride,
                              int64_t head_stride, const float* decay, void* codes, int64_t code_stride, uint16_t* scales,
                              int64_t scale_stride, const int64_t* keys, const int64_t* positions, int64_t layer,
                              int64_t offset, int64_t stochastic, void* y, int64_t ys, int64_t H, int64_t Dk,
                              int64_t Dv) {
  const CodedState cs{static_cast<uint8_t*>(codes), code_stride, scales, scale_stride, slots, keys, positions,
                      layer, offset, stochastic != 0};
  return dispatch_act_coded(act_dtype, code_dtype, cs, [&](auto act, const auto& io) {
    using AT = decltype(act);
    linear_attention_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(q), static_cast<const AT*>(k),
                              static_cast<const AT*>(v), row_stride, head_stride, decay, io, static_cast<AT*>(y), ys,
                              H, Dk, Dv);
  });
}

int hs_gated_delta_rule_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                              const int64_t* slots, const void* conv, int64_t cs, const void* ba, int64_t bas,
                              const float* A_log, const float* dt_bias, int l2norm, float beta_scale, void* codes,
                              int64_t code_stride, uint16_t* scales, int64_t scale_stride, const int64_t* keys,
                              const int64_t* positions, int64_t layer, int64_t offset, int64_t stochastic, void* out,
                              int64_t os, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  if (Hk < 1 || Hv % Hk != 0 || Dv > 1024) return 1;
  const CodedState st{static_cast<uint8_t*>(codes), code_stride, scales, scale_stride, slots, keys, positions,
                      layer, offset, stochastic != 0};
  return dispatch_act_coded(act_dtype, code_dtype, st, [&](auto act, const auto& io) {
    using AT = decltype(act);
    gated_delta_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(conv), cs, static_cast<const AT*>(ba), bas,
                         A_log, dt_bias, l2norm, beta_scale, io, static_cast<AT*>(out), os, Hk, Hv, Dk, Dv);
  });
}

int hs_kda_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                 const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* f,
                 int64_t fs, const void* b, int64_t bs, const float* A_log, const float* dt_bias, int l2norm,
                 void* codes, int64_t code_stride, uint16_t* scales, int64_t scale_stride, const int64_t* keys,
                 const int64_t* positions, int64_t layer, int64_t offset, int64_t stochastic, const void* gate,
                 int64_t gs, const float* norm_w, float norm_eps, void* out, int64_t os, int64_t H, int64_t Dk,
                 int64_t Dv) {
  if (H < 1 || Dk < 1 || Dv < 1 || (gate != nullptr && norm_w == nullptr)) return 1;
  const CodedState cs{static_cast<uint8_t*>(codes), code_stride, scales, scale_stride, slots, keys, positions,
                      layer, offset, stochastic != 0};
  return dispatch_act_coded(act_dtype, code_dtype, cs, [&](auto act, const auto& io) {
    using AT = decltype(act);
    kda_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(q), qs, static_cast<const AT*>(k), ks,
                 static_cast<const AT*>(v), vs, static_cast<const AT*>(f), fs, static_cast<const AT*>(b), bs, A_log,
                 dt_bias, l2norm, io, static_cast<const AT*>(gate), gs, norm_w, norm_eps, static_cast<AT*>(out), os, H,
                 Dk, Dv);
  });
}

// C (H, Dk, Dv) and n (H, Dk) coded (one code dtype, their own codes and scales, one layer's noise); m (H) in
// a float dtype m_dtype at m_states + slots[s] * m_stride.
int hs_mlstm_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                   const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* o,
                   int64_t os, const void* ig, int64_t igs, const void* fg, int64_t fgs, float gate_cap,
                   void* c_codes, int64_t c_code_stride, uint16_t* c_scales, int64_t c_scale_stride, void* n_codes,
                   int64_t n_code_stride, uint16_t* n_scales, int64_t n_scale_stride, const int64_t* keys,
                   const int64_t* positions, int64_t layer, int64_t c_offset, int64_t n_offset, int64_t stochastic,
                   int m_dtype,
                   void* m_states, int64_t m_stride,
                   const void* norm_w, const void* norm_b, float norm_eps, float eps, void* out, int64_t out_stride,
                   int64_t H, int64_t Dk, int64_t Dv) {
  if (H < 1 || Dk < 1 || Dv < 1) return 1;
  const CodedState ccs{static_cast<uint8_t*>(c_codes), c_code_stride, c_scales, c_scale_stride, slots, keys,
                       positions, layer, c_offset, stochastic != 0};
  const CodedState ncs{static_cast<uint8_t*>(n_codes), n_code_stride, n_scales, n_scale_stride, slots, keys,
                       positions, layer, n_offset, stochastic != 0};
  int rc = 2;
  dispatch_dtype_pair(act_dtype, m_dtype, [&](auto act, auto mtag) {
    using AT = decltype(act);
    using MT = decltype(mtag);
    rc = dispatch_coded(code_dtype, ccs, [&](const auto& c_io) {
      using CIO = std::decay_t<decltype(c_io)>;
      mlstm_impl<AT>(num_seqs, cu_seqlens, static_cast<const AT*>(q), qs, static_cast<const AT*>(k), ks,
                     static_cast<const AT*>(v), vs, static_cast<const AT*>(o), os, static_cast<const AT*>(ig), igs,
                     static_cast<const AT*>(fg), fgs, gate_cap, c_io, CIO{ncs},
                     PlainRows<MT>{static_cast<MT*>(m_states), m_stride, slots}, static_cast<const AT*>(norm_w),
                     static_cast<const AT*>(norm_b), norm_eps, eps, static_cast<AT*>(out), out_stride, H, Dk, Dv);
    });
  });
  return rc;
}

}  // extern "C"

HS_REGISTRY(HS_KERNEL(hs_causal_conv1d) HS_KERNEL(hs_causal_conv1d_coded) HS_KERNEL(hs_mamba2_scan) HS_KERNEL(hs_mamba1_scan)
            HS_KERNEL(hs_linear_attention) HS_KERNEL(hs_gated_delta_rule) HS_KERNEL(hs_gdn_split)
            HS_KERNEL(hs_mlstm) HS_KERNEL(hs_kda) HS_KERNEL(hs_mamba2_scan_coded) HS_KERNEL(hs_mamba1_scan_coded)
            HS_KERNEL(hs_linear_attention_coded) HS_KERNEL(hs_gated_delta_rule_coded) HS_KERNEL(hs_kda_coded)
            HS_KERNEL(hs_mlstm_coded))
