// CPU kernels for the row-wise ops between the matmuls: RMS norm (optionally fused with the residual
// add before it), Mamba2's gated group RMS norm and its gate without a norm, and the gated-MLP activation
// silu(a) * b.
//
// Each reproduces the rounding of the PyTorch code it replaces (hybridserve/layers/norms.py, the
// MLPs): math in float32, and a value is rounded to the activation dtype wherever PyTorch would hold
// it in that dtype. Rows are (T, width) with a row stride in elements; parallel over rows.

#include "isa_level.h"
#include "registry.h"
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "vec16.h"
#include "vecmath.h"

namespace {

constexpr int64_t kParallelMin = 8192;  // elements below which a call runs on one thread
constexpr int64_t kMaxRotary = 1024;     // rotated features per head

template <typename T> inline float round_to(float v) { return to_f32(from_f32<T>(v)); }


// out = norm(x) * w, where norm(x) = x * rsqrt(mean(x^2) + eps).
//   zero_centered = 0: round(w * round(norm(x)))          (RMSNorm: weight * xf.to(dtype))
//   zero_centered = 1: round(norm(x) * (1 + w))           (RMSNorm with gamma - 1 weights)
//   zero_centered = 2: round(w * norm(x))                 (the weight multiply in float32: Nemotron-H)
// With add: first x = round(x + round(h * scale)) (round(x + h) when scale == 1), written to x_out.
template <typename AT>
void rms_norm_impl(int64_t T, int64_t D, const AT* x, int64_t xs, const AT* h, int64_t hs, float scale, AT* x_out,
                   int64_t xos, const AT* w, float eps, int zero_centered, AT* out, int64_t os) {
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const AT* xr = x + t * xs;
    AT* outr = out + t * os;
    float buf[8192];
    const bool fused = h != nullptr;
    float* v = buf;
    float ss = 0.0f;
    if (fused) {
      const AT* hr = h + t * hs;
      AT* xo = x_out + t * xos;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) {
        const float add = scale == 1.0f ? to_f32(hr[d]) : round_to<AT>(to_f32(hr[d]) * scale);
        const float sum = round_to<AT>(to_f32(xr[d]) + add);
        xo[d] = from_f32<AT>(sum);
        v[d] = sum;
        ss += sum * sum;
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) {
        v[d] = to_f32(xr[d]);
        ss += v[d] * v[d];
      }
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    if (zero_centered == 1) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) outr[d] = from_f32<AT>(v[d] * inv * (1.0f + to_f32(w[d])));
    } else if (zero_centered == 2) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) outr[d] = from_f32<AT>(to_f32(w[d]) * (v[d] * inv));
    } else {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) outr[d] = from_f32<AT>(to_f32(w[d]) * round_to<AT>(v[d] * inv));
    }
  }
}

// RMS norm over a float32 residual stream (Mamba2's residual_in_fp32), activations in AT:
//   with h: x_out = float(x) + float(h) (one float32 add), x of dtype XT (the first layer's bf16
//   embeddings, or the float32 stream);
//   round_input = 1: out = round(w * round(norm(round(sum))))  (the norm of sum.to(AT), as a layer's norm)
//   round_input = 0: out = round(w * norm(sum))                (the norm of the float32 sum, weight widened)
template <typename AT, typename XT>
void rms_norm_stream_impl(int64_t T, int64_t D, const XT* x, int64_t xs, const AT* h, int64_t hs, float* x_out,
                          int64_t xos, const AT* w, float eps, int round_input, AT* out, int64_t os) {
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const XT* xr = x + t * xs;
    AT* outr = out + t * os;
    float v[8192];
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) {
      float sum = to_f32(xr[d]);
      if (h != nullptr) {
        sum += to_f32(h[t * hs + d]);
        x_out[t * xos + d] = sum;
      }
      v[d] = round_input ? round_to<AT>(sum) : sum;
      ss += v[d] * v[d];
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    if (round_input) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) outr[d] = from_f32<AT>(to_f32(w[d]) * round_to<AT>(v[d] * inv));
    } else {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) outr[d] = from_f32<AT>(to_f32(w[d]) * (v[d] * inv));
    }
  }
}

