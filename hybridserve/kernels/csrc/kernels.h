// Every exported CPU kernel, declared once. Each library includes this header, so its compiler checks
// every definition against the declaration here; the library's registry (registry.h) derives the
// argument types Python binds (kernels/_abi.py) and the replay's argument unpacking from these same
// declarations, so a kernel's C signature is written in this one place.
//
// Conventions: dtype codes as in dtypes.h (0 float32, 1 bfloat16, 2 float16); strides in elements;
// every kernel returns 0, or a positive code when it rejects its arguments.
#pragma once

#include <cstdint>

extern "C" {

// ---- pointwise.cpp: row-wise ops, each rounded as the PyTorch code it replaces
int hs_rms_norm(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, const void* h, int64_t hs, float scale,
                void* x_out, int64_t xos, const void* w, float eps, int zero_centered, void* out, int64_t os);
int hs_rms_norm_stream(int act_dtype, int x_dtype, int64_t T, int64_t D, const void* x, int64_t xs, const void* h,
                       int64_t hs, float* x_out, int64_t xos, const void* w, float eps, int round_input, void* out,
                       int64_t os);
int hs_gated_rms_norm(int act_dtype, int64_t T, int64_t D, const float* y, int64_t ys, const void* gate, int64_t gs,
                      const void* w, int64_t G, float eps, int mode, void* out, int64_t os);
int hs_silu_mul(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out,
                int64_t os);
int hs_silu_gate_f32(int act_dtype, int64_t T, int64_t D, const float* y, int64_t ys, const void* gate, int64_t gs,
                     void* out, int64_t os);
int hs_add(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, float scale,
           void* out, int64_t os);
int hs_silu_or_sigmoid_mul(int act_dtype, int act, int64_t T, int64_t D, const void* x, int64_t xs, const void* b,
                           int64_t bs, void* out, int64_t os);
int hs_norm_then_gate(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, const void* w, float eps,
                      const void* z, int64_t zs, void* out, int64_t os);
int hs_row_sigmoid_gate(int act_dtype, int64_t T, int64_t D, const void* g, int64_t gs, const void* x, int64_t xs,
                        void* out, int64_t os);
int hs_mul(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out,
           int64_t os);
int hs_scale(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, float scale, const void* cols, void* out,
             int64_t os);
int hs_gelu_mul(int act_dtype, int64_t T, int64_t D, const void* a, int64_t as, const void* b, int64_t bs, void* out,
                int64_t os);
int hs_concat_cols(int dtype, int64_t T, int64_t Da, const void* a, int64_t as, int64_t Db, const void* b, int64_t bs,
                   void* out, int64_t os);
int hs_relu2(int act_dtype, int64_t T, int64_t D, const void* x, int64_t xs, void* out, int64_t os);
int hs_rotary(int act_dtype, int64_t T, int64_t H, int64_t Dh, int64_t R, void* x, int64_t xs, const void* cos,
              const void* sin, int64_t cs);
int hs_gather_rows(int dtype, int64_t T, const int64_t* ids, const void* table, int64_t table_stride, int64_t num_rows,
                   int64_t D, float scale, void* out, int64_t os);
int hs_argmax_logsumexp(int dtype, int64_t N, int64_t V, const void* x, int64_t xs, int64_t* idx, float* lse,
                        float* mx);

// ---- attention.cpp: paged KV cache
int hs_kv_write(int act_dtype, int cache_dtype, int64_t T, const int64_t* slot_mapping, const void* k,
                int64_t k_stride, const void* v, int64_t v_stride, void* k_cache, void* v_cache, int64_t block_size,
                int64_t block_stride, int64_t token_stride, int64_t head_stride, int64_t Hkv, int64_t Dh,
                float k_scale, float v_scale);
int hs_paged_attention(int act_dtype, int cache_dtype, int64_t num_seqs, const int64_t* cu_q,
                       const int64_t* seq_lens, const int64_t* block_tables, int64_t bt_stride, const void* q,
                       int64_t q_stride, const void* k_cache, const void* v_cache, int64_t block_size,
                       int64_t block_stride, int64_t token_stride, int64_t head_stride, void* out, int64_t out_stride,
                       int64_t Hq, int64_t Hkv, int64_t Dh, float scale, float k_scale, float v_scale,
                       int64_t sliding_window);

// ---- recurrent.cpp: state-space layers over pooled state slots
int hs_causal_conv1d(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                     const int64_t* slots, const void* x, int64_t x_stride, void* states, int64_t slot_stride,
                     const float* weight_t, const float* bias, int act_silu, void* out, int64_t out_stride,
                     int64_t D, int64_t K);
int hs_causal_conv1d_coded(int act_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                           const void* x, int64_t x_stride, void* codes, int64_t code_slot_stride, void* exponents,
                           int64_t exponent_slot_stride, const float* weight_t, const float* bias, int act_silu,
                           void* out, int64_t out_stride, int64_t D, int64_t K);
int hs_mamba2_scan(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                   const int64_t* slots, const void* x, int64_t x_stride, const void* B, int64_t b_stride,
                   const void* C, int64_t c_stride, const void* dt, int64_t dt_stride, const float* A,
                   const float* D, const float* dt_bias, int dt_softplus, int dt_clamp, float dt_lo, float dt_hi,
                   void* states, int64_t slot_stride, float* y, int64_t y_stride, int64_t H, int64_t P,
                   int64_t G, int64_t N);

int hs_mamba1_scan(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                   const void* x, int64_t xs, const void* dt, int64_t dts, const float* A, const void* B, int64_t bs,
                   const void* C, int64_t cs, const float* D, const void* z, int64_t zs, const float* dt_bias,
                   int dt_softplus, void* states, int64_t slot_stride, void* y, int64_t ys, int64_t Dm, int64_t N);

int hs_linear_attention(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                        const int64_t* slots, const void* q, const void* k, const void* v, int64_t row_stride,
                        int64_t head_stride, const float* decay, void* states, int64_t slot_stride, void* y,
                        int64_t ys, int64_t H, int64_t Dk, int64_t Dv);

int hs_gated_delta_rule(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                        const int64_t* slots, const void* conv, int64_t cs, const void* ba, int64_t bas,
                        const float* A_log, const float* dt_bias, int l2norm, float beta_scale, void* states,
                        int64_t slot_stride, void* out, int64_t os, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);
int hs_gdn_split(int dtype, int64_t T, int64_t Hk, int64_t Dk, int64_t RDv, const void* qkvz, int64_t qs, void* mixed,
                 void* z);
int hs_mlstm(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
             const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* o,
             int64_t os, const void* ig, int64_t igs, const void* fg, int64_t fgs, float gate_cap, void* c_states,
             void* n_states, void* m_states, int64_t slot_stride, const void* norm_w, const void* norm_b,
             float norm_eps, float eps, void* out, int64_t out_stride, int64_t H, int64_t Dk, int64_t Dv);
int hs_kda(int act_dtype, int state_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
           const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* f, int64_t fs,
           const void* b, int64_t bs, const float* A_log, const float* dt_bias, int l2norm, void* states,
           int64_t slot_stride, const void* gate, int64_t gs, const float* norm_w, float norm_eps, void* out,
           int64_t os, int64_t H, int64_t Dk, int64_t Dv);

// ---- recurrent.cpp: the same over 8-bit (coded) state: codes (code_dtype 3 int8, 4 fp8 e4m3fn) and bfloat16
// row scales, each with its slot stride, the rounding keys (or null) and positions of the sequences, the layer
// index and the element offset the noise is numbered from (a tensor-parallel rank's slice; 0 otherwise), and
// whether the codes are rounded stochastically (0: to nearest)
int hs_mamba2_scan_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                         const int64_t* slots, const void* x, int64_t x_stride, const void* B, int64_t b_stride,
                         const void* C, int64_t c_stride, const void* dt, int64_t dt_stride, const float* A,
                         const float* D, const float* dt_bias, int dt_softplus, int dt_clamp, float dt_lo, float dt_hi,
                         void* codes, int64_t code_stride, uint16_t* scales, int64_t scale_stride, const int64_t* keys,
                         const int64_t* positions, int64_t layer, int64_t offset, int64_t stochastic, float* y,
                         int64_t y_stride, int64_t H, int64_t P, int64_t G, int64_t N);
