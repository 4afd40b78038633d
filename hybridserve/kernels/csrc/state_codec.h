// 8-bit recurrent state rows in the kernels: the codes (int8 or float8 e4m3fn) and bfloat16 row scale of
// cache/state_codec.py, decoded to float32 and encoded back with the same seeded stochastic rounding, code
// for code: scale = max|x| / code_max rounded up to bfloat16 (stored as its bits), v = x * (1 / scale) with
// that stored scale (0 for a zero row), int8 code = clamp(floor(v + u), -127, 127), e4m3 code = floor(|v| /
// ulp + u) ulps (the e4m3 spacing of |v|'s binade, 2^-9 below the smallest normal), clamped to 448, with v's
// sign; u = (byte + 0.5) / 256 with byte the (e mod 4)-th byte, least significant first, of hash32(base + e /
// 4), e the element's flat index within one sequence's state tensor, base = noise_base(key, position, layer):
// one hash gives the noise of 4 elements.
//
// The row loops run on register-wide vectors (vec16.h: vnf) at every ISA level; the rounding additions are
// kept apart from the multiplies before them (no fused multiply-add), as PyTorch computes them.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum CodeDType : int { kCodeInt8 = 3, kCodeE4M3 = 4 };  // dtype codes after dtypes.h's float ones

typedef int32_t vni32 __attribute__((vector_size(4 * kNativeLanes), aligned(4)));
typedef uint32_t vnu32u __attribute__((vector_size(4 * kNativeLanes), aligned(4)));

// Keeps v as computed (rounded) so that the addition after it is not fused with the multiply before it.
template <typename V> inline void keep_rounded(V& v) {
#if defined(__x86_64__) || defined(__i386__)
#if defined(__AVX512F__)
  constexpr int kRegisterBytes = 64;
#elif defined(__AVX__)
  constexpr int kRegisterBytes = 32;
#else
  constexpr int kRegisterBytes = 16;
#endif
  if constexpr (sizeof(V) <= kRegisterBytes) {
    __asm__("" : "+v"(v));
  } else {
    __asm__("" : "+m"(v));  // no register holds the whole vector: through memory
  }
#else
  __asm__("" : "+m"(v));
#endif
}