// Mamba2's gated group norm of y (float32) with gate (act dtype), groups of G along the row:
//   mode = 0: v = round(y) * silu(gate); out = round(w * round(groupnorm(v)))
//   mode = 1: v = y * silu(gate);        out = round(w * groupnorm(v))
//   mode = 2: v = y;                     out = round(w * groupnorm(v) * silu(gate))   (norm before the gate)
template <typename AT>
void gated_rms_norm_impl(int64_t T, int64_t D, const float* y, int64_t ys, const AT* gate, int64_t gs, const AT* w,
                         int64_t G, float eps, int mode, AT* out, int64_t os) {
  const bool round_y = mode == 0, gate_first = mode != 2;
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* yr = y + t * ys;
    const AT* gr = gate + t * gs;
    AT* outr = out + t * os;
    for (int64_t g0 = 0; g0 < D; g0 += G) {
      float v[8192];
      float ss = 0.0f;
#if defined(__AVX512F__)
      if (G % 16 == 0) {  // the same float32 operations, 16 lanes at a time
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < G; d += 16) {
          __m512 yv = _mm512_loadu_ps(yr + g0 + d);
          if (round_y) yv = round16_ps<AT>(yv);
          const __m512 vv = gate_first ? _mm512_mul_ps(yv, silu16(load16_ps(gr + g0 + d))) : yv;
          _mm512_storeu_ps(v + d, vv);
          acc = _mm512_add_ps(acc, _mm512_mul_ps(vv, vv));
        }
        ss = _mm512_reduce_add_ps(acc);
      } else
#endif
      {
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < G; ++d) {
          const float yv = round_y ? round_to<AT>(yr[g0 + d]) : yr[g0 + d];
          v[d] = gate_first ? yv * silu(to_f32(gr[g0 + d])) : yv;
          ss += v[d] * v[d];
        }
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(G) + eps);
      if (!gate_first) {
        for (int64_t d = 0; d < G; ++d)
          outr[g0 + d] = from_f32<AT>(to_f32(w[g0 + d]) * (v[d] * inv) * silu(to_f32(gr[g0 + d])));
      } else if (!round_y) {
#pragma omp simd
        for (int64_t d = 0; d < G; ++d) outr[g0 + d] = from_f32<AT>(to_f32(w[g0 + d]) * (v[d] * inv));
      } else {
#pragma omp simd
        for (int64_t d = 0; d < G; ++d) outr[g0 + d] = from_f32<AT>(to_f32(w[g0 + d]) * round_to<AT>(v[d] * inv));
      }
    }
  }
}

// out = round(round(silu(a)) * b)   (act(gate) * up, each op rounded to the activation dtype)
template <typename AT>
void silu_mul_impl(int64_t T, int64_t D, const AT* a, int64_t as, const AT* b, int64_t bs, AT* out, int64_t os) {
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const AT* ar = a + t * as;
    const AT* br = b + t * bs;
    AT* orow = out + t * os;
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16)  // the same float32 operations, 16 lanes at a time
      store16_ps(orow + d, _mm512_mul_ps(round16_ps<AT>(silu16(load16_ps(ar + d))), load16_ps(br + d)));
#endif
    for (; d < D; ++d) orow[d] = from_f32<AT>(round_to<AT>(silu(to_f32(ar[d]))) * to_f32(br[d]));
  }
}

// out = round(y * round(silu(gate))), y float32: ``(y * silu(gate)).to(dtype)``, the Mamba2 gate without a norm
// (Falcon-H1 without ``mamba_rms_norm``): silu rounded to the gate's dtype, the product taken in float32
template <typename AT>
void silu_gate_f32_impl(int64_t T, int64_t D, const float* y, int64_t ys, const AT* gate, int64_t gs, AT* out,
                        int64_t os) {
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* yr = y + t * ys;
    const AT* gr = gate + t * gs;
    AT* orow = out + t * os;
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16)  // the same float32 operations, 16 lanes at a time
      store16_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(yr + d), round16_ps<AT>(silu16(load16_ps(gr + d)))));
