// CPU kernels for attention over the paged KV cache: the KV write and causal GQA attention for
// packed sequences (decode and prefill chunks alike), with an optional sliding window.
//
// Cache layout: (num_blocks, block_size, Hkv, Dh) with Dh contiguous, given by its strides; token
// slot = block * block_size + offset. Stored value = value / scale in the cache dtype (float32,
// bfloat16 or float16). Math is float32; the output is rounded to the query dtype.

#include "isa_level.h"
#include "registry.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "vecmath.h"
#include "vec16.h"

namespace {

struct CacheGeom {
  int64_t block_size, block_stride, token_stride, head_stride;  // strides in elements
};

// Offset of token pos's row (all KV heads) in the paged cache of one sequence.
inline int64_t token_row(const int64_t* table, int64_t pos, const CacheGeom& g) {
  return table[pos / g.block_size] * g.block_stride + (pos % g.block_size) * g.token_stride;
}

// rows[j] = token_row(table, lo + j, g) for j < n, walking the blocks (no division per token).
inline void token_rows(const int64_t* table, int64_t lo, int64_t n, const CacheGeom& g, int64_t* rows) {
  int64_t b = lo / g.block_size, o = lo % g.block_size;
  for (int64_t j = 0; j < n; ++j) {
    rows[j] = table[b] * g.block_stride + o * g.token_stride;
    if (++o == g.block_size) {
      o = 0;
      ++b;
    }
  }
}

constexpr int64_t kMaxVecs = 16;  // head_dim up to 256 keeps a converted K or V row in registers

struct AttnParams {
  int64_t Hq, Hkv, Dh;
  float scale, k_scale, v_scale;
  int64_t window;  // 0: none
};

template <typename AT, typename CT>
void kv_write_impl(int64_t T, const int64_t* slot_mapping, const AT* k, int64_t k_stride, const AT* v,
                   int64_t v_stride, CT* k_cache, CT* v_cache, const CacheGeom& g, int64_t Hkv, int64_t Dh,
                   float k_scale, float v_scale) {
  const bool kdiv = k_scale != 1.0f, vdiv = v_scale != 1.0f;
#pragma omp parallel for schedule(static) if (T * Hkv * Dh > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;  // a padding row of a captured step: it has no page
    const int64_t base = (slot / g.block_size) * g.block_stride + (slot % g.block_size) * g.token_stride;
    for (int64_t h = 0; h < Hkv; ++h) {
      CT* kd = k_cache + base + h * g.head_stride;
      CT* vd = v_cache + base + h * g.head_stride;
      const AT* ks = k + t * k_stride + h * Dh;
      const AT* vs = v + t * v_stride + h * Dh;
      for (int64_t d = 0; d < Dh; ++d) {
        const float kv = to_f32(ks[d]), vv = to_f32(vs[d]);
        kd[d] = from_f32<CT>(kdiv ? kv / k_scale : kv);
        vd[d] = from_f32<CT>(vdiv ? vv / v_scale : vv);
      }
    }
  }
}