inline uint32_t hash32(uint32_t x) {  // cache/state_codec.py: hash32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

inline vnu32 hash32(vnu32 x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// cache/state_codec.py: row_keys, for one sequence (key: its rounding key, position: tokens absorbed after
// this update).
inline uint32_t noise_base(int64_t key, int64_t position, int64_t layer) {
  uint32_t h = hash32(static_cast<uint32_t>(key));
  h = hash32(h ^ static_cast<uint32_t>(position));
  return hash32(h ^ static_cast<uint32_t>(layer));
}

inline vnu32 lane_index() {
  vnu32 v;
  for (int i = 0; i < kNativeLanes; ++i) v[i] = static_cast<uint32_t>(i);
  return v;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the noise bytes are read from the hash words' memory");

constexpr int64_t kNoisePerHash = 4;     // elements whose noise one 32-bit hash gives (a byte each)
// The noise byte of every element of a state rounded to nearest: u = (128 + 0.5) / 256 (cache/state_codec.py:
// NEAREST_NOISE).
constexpr uint8_t kNearestByte = 128;

// The noise bytes of a run of consecutive elements: fill(base, e0, n) hashes the words e0 / 4 .. (e0 + n - 1)
// / 4 and returns p with p[i] the byte of element e0 + i (n <= kElements); the words are hashed a
// register-wide vector at a time, and a vector load past the n bytes stays inside the buffer.
template <int64_t kElements> struct NoiseBytesOf {
  alignas(64) uint32_t words[kElements / kNoisePerHash + 3 * kNativeLanes];
  bool stochastic;

  // stochastic false: a state rounded to nearest, every element's byte kNearestByte (no hashing)
  explicit NoiseBytesOf(bool stochastic_ = true) : stochastic(stochastic_) {
    if (!stochastic) std::memset(words, kNearestByte, sizeof words);
  }

  const uint8_t* fill(uint32_t base, uint32_t e0, int64_t n) {
    if (!stochastic) return reinterpret_cast<const uint8_t*>(words);
    const uint32_t w0 = e0 / kNoisePerHash;
    const int64_t skip = e0 % kNoisePerHash;
    const int64_t count = (skip + n + kNoisePerHash - 1) / kNoisePerHash;
    const vnu32 first = (base + w0) + lane_index();
    for (int64_t k = 0; k < count; k += kNativeLanes)
      *reinterpret_cast<vnu32*>(words + k) = hash32(first + static_cast<uint32_t>(k));
    return reinterpret_cast<const uint8_t*>(words) + skip;
  }
};

// The sum and the largest lane of a register-wide vector, as a tree of shuffles.
inline float reduce_add(vnf v) {
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__) && !defined(HS_VECTOR_LANES)
  __m128 r = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
#else
  float r = 0.0f;
  for (int l = 0; l < kNativeLanes; ++l) r += v[l];
  return r;
#endif
}

inline float reduce_max(vnf v) {
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX2__) && !defined(HS_VECTOR_LANES)
  __m128 r = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
#else
  float r = v[0];
  for (int l = 1; l < kNativeLanes; ++l) r = v[l] > r ? v[l] : r;
  return r;
#endif
}

// reduce_add and reduce_max of kNativeLanes vectors at once (v[r]: row r's vector) -> out[r]: the same sums and
// maxima bit for bit, as each lane is paired with the same lane as in reduce_add's tree (i with i + 8, i + 4,
// i + 2, i + 1), the rows transposed along the way (about 3 instructions a row instead of 8).
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
template <typename Op> inline void reduce_rows_tree(const vnf* v, float* out, Op op) {
  __m512 w[8], z[4];
  for (int j = 0; j < 8; ++j) {  // w[j]: rows 2j (lanes 0-7) and 2j + 1 (lanes 8-15), lane i with i + 8
    const __m512 a = (__m512)v[2 * j], b = (__m512)v[2 * j + 1];
    w[j] = op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // z[k]: 128-bit lane l holds row 4k + l, lane i with i + 4
    z[k] = op(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88), _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  __m512 u[2];
  for (int k = 0; k < 2; ++k) {  // i with i + 2: in each 128-bit lane, rows of z[2k] then z[2k + 1], two partials each
    const __m512d a = _mm512_castps_pd(z[2 * k]), b = _mm512_castps_pd(z[2 * k + 1]);
    u[k] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // i with i + 1: element e of 128-bit lane l is row 4e + l
  const __m512 r = op(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
}
#elif defined(__AVX2__) && !defined(HS_VECTOR_LANES)
template <typename Op> inline void reduce_rows_tree(const vnf* v, float* out, Op op) {
  __m256 w[4];
  for (int j = 0; j < 4; ++j) {  // w[j]: rows 2j (lanes 0-3) and 2j + 1 (lanes 4-7), lane i with i + 4
    const __m256 a = (__m256)v[2 * j], b = (__m256)v[2 * j + 1];
    w[j] = op(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  __m256 u[2];
  for (int k = 0; k < 2; ++k) {  // i with i + 2
    const __m256d a = _mm256_castps_pd(w[2 * k]), b = _mm256_castps_pd(w[2 * k + 1]);
    u[k] = op(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  // i with i + 1: element e of 128-bit lane l is row 2e + l
  const __m256 r = op(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

// out[r] = reduce_max(v[r]) if Max, else reduce_add(v[r]), for r < n (n <= kNativeLanes).
template <bool Max> inline void reduce_rows(const vnf* v, int n, float* out) {
#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(HS_VECTOR_LANES)
  if (n == kNativeLanes) {
#if defined(__AVX512F__)
    reduce_rows_tree(v, out, [](__m512 a, __m512 b) { return Max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); });
#else
    reduce_rows_tree(v, out, [](__m256 a, __m256 b) { return Max ? _mm256_max_ps(a, b) : _mm256_add_ps(a, b); });
#endif
    return;
  }
#endif
  for (int r = 0; r < n; ++r) out[r] = Max ? reduce_max(v[r]) : reduce_add(v[r]);
}

inline void reduce_rows_add(const vnf* v, int n, float* out) { reduce_rows<false>(v, n, out); }
inline void reduce_rows_max(const vnf* v, int n, float* out) { reduce_rows<true>(v, n, out); }

// kNativeLanes bytes widened to int32 lanes (sign- or zero-extended), and int32 lanes (in the byte range)
// narrowed to bytes: explicit instructions, as GCC scalarizes these conversions of its vector types.
inline vni32 load_i8(const uint8_t* c) {
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
  return (vni32)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
#elif defined(__AVX2__) && !defined(HS_VECTOR_LANES)
  return (vni32)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
#else
  vni32 r;
  for (int i = 0; i < kNativeLanes; ++i) r[i] = static_cast<int8_t>(c[i]);
  return r;
#endif
}

inline vni32 load_u8(const uint8_t* c) {
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
  return (vni32)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
#elif defined(__AVX2__) && !defined(HS_VECTOR_LANES)
  return (vni32)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
#else
  vni32 r;
  for (int i = 0; i < kNativeLanes; ++i) r[i] = c[i];
  return r;
#endif
}

inline void store_bytes(vni32 v, uint8_t* c) {  // v's lanes in [-128, 255]: their low bytes
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtepi32_epi8((__m512i)v));
#elif defined(__AVX2__) && !defined(HS_VECTOR_LANES)
  const __m256i m = _mm256_and_si256((__m256i)v, _mm256_set1_epi32(0xff));
  const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(c), _mm_packus_epi16(w16, w16));
#else
  for (int i = 0; i < kNativeLanes; ++i) c[i] = static_cast<uint8_t>(v[i]);
#endif
}

// The uniform numbers (byte + 0.5) / 256 of kNativeLanes noise bytes (NoiseBytesOf), exactly.
inline vnf noise_vec(const uint8_t* bytes) {
  return __builtin_convertvector(load_u8(bytes), vnf) * 0x1p-8f + 0x1p-9f;
}

template <int KIND> inline vnf decode_vec(const uint8_t* c, float scale);

template <> inline vnf decode_vec<kCodeInt8>(const uint8_t* c, float scale) {
  return __builtin_convertvector(load_i8(c), vnf) * scale;
}

// e4m3fn bits -> float: (8 + mantissa) * 2^(exponent - 10), or mantissa * 2^-9 for exponent 0, exactly,
// without float32 subnormals (the kernels may run with denormals-are-zero), then v's sign.
template <> inline vnf decode_vec<kCodeE4M3>(const uint8_t* c, float scale) {
  const vni32 b = load_u8(c);
  const vni32 m7 = b & 0x7f, ex = m7 >> 3;
  const vni32 sig = (m7 & 7) | ((ex > 0) & 8);
  const vni32 e = ex > 1 ? ex : 1;
  const vni32 pow2 = (e + 117) << 23;  // 2^(e - 10)
  const vnf mag = __builtin_convertvector(sig, vnf) * reinterpret_cast<const vnf&>(pow2);
  const vni32 bits = reinterpret_cast<const vni32&>(mag) | ((b & 0x80) << 24);
  return reinterpret_cast<const vnf&>(bits) * scale;
}

template <int KIND> inline void encode_vec(vnf v, vnf u, uint8_t* c);

template <> inline void encode_vec<kCodeInt8>(vnf v, vnf u, uint8_t* c) {
  const vnf t = v + u;
#if defined(__AVX512F__) && !defined(HS_VECTOR_LANES)
  // floor in the conversion itself; the narrowing saturates at 127
  const __m512i r = _mm512_max_epi32(_mm512_cvt_roundps_epi32((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                     _mm512_set1_epi32(-127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtsepi32_epi8(r));
#else
  vni32 r = __builtin_convertvector(t, vni32);  // toward zero
  r += (vni32)(__builtin_convertvector(r, vnf) > t);  // -1 where that was above t: floor
  r = r < -127 ? -127 : r;
  r = r > 127 ? 127 : r;
  store_bytes(r, c);
#endif
}

// |v| in binade b (clamped below at -6) is scaled by 2^(3 - b), exactly, to ulps; floor(that + u) ulps are
// steps s in [0, 16], whose e4m3 bits are 8 b + 48 + s (the subnormals and a carry into the next binade
// included), clamped at 0x7e (448).
template <> inline void encode_vec<kCodeE4M3>(vnf v, vnf u, uint8_t* c) {
  const vnu32 vb = reinterpret_cast<const vnu32&>(v);
  const vnu32 mb = vb & 0x7fffffffu;
  const vnu32 field = mb >> 23;
  vni32 b = reinterpret_cast<const vni32&>(field) - 127;
  b = b < -6 ? -6 : b;
  const vni32 inv_ulp = (130 - b) << 23;  // 2^(3 - b)
  const vnf t = reinterpret_cast<const vnf&>(mb) * reinterpret_cast<const vnf&>(inv_ulp) + u;  // product exact
  const vni32 s = __builtin_convertvector(t, vni32);  // t >= 0: floor
  vni32 bits = 8 * b + 48 + s;
  bits = bits > 0x7e ? 0x7e : bits;
  const vnu32 sign = (vb >> 24) & 0x80u;
  bits |= reinterpret_cast<const vni32&>(sign);
  store_bytes(bits, c);
}

constexpr float code_max(int kind) { return kind == kCodeInt8 ? 127.0f : 448.0f; }

// n codes (a row) at c with scale -> out (float32).
template <int KIND> void decode_row(const uint8_t* c, float scale, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kNativeLanes <= n; i += kNativeLanes) *reinterpret_cast<vnf*>(out + i) = decode_vec<KIND>(c + i, scale);
  if (i < n) {
    uint8_t tail[kNativeLanes] = {};
    std::memcpy(tail, c + i, n - i);
    const vnf v = decode_vec<KIND>(tail, scale);
    std::memcpy(out + i, &v, (n - i) * sizeof(float));
  }
}

// A stored bfloat16 row scale (its bits) as float32.
inline float scale_value(uint16_t bits) {
  const uint32_t b = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// s >= 0 rounded up to bfloat16 (cache/state_codec.py: scale_up): its bits, and the float32 value they hold.
inline uint16_t scale_round_up(float s, float* value) {
  uint32_t b;
  std::memcpy(&b, &s, sizeof b);
  if ((b & 0x7fffffffu) < 0x7f800000u) b = (b + 0xffffu) & 0xffff0000u;  // finite: up to the next bfloat16
  std::memcpy(value, &b, sizeof b);
  *value = scale_value(static_cast<uint16_t>(b >> 16));
  return static_cast<uint16_t>(b >> 16);
}

// The row's scale (max|x| / code_max, up to bfloat16: its bits at scale) and the reciprocal v = x * inv takes
// (0 for a zero row).
template <int KIND> inline void row_scale(float amax, uint16_t* scale, float* inv) {
  float s;
  *scale = scale_round_up(amax / code_max(KIND), &s);
  *inv = s > 0.0f ? 1.0f / s : 0.0f;
}

// row_scale for n <= kNativeLanes rows at once, in vectors (the same divisions and roundings, lane by lane):
// amax[r] -> scales[r] (bfloat16 bits), inv[r] (all kNativeLanes entries written, 0 past n).
template <int KIND> inline void row_scales(const float* amax, int n, uint16_t* scales, float* inv) {
  if (n == 1) {  // one row: the scalar divisions
    std::memset(inv, 0, kNativeLanes * sizeof(float));
    row_scale<KIND>(amax[0], scales, inv);
    return;
  }
  alignas(64) float a[kNativeLanes] = {};
  std::memcpy(a, amax, n * sizeof(float));
  const vnf s = *reinterpret_cast<const vnf*>(a) / code_max(KIND);
  vnu32 b = reinterpret_cast<const vnu32&>(s);
  b = (b & 0x7fffffffu) < 0x7f800000u ? (b + 0xffffu) & 0xffff0000u : b;  // finite: up to the next bfloat16
  const vnu32 kept = b & 0xffff0000u;
  const vnf value = reinterpret_cast<const vnf&>(kept);
  const vnf r = value > 0.0f ? 1.0f / value : vnf{};
  std::memcpy(inv, &r, sizeof r);
  for (int i = 0; i < n; ++i) scales[i] = static_cast<uint16_t>(b[i] >> 16);
}

inline vnf vabs(vnf v) {
  const vnu32 bits = reinterpret_cast<const vnu32&>(v) & 0x7fffffffu;
  return reinterpret_cast<const vnf&>(bits);
}

// max(m, |v|) lane by lane (m >= 0).
inline vnf max_abs(vnf m, vnf v) {
#if defined(__AVX512DQ__) && !defined(HS_VECTOR_LANES)
  return (vnf)_mm512_range_ps((__m512)m, (__m512)v, 0x0B);  // the larger magnitude, sign cleared
#else
  const vnf a = vabs(v);
  return a > m ? a : m;
#endif
}

// NV register-wide vectors v of a row (N = NV * kNativeLanes values) -> their codes at c: v * inv rounded
// (encode_vec) with the noise bytes u of the row's elements (NoiseBytesOf).
template <int KIND, int NV> inline void encode_vecs(const vnf* v, float inv, const uint8_t* u, uint8_t* c) {
#if defined(__AVX512BW__) && !defined(HS_VECTOR_LANES)
  if constexpr (KIND == kCodeInt8 && NV % 4 == 0) {
    // four vectors at a time: floor in the conversion, packed to bytes with saturation at 127 (two packs and
    // one lane permutation instead of four narrowing stores), then the -127 floor on the bytes
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int i = 0; i < NV; i += 4) {
      __m512i r[4];
      for (int k = 0; k < 4; ++k) {
        vnf w = v[i + k] * inv;
        keep_rounded(w);
        const vnf t = w + noise_vec(u + kNativeLanes * (i + k));
        r[k] = _mm512_cvt_roundps_epi32((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      }
      const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(r[0], r[1]), _mm512_packs_epi32(r[2], r[3]));
      const __m512i codes = _mm512_max_epi8(_mm512_permutexvar_epi32(order, bytes), _mm512_set1_epi8(-127));
      _mm512_storeu_si512(c + kNativeLanes * i, codes);
    }
    return;
  }
#endif
  for (int i = 0; i < NV; ++i) {
    vnf w = v[i] * inv;
    keep_rounded(w);
    encode_vec<KIND>(w, noise_vec(u + kNativeLanes * i), c + kNativeLanes * i);
  }
}

// The lane-wise largest magnitudes of x (n,): reduce_max of it is max|x| (the tail past the last whole vector
// folded in, padded with zeros).
inline vnf row_max_lanes(const float* x, int64_t n) {
  vnf m{};
  int64_t i = 0;
  for (; i + kNativeLanes <= n; i += kNativeLanes) m = max_abs(m, *reinterpret_cast<const vnf*>(x + i));
  if (i < n) {
    alignas(64) float tail[kNativeLanes] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    m = max_abs(m, *reinterpret_cast<const vnf*>(tail));
  }
  return m;
}

// len float32 values at x -> codes at c: times inv, rounded with the noise bytes u of their elements
// (NoiseBytesOf: fill).
template <int KIND> void encode_run(const float* x, int64_t len, float inv, const uint8_t* u, uint8_t* c) {
  int64_t i = 0;
  for (; i + kNativeLanes <= len; i += kNativeLanes) {
    vnf v = *reinterpret_cast<const vnf*>(x + i) * inv;
    keep_rounded(v);
    encode_vec<KIND>(v, noise_vec(u + i), c + i);
  }
  if (i < len) {
    float tail[kNativeLanes] = {};
    uint8_t out[kNativeLanes];
    std::memcpy(tail, x + i, (len - i) * sizeof(float));
    vnf v = *reinterpret_cast<const vnf*>(tail) * inv;
    keep_rounded(v);
    encode_vec<KIND>(v, noise_vec(u + i), out);
    std::memcpy(c + i, out, len - i);
  }
}

// Elements whose noise encode_rows hashes at once (a block of rows up to this many elements).
constexpr int64_t kBlockNoise = 4096;

// rows consecutive rows of n float32 values (x) -> their codes at c and row scales (bfloat16 bits); element i of
// row r has flat index e0 + r n + i. The rows' maxima, scales and reciprocals are taken kNativeLanes rows at a
// time (reduce_rows_max, row_scales), and a block's noise hashed at once when it fits kBlockNoise, not one scalar
// division, rounding and noise fill per row (stochastic false: rounded to nearest, no noise hashed).
template <int KIND>
void encode_rows(const float* x, int64_t rows, int64_t n, uint32_t base, uint32_t e0, uint8_t* c, uint16_t* scales,
                 bool stochastic) {
  vnf mx[kNativeLanes];
  alignas(64) float amax[kNativeLanes], inv[kNativeLanes];
  NoiseBytesOf<kBlockNoise> noise(stochastic);
  for (int64_t r0 = 0; r0 < rows; r0 += kNativeLanes) {
    const int block = static_cast<int>(rows - r0 < kNativeLanes ? rows - r0 : kNativeLanes);
    for (int r = 0; r < block; ++r) mx[r] = row_max_lanes(x + (r0 + r) * n, n);
    reduce_rows_max(mx, block, amax);
    row_scales<KIND>(amax, block, scales + r0, inv);
    if (block * n <= kBlockNoise) {
      const uint8_t* u = noise.fill(base, e0 + static_cast<uint32_t>(r0 * n), block * n);
      for (int r = 0; r < block; ++r) encode_run<KIND>(x + (r0 + r) * n, n, inv[r], u + r * n, c + (r0 + r) * n);
      continue;
    }
    for (int r = 0; r < block; ++r) {
      const int64_t row = r0 + r;
      for (int64_t start = 0; start < n; start += kBlockNoise) {
        const int64_t len = n - start < kBlockNoise ? n - start : kBlockNoise;
        const uint8_t* u = noise.fill(base, e0 + static_cast<uint32_t>(row * n + start), len);
        encode_run<KIND>(x + row * n + start, len, inv[r], u, c + row * n + start);
      }
    }
  }
}

// One layer's 8-bit state tensor in the pool: sequence s's codes at codes + slots[s] * code_stride, its row
// scales (bfloat16 bits) at scales + slots[s] * scale_stride; its noise base from keys[s] (null: every key 0), positions[s]
// and the layer index; its elements numbered for the noise from offset on (0 but on a tensor-parallel rank's slice).
struct CodedState {
  uint8_t* codes;
  int64_t code_stride;
  uint16_t* scales;
  int64_t scale_stride;
  const int64_t* slots;
  const int64_t* keys;
  const int64_t* positions;
  int64_t layer;
  int64_t offset;  // the flat index of this tensor's first element in the whole tensor (a tensor-parallel slice)
  bool stochastic;  // false: rounded to nearest (the state kind's choice, cache/spec.py: TEMPORAL_ROUNDING)

  uint32_t base(int64_t s) const { return noise_base(keys != nullptr ? keys[s] : 0, positions[s], layer); }
};

// A state tensor's rows as the recurrences read and write them: the rows elements off .. off + rows * n of
// sequence s (row length n), to and from float32. Plain: the float dtype ST in place. Coded: codes and
// scales, encoded once per store (a prefill chunk's final state; the Mamba2 decode step has its own
// fused row loop).
template <typename ST> struct PlainRows {
  static constexpr bool coded = false;
  ST* base;
  int64_t slot_stride;
  const int64_t* slots;

  int64_t slot(int64_t s) const { return slots[s]; }  // negative: a padding row
  void load(int64_t s, int64_t off, int64_t rows, int64_t n, float* out) const {
    const ST* p = base + slots[s] * slot_stride + off;
    for (int64_t i = 0; i < rows * n; ++i) out[i] = to_f32(p[i]);
  }
  void store(int64_t s, int64_t off, int64_t rows, int64_t n, const float* in) const {
    ST* p = base + slots[s] * slot_stride + off;
    for (int64_t i = 0; i < rows * n; ++i) p[i] = from_f32<ST>(in[i]);
  }
};

template <int KIND> struct CodedRows {
  static constexpr bool coded = true;
  static constexpr int kind = KIND;
  CodedState cs;

  int64_t slot(int64_t s) const { return cs.slots[s]; }  // negative: a padding row
  void load(int64_t s, int64_t off, int64_t rows, int64_t n, float* out) const {
    const uint8_t* c = cs.codes + cs.slots[s] * cs.code_stride + off;
    const uint16_t* sc = cs.scales + cs.slots[s] * cs.scale_stride + off / n;
    for (int64_t r = 0; r < rows; ++r) decode_row<KIND>(c + r * n, scale_value(sc[r]), n, out + r * n);
  }
  void store(int64_t s, int64_t off, int64_t rows, int64_t n, const float* in) const {
    uint8_t* c = cs.codes + cs.slots[s] * cs.code_stride + off;
    uint16_t* sc = cs.scales + cs.slots[s] * cs.scale_stride + off / n;
    encode_rows<KIND>(in, rows, n, cs.base(s), static_cast<uint32_t>(cs.offset + off), c, sc, cs.stochastic);
  }
};

// Calls fn(CodedRows<KIND>{cs}) for a code dtype; returns 0, or 2 for an unknown code.
template <typename Fn> int dispatch_coded(int code_dtype, const CodedState& cs, Fn&& fn) {
  switch (code_dtype) {
    case kCodeInt8: fn(CodedRows<kCodeInt8>{cs}); return 0;
    case kCodeE4M3: fn(CodedRows<kCodeE4M3>{cs}); return 0;
    default: return 2;
  }
}

// Calls fn(AT{}, io) with AT the activation type and io the CodedRows of code_dtype; 0, or 2 for an unknown code.
template <typename Fn>
int dispatch_act_coded(int act_dtype, int code_dtype, const CodedState& cs, Fn&& fn) {
  int rc = 2;
  dispatch_dtype(act_dtype, [&](auto act) { rc = dispatch_coded(code_dtype, cs, [&](auto io) { fn(act, io); }); });
  return rc;
}

}  // namespace