#endif
    for (; d < D; ++d) orow[d] = from_f32<AT>(yr[d] * round_to<AT>(silu(to_f32(gr[d]))));
  }
}

// Rotary embedding in place on x (T, H * Dh) rows: in each head, the first R features rotate by the
// token's cos/sin (T, R) rows, as ``x * cos + rotate_half(x) * sin`` with each op rounded to the
// activation dtype: out[i] = round(round(x[i] * cos[i]) + round(r[i] * sin[i])), r = (-x[R/2:R], x[:R/2]).
template <typename AT>
void rotary_impl(int64_t T, int64_t H, int64_t Dh, int64_t R, AT* x, int64_t xs, const AT* cos, const AT* sin,
                 int64_t cs) {
  const int64_t half = R / 2;
#pragma omp parallel for collapse(2) schedule(static) if (T * H * R >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      AT* v = x + t * xs + h * Dh;
      const AT* c = cos + t * cs;
      const AT* s = sin + t * cs;
      float buf[kMaxRotary];
      for (int64_t i = 0; i < R; ++i) buf[i] = to_f32(v[i]);
      for (int64_t i = 0; i < R; ++i) {
        const float r = i < half ? -buf[i + half] : buf[i - half];
        v[i] = from_f32<AT>(round_to<AT>(buf[i] * to_f32(c[i])) + round_to<AT>(r * to_f32(s[i])));
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HS_ARGMAX_VECTOR 1
// Lanes `m` of 16 values of a storage dtype as float32, the other lanes 0.
template <typename T> inline __m512 maskz_load16_ps(__mmask16 m, const T* p);
template <> inline __m512 maskz_load16_ps<float>(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
template <> inline __m512 maskz_load16_ps<BF16>(__mmask16 m, const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <> inline __m512 maskz_load16_ps<_Float16>(__mmask16 m, const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// One row of argmax_logsumexp_impl, 16 lanes at a time: max and NaN in one pass, the first index of the
// maximum, then the sum of exp(x - max).
template <typename T>
void argmax_logsumexp_row16(int64_t V, const T* row, int64_t* idx, float* lse, float* mx_out) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 vmax = neg_inf;
  __mmask16 nan = 0;
  const int64_t full = V / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (V - full)) - 1u);
  for (int64_t v = 0; v < full; v += 16) {
    const __m512 x = load16_ps(row + v);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, x);
  }
  if (tail) {
    const __m512 x = _mm512_mask_blend_ps(tail, neg_inf, maskz_load16_ps(tail, row + full));
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, x);
  }
  const float mx = nan ? NAN : _mm512_reduce_max_ps(vmax);
  *mx_out = mx;
  if (!std::isfinite(mx)) return;
  const __m512 vmx = _mm512_set1_ps(mx);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 lanes = v < full ? static_cast<__mmask16>(0xffff) : tail;
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, maskz_load16_ps(lanes, row + v), vmx, _CMP_EQ_OQ);
    if (hit) {
      *idx = v + __builtin_ctz(hit);
      break;
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t v = 0; v < full; v += 16)
    sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(load16_ps(row + v), vmx)));
  if (tail) sum = _mm512_mask_add_ps(sum, tail, sum, exp16(_mm512_sub_ps(maskz_load16_ps(tail, row + full), vmx)));
  *lse = mx + std::log(_mm512_reduce_add_ps(sum));
}
#endif