// One query (a decode step) of one sequence, all heads, read straight from the cache: key and value
// rows are visited in token order with all KV heads of a token together (contiguous in a block), each
// loaded once for its R query heads; nothing is gathered.
template <typename AT, typename CT>
void attention_one_query(int64_t L, const int64_t* table, const AT* qrow, const CT* k_cache, const CT* v_cache,
                         const CacheGeom& g, AT* orow, const AttnParams& p, float* qf, float* sc, float* acc,
                         int64_t* rows) {
  const int64_t Dh = p.Dh, Hq = p.Hq, Hkv = p.Hkv, R = Hq / Hkv;
  const int64_t lo = p.window > 0 && L - p.window > 0 ? L - p.window : 0;
  const int64_t n = L - lo;
  // head_dim in 16-float vectors, a converted K or V row held in registers (0: scalar loops)
  const int64_t nv = Dh % 16 == 0 && Dh / 16 <= kMaxVecs ? Dh / 16 : 0;
  for (int64_t i = 0; i < Hq * Dh; ++i) qf[i] = to_f32(qrow[i]);
  token_rows(table, lo, n, g, rows);  // (n,) each key's cache row
  int64_t j = 0;
  if (nv > 0) {  // 16 keys at a time: their rows converted once, 16 dot products summed in one tree
    float kbuf[16 * 16 * kMaxVecs];
    for (; j + 16 <= n; j += 16) {
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        for (int64_t t = 0; t < 16; ++t) {
          const CT* kr = k_cache + rows[j + t] + kvh * g.head_stride;
          for (int64_t i = 0; i < nv; ++i) *reinterpret_cast<v16f*>(kbuf + t * Dh + 16 * i) = load16(kr + 16 * i);
        }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t hq = kvh * R + r;
          v16f qv[kMaxVecs];
          for (int64_t i = 0; i < nv; ++i) qv[i] = load16(qf + hq * Dh + 16 * i);
          v16f s[16];
          for (int64_t t = 0; t < 16; ++t) {
            const float* kt = kbuf + t * Dh;
            s[t] = qv[0] * load16(kt);
            for (int64_t i = 1; i < nv; ++i) s[t] += qv[i] * load16(kt + 16 * i);
          }
          *reinterpret_cast<v16f*>(sc + hq * n + j) = hsum16x16(s) * p.k_scale * p.scale;
        }
      }
    }
  }
  for (; j < n; ++j) {
    const int64_t row = rows[j];
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const CT* kr = k_cache + row + kvh * g.head_stride;
      if (nv > 0) {  // the key row converted once for its R query heads
        v16f kv[kMaxVecs];
        for (int64_t i = 0; i < nv; ++i) kv[i] = load16(kr + 16 * i);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t hq = kvh * R + r;
          const float* qh = qf + hq * Dh;
          v16f s = load16(qh) * kv[0];
          for (int64_t i = 1; i < nv; ++i) s += load16(qh + 16 * i) * kv[i];
          sc[hq * n + j] = hsum(s) * p.k_scale * p.scale;
        }
        continue;
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t hq = kvh * R + r;
        const float* qh = qf + hq * Dh;
        float dot = 0.0f;
        for (int64_t d = 0; d < Dh; ++d) dot += qh[d] * to_f32(kr[d]);
        sc[hq * n + j] = dot * p.k_scale * p.scale;
      }
    }
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* sr = sc + hq * n;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) mx = sr[j] > mx ? sr[j] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sr[j] = exp_f32(sr[j] - mx);
      sum += sr[j];
    }
    const float inv = p.v_scale / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
  }
  for (int64_t i = 0; i < Hq * Dh; ++i) acc[i] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = rows[j];
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const CT* vr = v_cache + row + kvh * g.head_stride;
      if (nv > 0) {  // the value row converted once for its R query heads (register-wide vectors)
        constexpr int64_t W = kNativeLanes;
        const int64_t nn = Dh / W;
        vnf vv[kMaxVecs * 16 / W];
        for (int64_t i = 0; i < nn; ++i) vv[i] = loadn(vr + W * i);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t hq = kvh * R + r;
          const float pj = sc[hq * n + j];
          float* ah = acc + hq * Dh;
          for (int64_t i = 0; i < nn; ++i) *reinterpret_cast<vnf*>(ah + W * i) += pj * vv[i];
        }
        continue;
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t hq = kvh * R + r;
        const float pj = sc[hq * n + j];
        float* ah = acc + hq * Dh;
        for (int64_t d = 0; d < Dh; ++d) ah[d] += pj * to_f32(vr[d]);
      }
    }
  }
  for (int64_t i = 0; i < Hq * Dh; ++i) orow[i] = from_f32<AT>(acc[i]);
}