int hs_mamba1_scan_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                         const int64_t* slots, const void* x, int64_t xs, const void* dt, int64_t dts, const float* A,
                         const void* B, int64_t bs, const void* C, int64_t cs, const float* D, const void* z,
                         int64_t zs, const float* dt_bias, int dt_softplus, void* codes, int64_t code_stride,
                         uint16_t* scales, int64_t scale_stride, const int64_t* keys, const int64_t* positions,
                         int64_t layer, int64_t offset, int64_t stochastic, void* y, int64_t ys, int64_t Dm,
                         int64_t N);
int hs_linear_attention_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                              const int64_t* slots, const void* q, const void* k, const void* v, int64_t row_stride,
                              int64_t head_stride, const float* decay, void* codes, int64_t code_stride, uint16_t* scales,
                              int64_t scale_stride, const int64_t* keys, const int64_t* positions, int64_t layer,
                              int64_t offset, int64_t stochastic, void* y, int64_t ys, int64_t H, int64_t Dk,
                              int64_t Dv);
int hs_gated_delta_rule_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens,
                              const int64_t* slots, const void* conv, int64_t cs, const void* ba, int64_t bas,
                              const float* A_log, const float* dt_bias, int l2norm, float beta_scale, void* codes,
                              int64_t code_stride, uint16_t* scales, int64_t scale_stride, const int64_t* keys,
                              const int64_t* positions, int64_t layer, int64_t offset, int64_t stochastic, void* out,
                              int64_t os, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);