// Per row of logits (float32, or the model dtype they are exactly widened from): the first index of the
// maximum and log(sum(exp(x))) in float32. A row whose maximum is not finite (NaN or inf present) gets
// max_out = that value and is left to the caller.
template <typename T>
void argmax_logsumexp_impl(int64_t N, int64_t V, const T* x, int64_t xs, int64_t* idx, float* lse, float* mx_out) {
#pragma omp parallel for schedule(static) if (N * V >= kParallelMin)
  for (int64_t r = 0; r < N; ++r) {
    const T* row = x + r * xs;
#if defined(HS_ARGMAX_VECTOR)
    argmax_logsumexp_row16(V, row, idx + r, lse + r, mx_out + r);
    continue;
#endif
    float mx = -INFINITY;
    bool nan = false;
#pragma omp simd reduction(max : mx) reduction(|| : nan)
    for (int64_t v = 0; v < V; ++v) {
      const float x = to_f32(row[v]);
      mx = x > mx ? x : mx;
      nan = nan || x != x;
    }
    if (nan) mx = NAN;
    mx_out[r] = mx;
    if (!std::isfinite(mx)) continue;
    int64_t first = 0;
    while (to_f32(row[first]) != mx) ++first;
    idx[r] = first;
    // 16 partial sums, lane j over v = j mod 16, then added pairwise: one order whatever T and the
    // vector width, so a row in a 16-bit dtype sums exactly as its float32 widening does
    float part[16] = {};
    const int64_t full = V / 16 * 16;
    for (int64_t v = 0; v < full; v += 16)
      for (int j = 0; j < 16; ++j) part[j] += exp_f32(to_f32(row[v + j]) - mx);
    for (int64_t v = full; v < V; ++v) part[v - full] += exp_f32(to_f32(row[v]) - mx);
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) part[j] += part[j + w];
    lse[r] = mx + std::log(part[0]);
  }
}

}  // namespace

// out[t][d] = round(f(a[t][d], b[t][d], d)) over T rows of D (b null: f gets 0 for it), the rows split
// between threads from kParallelMin elements on: the element-wise kernels below.
template <typename AT, typename F>
void map_rows(int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out, int64_t os, F f) {
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const AT* ar = static_cast<const AT*>(a) + t * as;
    const AT* br = b != nullptr ? static_cast<const AT*>(b) + t * bs : nullptr;
    AT* o = static_cast<AT*>(out) + t * os;
    if (br != nullptr) {
      for (int64_t d = 0; d < D; ++d) o[d] = from_f32<AT>(f(to_f32(ar[d]), to_f32(br[d]), d));
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = from_f32<AT>(f(to_f32(ar[d]), 0.0f, d));
    }
  }
}

extern "C" {

int hs_argmax_logsumexp(int dtype, int64_t N, int64_t V, const void* x, int64_t xs, int64_t* idx, float* lse,
                        float* mx) {
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    argmax_logsumexp_impl<T>(N, V, static_cast<const T*>(x), xs, idx, lse, mx);
  });
}


int hs_rms_norm(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, const void* h, int64_t hs, float scale,
                void* x_out, int64_t xos, const void* w, float eps, int zero_centered, void* out, int64_t os) {
  if (D > 8192) return 1;
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    rms_norm_impl<AT>(T, D, static_cast<const AT*>(x), xs, static_cast<const AT*>(h), hs, scale, static_cast<AT*>(x_out),
                      xos, static_cast<const AT*>(w), eps, zero_centered, static_cast<AT*>(out), os);
  });
}

int hs_gated_rms_norm(int act_dtype, int64_t T, int64_t D, const float* y, int64_t ys, const void* gate, int64_t gs,
                      const void* w, int64_t G, float eps, int mode, void* out, int64_t os) {
  if (G < 1 || G > 8192 || D % G != 0 || mode < 0 || mode > 2) return 1;
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    gated_rms_norm_impl<AT>(T, D, y, ys, static_cast<const AT*>(gate), gs, static_cast<const AT*>(w), G, eps,
                            mode, static_cast<AT*>(out), os);
  });
}

int hs_rotary(int act_dtype, int64_t T, int64_t H, int64_t Dh, int64_t R, void* x, int64_t xs, const void* cos,
              const void* sin, int64_t cs) {
  if (R < 2 || R % 2 != 0 || R > Dh || R > kMaxRotary) return 1;
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    rotary_impl<AT>(T, H, Dh, R, static_cast<AT*>(x), xs, static_cast<const AT*>(cos), static_cast<const AT*>(sin), cs);
  });
}

int hs_silu_mul(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out,
                int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    silu_mul_impl<AT>(T, D, static_cast<const AT*>(a), as, static_cast<const AT*>(b), bs, static_cast<AT*>(out), os);
  });
}