// Four query rows (consecutive queries of one head) against the gathered keys kT (Dh x nk, transposed)
// and values v (nk x Dh), register-blocked: a key vector is loaded once for the four rows, a value
// vector once for the four rows. Row a attends keys [j0[a], j1[a]) of the buffers; rows past nrows
// repeat the last one and are not written.
template <int NV, typename AT>
void attention_rows4(int64_t nrows, const AT* const* qrows, AT* const* orows, const int64_t* j0, const int64_t* j1,
                     const float* kt, int64_t ldk, const float* vf, float* sc, const AttnParams& p) {
  const int64_t nk = ldk;  // kT row stride, also used as the stride of the four score rows
  constexpr int64_t Dh = NV * 16;
  float qv[4][Dh];
  int64_t lo[4], hi[4];
  for (int a = 0; a < 4; ++a) {
    const int64_t src = a < nrows ? a : nrows - 1;
    for (int64_t d = 0; d < Dh; ++d) qv[a][d] = to_f32(qrows[src][d]);
    lo[a] = j0[src];
    hi[a] = j1[src];
  }
  int64_t jb0 = lo[0], jb1 = hi[0];
  for (int a = 1; a < 4; ++a) {
    jb0 = lo[a] < jb0 ? lo[a] : jb0;
    jb1 = hi[a] > jb1 ? hi[a] : jb1;
  }
  float* srow[4] = {sc, sc + nk, sc + 2 * nk, sc + 3 * nk};
  int64_t j = jb0;
  constexpr int KW = 16 / kNativeLanes;  // register-wide vectors per 16 keys (lane arithmetic as 16 lanes)
  for (; j + 16 <= jb1; j += 16) {  // scores: 4 rows x 16 keys per pass over head_dim
    vnf s[4][KW] = {};
    for (int64_t d = 0; d < Dh; ++d) {
      for (int u = 0; u < KW; ++u) {
        const vnf k = loadn(kt + d * nk + j + u * kNativeLanes);
        for (int a = 0; a < 4; ++a) s[a][u] += qv[a][d] * k;
      }
    }
    for (int a = 0; a < 4; ++a)
      for (int u = 0; u < KW; ++u) *reinterpret_cast<vnf*>(srow[a] + j + u * kNativeLanes) = s[a][u];
  }
  for (; j < jb1; ++j) {
    for (int a = 0; a < 4; ++a) {
      float dot = 0.0f;
      for (int64_t d = 0; d < Dh; ++d) dot += qv[a][d] * kt[d * nk + j];
      srow[a][j] = dot;
    }
  }
  for (int a = 0; a < 4; ++a) {  // softmax over the row's own keys; 0 elsewhere in [jb0, jb1)
    float* sr = srow[a];
    float mx = -INFINITY;
    for (int64_t jj = lo[a]; jj < hi[a]; ++jj) {
      sr[jj] *= p.scale;
      mx = sr[jj] > mx ? sr[jj] : mx;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t jj = lo[a]; jj < hi[a]; ++jj) {
      sr[jj] = exp_f32(sr[jj] - mx);
      sum += sr[jj];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t jj = lo[a]; jj < hi[a]; ++jj) sr[jj] *= inv;
    for (int64_t jj = jb0; jj < lo[a]; ++jj) sr[jj] = 0.0f;
    for (int64_t jj = hi[a]; jj < jb1; ++jj) sr[jj] = 0.0f;
  }
  // weighted values: 4 rows x one register-wide slice of head_dim at a time, over every key (the
  // same sums in the same order as all of head_dim at once; 4 accumulators stay in registers)
  for (int i = 0; i < Dh / kNativeLanes; ++i) {
    vnf acc[4] = {};
    for (int64_t jj = jb0; jj < jb1; ++jj) {
      const vnf v = loadn(vf + jj * Dh + kNativeLanes * i);
      for (int a = 0; a < 4; ++a) acc[a] += srow[a][jj] * v;
    }
    for (int64_t a = 0; a < nrows; ++a)
      for (int e = 0; e < kNativeLanes; ++e) orows[a][kNativeLanes * i + e] = from_f32<AT>(acc[a][e]);
  }
}