int hs_kda_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                 const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* f,
                 int64_t fs, const void* b, int64_t bs, const float* A_log, const float* dt_bias, int l2norm,
                 void* codes, int64_t code_stride, uint16_t* scales, int64_t scale_stride, const int64_t* keys,
                 const int64_t* positions, int64_t layer, int64_t offset, int64_t stochastic, const void* gate,
                 int64_t gs, const float* norm_w, float norm_eps, void* out, int64_t os, int64_t H, int64_t Dk,
                 int64_t Dv);
int hs_mlstm_coded(int act_dtype, int code_dtype, int64_t num_seqs, const int64_t* cu_seqlens, const int64_t* slots,
                   const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* o,
                   int64_t os, const void* ig, int64_t igs, const void* fg, int64_t fgs, float gate_cap,
                   void* c_codes, int64_t c_code_stride, uint16_t* c_scales, int64_t c_scale_stride, void* n_codes,
                   int64_t n_code_stride, uint16_t* n_scales, int64_t n_scale_stride, const int64_t* keys,
                   const int64_t* positions, int64_t layer, int64_t c_offset, int64_t n_offset, int64_t stochastic,
                   int m_dtype, void* m_states, int64_t m_stride,
                   const void* norm_w, const void* norm_b, float norm_eps, float eps, void* out, int64_t out_stride,
                   int64_t H, int64_t Dk, int64_t Dv);

// ---- gemm.cpp: 16-bit (and float32) linears over packed weights
int hs_gemm_supported();
int hs_gemm_amx_rows();
int hs_pack_bf16(int64_t N, int64_t K, const uint16_t* w, int64_t ws, uint16_t* out);
int hs_pack_f16(int64_t N, int64_t K, const _Float16* w, int64_t ws, _Float16* out);
int hs_linear_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t xs, const uint16_t* packed,
                   const uint16_t* bias, uint16_t* out, int64_t os);
int hs_linear_f16(int64_t M, int64_t N, int64_t K, const _Float16* x, int64_t xs, const _Float16* packed,
                  const _Float16* bias, _Float16* out, int64_t os);
int hs_pack_f32(int64_t N, int64_t K, const float* w, int64_t ws, float* out);
int hs_linear_f32_packed(int64_t M, int64_t N, int64_t K, const float* x, int64_t xs, const float* packed,
                         const float* bias, float* out, int64_t os);

// ---- gemm.cpp (gemm_w8.h): linears over 8-bit weights (int8, fp8 e4m3) with float32 scales
int hs_pack_w8(int64_t N, int64_t K, int64_t group, const uint8_t* q, int64_t qs, const float* scales,
               uint8_t* out);
int hs_linear_w8(int act_dtype, int wfmt, int64_t M, int64_t N, int64_t K, int64_t group, const void* x, int64_t xs,
                 const uint8_t* packed, const void* bias, void* out, int64_t os);

// ---- gemm.cpp (gemm_w4.h): linears over 4-bit group-wise weights (format: bit 0 mins, bit 1 uint8 sub-scales
// times a float16 per super-block; otherwise float16 scales and mins)
int hs_w4_path(int act_dtype, int64_t rows);
int hs_linear_w4(int act_dtype, int64_t M, int64_t N, int64_t K, int64_t group, int format, const void* x,
                 int64_t xs, const uint8_t* packed, const void* bias, void* out, int64_t os);

// ---- gemm.cpp (gemm_w6k.h): linears over GGUF Q6_K weights (6-bit codes, int8 sub-scales, float16 d)
int hs_w6k_path(int act_dtype, int64_t rows);
int hs_linear_w6k(int act_dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t xs, const uint8_t* packed,
                  const void* bias, void* out, int64_t os);

// ---- gemm.cpp (gemm_w8a8.h): int8 weights (a scale per output channel) times int8 activations (a scale per row)
int hs_w8a8_sums();
int hs_linear_w8a8(int act_dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t xs, const uint8_t* packed,
                   const void* bias, void* out, int64_t os);

// ---- graph.cpp: replay of a captured list of kernel calls
int hs_graph_run(const int64_t* ops, int64_t num_ops, const int64_t* args, int64_t* failed_op, int64_t* nanoseconds);

// ---- gemm.cpp: mixture-of-experts blocks over packed expert weights
int hs_moe_experts(int dtype, int weight_dtype, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const void* x,
                   int64_t xs, const int64_t* index, const void* weight, const int64_t* up, const int64_t* down,
                   int gated, int act, int wfmt, int64_t group, const void* shared, int64_t ss, void* out,
                   int64_t os);
int hs_linear_f32(int x_dtype, int out_dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t xs,
                  const float* w, void* out, int64_t os);
int hs_router_grouped_sigmoid(int64_t T, int64_t E, int64_t k, const float* logits, int64_t ls, const float* bias,
                              int64_t n_group, int64_t topk_group, int normalize, float scale, float eps,
                              int64_t* index, float* weight);
int hs_router_topk(int logits_dtype, int weight_dtype, int64_t T, int64_t E, int64_t k, const void* logits, int64_t ls,
                   int mode, int normalize, int64_t* index, void* weight);

}  // extern "C"