int hs_silu_gate_f32(int act_dtype, int64_t T, int64_t D, const float* y, int64_t ys, const void* gate, int64_t gs,
                     void* out, int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    silu_gate_f32_impl<AT>(T, D, y, ys, static_cast<const AT*>(gate), gs, static_cast<AT*>(out), os);
  });
}

int hs_rms_norm_stream(int act_dtype, int x_dtype, int64_t T, int64_t D, const void* x, int64_t xs, const void* h,
                       int64_t hs, float* x_out, int64_t xos, const void* w, float eps, int round_input, void* out,
                       int64_t os) {
  if (D > 8192) return 1;
  return dispatch_dtype_pair(act_dtype, x_dtype, [&](auto a, auto xt) {
    using AT = decltype(a);
    using XT = decltype(xt);
    rms_norm_stream_impl<AT, XT>(T, D, static_cast<const XT*>(x), xs, static_cast<const AT*>(h), hs, x_out, xos,
                                 static_cast<const AT*>(w), eps, round_input, static_cast<AT*>(out), os);
  });
}

// out = round(a + round(b * scale)) (round(a + b) when scale == 1), as ``a + b * scale`` in PyTorch.
int hs_add(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, float scale,
           void* out, int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    map_rows<AT>(T, D, a, as, b, bs, out, os, [&](float x, float y, int64_t) {
      return x + (scale == 1.0f ? y : round_to<AT>(y * scale));
    });
  });
}

// act = 0: out = round(silu(x)); act = 1: out = round(round(sigmoid(x)) * b) (``sigmoid(x) * b``).
int hs_silu_or_sigmoid_mul(int act_dtype, int act, int64_t T, int64_t D, const void* x, int64_t xs, const void* b,
                           int64_t bs, void* out, int64_t os) {
  if (act != 0 && act != 1) return 1;
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    if (act == 0)
      map_rows<AT>(T, D, x, xs, nullptr, 0, out, os, [](float v, float, int64_t) { return silu(v); });
    else
      map_rows<AT>(T, D, x, xs, b, bs, out, os, [](float g, float y, int64_t) {
        return round_to<AT>(1.0f / (1.0f + exp_f32(-g))) * y;
      });
  });
}

// Qwen3-Next's gated norm: y = round(w * round(norm(x))); out = round(y * silu(z)) (silu in float32).
int hs_norm_then_gate(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, const void* w, float eps,
                      const void* z, int64_t zs, void* out, int64_t os) {
  if (D > 8192) return 1;
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
    for (int64_t t = 0; t < T; ++t) {
      const AT* xr = static_cast<const AT*>(x) + t * xs;
      const AT* zr = static_cast<const AT*>(z) + t * zs;
      const AT* wr = static_cast<const AT*>(w);
      AT* o = static_cast<AT*>(out) + t * os;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) ss += to_f32(xr[d]) * to_f32(xr[d]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) {
        const float y = round_to<AT>(to_f32(wr[d]) * round_to<AT>(to_f32(xr[d]) * inv));
        o[d] = from_f32<AT>(y * silu(to_f32(zr[d])));
      }
    }
  });
}

// out row t = round(round(sigmoid(g[t])) * x row t), g one value per row (stride gs): a shared expert's
// scalar gate.
int hs_row_sigmoid_gate(int act_dtype, int64_t T, int64_t D, const void* g, int64_t gs, const void* x, int64_t xs,
                        void* out, int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    for (int64_t t = 0; t < T; ++t) {
      const float gate = round_to<AT>(1.0f / (1.0f + exp_f32(-to_f32(static_cast<const AT*>(g)[t * gs]))));
      const AT* xr = static_cast<const AT*>(x) + t * xs;
      AT* o = static_cast<AT*>(out) + t * os;
      for (int64_t d = 0; d < D; ++d) o[d] = from_f32<AT>(gate * to_f32(xr[d]));
    }
  });
}

// out = round(a * b), element by element: ``a * b`` in PyTorch.
int hs_mul(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out,
           int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    map_rows<AT>(T, D, a, as, b, bs, out, os, [](float x, float y, int64_t) { return x * y; });
  });
}