// Work item: one sequence and one KV head. Its keys are gathered once, dequantized and transposed
// (kT[d][j]), so that scores for one query vectorize over keys; values stay token-major (v[j][d]) so
// that the weighted sum vectorizes over head_dim.
template <typename AT, typename CT>
void attention_impl(int64_t num_seqs, const int64_t* cu_q, const int64_t* seq_lens, const int64_t* block_tables,
                    int64_t bt_stride, const AT* q, int64_t q_stride, const CT* k_cache, const CT* v_cache,
                    const CacheGeom& g, AT* out, int64_t out_stride, const AttnParams& p) {
  const int64_t Dh = p.Dh, R = p.Hq / p.Hkv;
#pragma omp parallel
  {
    std::vector<float> kt, vf, scores, qf(p.Hq * Dh), acc(p.Hq * Dh);
    std::vector<int64_t> rows;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
        const int64_t L = seq_lens[s], q0 = cu_q[s], qlen = cu_q[s + 1] - cu_q[s];
        if (qlen <= 0) continue;
        if (L <= 0) {  // no context (a padding row of a captured step): no page is read, its heads get zeros
          for (int64_t t = q0; t < q0 + qlen; ++t)
            std::memset(out + t * out_stride + kvh * R * Dh, 0, R * Dh * sizeof(AT));
          continue;
        }
        if (qlen == 1) {  // all heads in the item of KV head 0
          if (kvh > 0) continue;
          if (static_cast<int64_t>(scores.size()) < p.Hq * L) scores.resize(p.Hq * L);
          if (static_cast<int64_t>(rows.size()) < L) rows.resize(L);
          attention_one_query(L, block_tables + s * bt_stride, q + q0 * q_stride, k_cache, v_cache, g,
                              out + q0 * out_stride, p, qf.data(), scores.data(), acc.data(), rows.data());
          continue;
        }
        const int64_t first_q = L - qlen;  // position of the first query
        const int64_t lo_min = p.window > 0 ? (first_q - p.window + 1 > 0 ? first_q - p.window + 1 : 0) : 0;
        const int64_t nk = L - lo_min;
        // kT row stride: nk rounded up to 16, plus 16, so that the rows of one key block do not all
        // fall into the same cache sets (a power-of-two stride would)
        const int64_t ldk = (nk + 15) / 16 * 16 + 16;
        if (static_cast<int64_t>(vf.size()) < nk * Dh || static_cast<int64_t>(kt.size()) < ldk * Dh) {
          kt.resize(ldk * Dh);
          vf.resize(nk * Dh);
          scores.resize(nk);
        }
        const int64_t* table = block_tables + s * bt_stride;
        for (int64_t j = 0; j < nk; ++j) {  // gather this head's keys and values, dequantized, once
          const int64_t pos = lo_min + j;
          const int64_t off = token_row(table, pos, g) + kvh * g.head_stride;
          float* vd = vf.data() + j * Dh;
          for (int64_t d = 0; d < Dh; ++d) kt[d * ldk + j] = to_f32(k_cache[off + d]) * p.k_scale;
#pragma omp simd
          for (int64_t d = 0; d < Dh; ++d) vd[d] = to_f32(v_cache[off + d]) * p.v_scale;
        }
        if (Dh == 64 || Dh == 128) {  // register-blocked: four queries of one head at a time
          if (static_cast<int64_t>(scores.size()) < 4 * ldk) scores.resize(4 * ldk);
          for (int64_t r = 0; r < R; ++r) {
            const int64_t hq = kvh * R + r;
            for (int64_t i0 = 0; i0 < qlen; i0 += 4) {
              const int64_t nrows = qlen - i0 < 4 ? qlen - i0 : 4;
              const AT* qrows[4];
              AT* orows[4];
              int64_t j0[4], j1[4];
              for (int64_t a = 0; a < nrows; ++a) {
                const int64_t qpos = first_q + i0 + a;
                const int64_t lo = p.window > 0 ? (qpos - p.window + 1 > lo_min ? qpos - p.window + 1 : lo_min) : 0;
                j0[a] = lo - lo_min;
                j1[a] = qpos - lo_min + 1;
                qrows[a] = q + (q0 + i0 + a) * q_stride + hq * Dh;
                orows[a] = out + (q0 + i0 + a) * out_stride + hq * Dh;
              }
              if (Dh == 64)
                attention_rows4<4>(nrows, qrows, orows, j0, j1, kt.data(), ldk, vf.data(), scores.data(), p);
              else
                attention_rows4<8>(nrows, qrows, orows, j0, j1, kt.data(), ldk, vf.data(), scores.data(), p);
            }
          }
          continue;
        }
        for (int64_t i = 0; i < qlen; ++i) {
          const int64_t qpos = first_q + i;
          const int64_t lo = p.window > 0 ? (qpos - p.window + 1 > lo_min ? qpos - p.window + 1 : lo_min) : 0;
          const int64_t j0 = lo - lo_min, j1 = qpos - lo_min + 1;  // keys [j0, j1) of the buffers
          float* sc = scores.data();
          for (int64_t r = 0; r < R; ++r) {
            const int64_t hq = kvh * R + r;
            const AT* qs = q + (q0 + i) * q_stride + hq * Dh;
            for (int64_t d = 0; d < Dh; ++d) qf[d] = to_f32(qs[d]);
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) sc[j] = 0.0f;
            for (int64_t d = 0; d < Dh; ++d) {
              const float qd = qf[d];
              const float* krow = kt.data() + d * ldk;
#pragma omp simd
              for (int64_t j = j0; j < j1; ++j) sc[j] += qd * krow[j];
            }
            float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
            for (int64_t j = j0; j < j1; ++j) {
              sc[j] *= p.scale;
              mx = sc[j] > mx ? sc[j] : mx;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = j0; j < j1; ++j) {
              sc[j] = exp_f32(sc[j] - mx);
              sum += sc[j];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t d = 0; d < Dh; ++d) acc[d] = 0.0f;
            for (int64_t j = j0; j < j1; ++j) {
              const float pj = sc[j] * inv;
              const float* vj = vf.data() + j * Dh;
#pragma omp simd
              for (int64_t d = 0; d < Dh; ++d) acc[d] += pj * vj[d];
            }
            AT* os = out + (q0 + i) * out_stride + hq * Dh;
#pragma omp simd
            for (int64_t d = 0; d < Dh; ++d) os[d] = from_f32<AT>(acc[d]);
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// Write T tokens' K and V ((T, Hkv*Dh) rows with their strides, act dtype) into their cache slots (none for a
// negative slot: a padding row).
int hs_kv_write(int act_dtype, int cache_dtype, int64_t T, const int64_t* slot_mapping, const void* k,
                int64_t k_stride, const void* v, int64_t v_stride, void* k_cache, void* v_cache, int64_t block_size,
                int64_t block_stride, int64_t token_stride, int64_t head_stride, int64_t Hkv, int64_t Dh,
                float k_scale, float v_scale) {
  const CacheGeom g{block_size, block_stride, token_stride, head_stride};
  return dispatch_dtype_pair(act_dtype, cache_dtype, [&](auto act, auto cache) {
    using AT = decltype(act);
    using CT = decltype(cache);
    kv_write_impl<AT, CT>(T, slot_mapping, static_cast<const AT*>(k), k_stride, static_cast<const AT*>(v), v_stride,
                          static_cast<CT*>(k_cache), static_cast<CT*>(v_cache), g, Hkv, Dh, k_scale, v_scale);
  });
}

// Causal attention of packed queries q ((T, Hq*Dh) rows, act dtype) over each sequence's first
// seq_lens[s] cached tokens (the queries are the last ones); out: (T, Hq*Dh) rows, act dtype. A sequence with
// no cached tokens (a padding row) reads nothing and gets zeros.
int hs_paged_attention(int act_dtype, int cache_dtype, int64_t num_seqs, const int64_t* cu_q,
                       const int64_t* seq_lens, const int64_t* block_tables, int64_t bt_stride, const void* q,
                       int64_t q_stride, const void* k_cache, const void* v_cache, int64_t block_size,
                       int64_t block_stride, int64_t token_stride, int64_t head_stride, void* out, int64_t out_stride,
                       int64_t Hq, int64_t Hkv, int64_t Dh, float scale, float k_scale, float v_scale,
                       int64_t window) {
  if (Hkv < 1 || Hq % Hkv != 0) return 1;
  const CacheGeom g{block_size, block_stride, token_stride, head_stride};
  const AttnParams p{Hq, Hkv, Dh, scale, k_scale, v_scale, window};
  return dispatch_dtype_pair(act_dtype, cache_dtype, [&](auto act, auto cache) {
    using AT = decltype(act);
    using CT = decltype(cache);
    attention_impl<AT, CT>(num_seqs, cu_q, seq_lens, block_tables, bt_stride, static_cast<const AT*>(q), q_stride,
                           static_cast<const CT*>(k_cache), static_cast<const CT*>(v_cache), g,
                           static_cast<AT*>(out), out_stride, p);
  });
}

}  // extern "C"

HS_REGISTRY(HS_KERNEL(hs_kv_write) HS_KERNEL(hs_paged_attention))