// out = round(x * scale) with scale a scalar (cols == null) or per column (cols (D,) in the dtype):
// ``x * s`` and ``x * v`` in PyTorch.
int hs_scale(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, float scale, const void* cols, void* out,
             int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    const AT* v = static_cast<const AT*>(cols);
    if (v != nullptr)
      map_rows<AT>(T, D, x, xs, nullptr, 0, out, os, [v](float a, float, int64_t d) { return a * to_f32(v[d]); });
    else
      map_rows<AT>(T, D, x, xs, nullptr, 0, out, os, [scale](float a, float, int64_t) { return a * scale; });
  });
}

// out = round(round(gelu(a)) * b), gelu the exact (erf) one: ``gelu(a) * b`` in PyTorch.
int hs_gelu_mul(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out,
                int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    map_rows<AT>(T, D, a, as, b, bs, out, os, [](float v, float y, int64_t) {
      return round_to<AT>(0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f))) * y;
    });
  });
}

// out (T, Da + Db) = [a (T, Da), b (T, Db)] along the rows: ``torch.cat([a, b], dim=-1)``.
int hs_concat_cols(int dtype, int64_t T, int64_t Da, const void* a, int64_t as, int64_t Db, const void* b, int64_t bs,
                   void* out, int64_t os) {
  return dispatch_dtype(dtype, [&](auto tag) {
    using AT = decltype(tag);
    for (int64_t t = 0; t < T; ++t) {
      AT* o = static_cast<AT*>(out) + t * os;
      std::memcpy(o, static_cast<const AT*>(a) + t * as, Da * sizeof(AT));
      std::memcpy(o + Da, static_cast<const AT*>(b) + t * bs, Db * sizeof(AT));
    }
  });
}

// out = relu(x) ** 2, rounded once to the dtype (ACT2FN["relu2"]: relu is exact, the square rounded).
int hs_relu2(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, void* out, int64_t os) {
  return dispatch_dtype(act_dtype, [&](auto tag) {
    using AT = decltype(tag);
    map_rows<AT>(T, D, x, xs, nullptr, 0, out, os, [](float v, float, int64_t) {
      const float r = v > 0.0f ? v : 0.0f;
      return r * r;
    });
  });
}

// Row gather: out row t = table row ids[t], times scale when scale != 1 (rounded to the dtype as
// ``table[ids] * scale`` is in PyTorch: the product in float32, then rounded). Token embeddings and
// per-position RoPE tables. Returns 1, writing nothing, when an id is outside [0, num_rows).
int hs_gather_rows(int dtype, int64_t T, const int64_t* ids, const void* table, int64_t table_stride, int64_t num_rows,
                   int64_t D, float scale, void* out, int64_t os) {
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= num_rows) return 1;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T_ = decltype(tag);
    for (int64_t t = 0; t < T; ++t) {
      const T_* src = static_cast<const T_*>(table) + ids[t] * table_stride;
      T_* dst = static_cast<T_*>(out) + t * os;
      if (scale == 1.0f) {
        std::memcpy(dst, src, D * sizeof(T_));
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f32<T_>(to_f32(src[d]) * scale);
      }
    }
  });
}

}  // extern "C"

HS_REGISTRY(HS_KERNEL(hs_rms_norm) HS_KERNEL(hs_rms_norm_stream) HS_KERNEL(hs_gated_rms_norm) HS_KERNEL(hs_silu_mul) HS_KERNEL(hs_silu_gate_f32)
            HS_KERNEL(hs_relu2) HS_KERNEL(hs_add) HS_KERNEL(hs_mul) HS_KERNEL(hs_scale)
            HS_KERNEL(hs_silu_or_sigmoid_mul) HS_KERNEL(hs_norm_then_gate) HS_KERNEL(hs_row_sigmoid_gate)
            HS_KERNEL(hs_gelu_mul) HS_KERNEL(hs_concat_cols) HS_KERNEL(hs_rotary)
            HS_KERNEL(hs_gather_rows) HS_KERNEL(hs_argmax_logsumexp))
