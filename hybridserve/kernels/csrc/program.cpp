// A decode step as one call: runs a fixed list of kernel calls (a "program"), built once per engine
// in Python (hybridserve/kernels/program.py), with only the per-step values filled in per call.
//
// Without it, each decode step goes through the model's Python modules and one Python wrapper per
// kernel call: at 32 sequences on the benchmark model that is several milliseconds a step of
// attribute checks, views and allocations around kernels that run for microseconds. The program
// calls the same kernels (through their addresses, taken from the loaded libraries) with the same
// arguments, into workspace buffers allocated once, so its results are bit-identical to the module
// path.
//
// Encoding, all int64: per op [op code, number of arguments, then (kind, value) per argument].
// kind 0: the value itself (an integer or an address); kind 1: a float, the value holding the bits
// of a double; kind 2: the value is an index into the per-step array (StepField), whose entry is used.

#include <chrono>
#include <cstdint>
#include <cstring>

#include "dtypes.h"

namespace {

// Per-step values, filled by the caller for each run.
enum StepField : int64_t {
  kRows = 0,         // tokens this step = decode sequences
  kInputIds,         // (rows,) int64
  kCuSeqlens,        // (rows + 1,) int64: 0, 1, ..., rows
  kStateIndices,     // (rows,) int64 state slots, or 0 without state
  kSeqLens,          // (rows,) int64 context lengths after this step, or 0 without attention
  kBlockTables,      // (rows, width) int64, or 0 without attention
  kBlockTableStride, // width
  kSlotMapping,      // (rows,) int64 KV write slots, or 0 without attention
  kRopeCos,          // (rows, R) rotary cos in the activation dtype, or 0 without RoPE
  kRopeSin,          // (rows, R) rotary sin, or 0
  kNumStepFields,
};

// The kernels, in the order of the address table passed in (KERNELS in program.py).
enum Kernel : int64_t {
  kRmsNorm = 0, kLinear, kConv, kScan, kGatedNorm, kSiluMul, kKvWrite, kAttention, kRotary, kNumKernels
};

enum Op : int64_t { kOpEmbed = 1, kOpCall = 2 };

using RmsNormFn = int (*)(int, int64_t, int64_t, const void*, int64_t, const void*, int64_t, float, void*, int64_t,
                          const void*, float, int, void*, int64_t);
using LinearFn = int (*)(int64_t, int64_t, int64_t, const void*, int64_t, const void*, const void*, void*, int64_t);
using ConvFn = int (*)(int, int, int64_t, const void*, const void*, const void*, int64_t, void*, int64_t, const void*,
                       const void*, int, void*, int64_t, int64_t, int64_t);
using ScanFn = int (*)(int, int, int64_t, const void*, const void*, const void*, int64_t, const void*, int64_t,
                       const void*, int64_t, const void*, int64_t, const void*, const void*, const void*, int, int,
                       float, float, void*, int64_t, void*, int64_t, int64_t, int64_t, int64_t, int64_t);
using GatedNormFn = int (*)(int, int64_t, int64_t, const void*, int64_t, const void*, int64_t, const void*, int64_t,
                            float, int, void*, int64_t);
using RotaryFn = int (*)(int, int64_t, int64_t, int64_t, int64_t, void*, int64_t, const void*, const void*, int64_t);
using SiluMulFn = int (*)(int, int64_t, int64_t, const void*, int64_t, const void*, int64_t, void*, int64_t);
using KvWriteFn = int (*)(int, int, int64_t, const void*, const void*, int64_t, const void*, int64_t, void*, void*,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float);
using AttentionFn = int (*)(int, int, int64_t, const void*, const void*, const void*, int64_t, const void*, int64_t,
                            const void*, const void*, int64_t, int64_t, int64_t, int64_t, void*, int64_t, int64_t,
                            int64_t, int64_t, float, float, float, int64_t);

// Reads one op's arguments in order, resolving step references.
class Args {
 public:
  Args(const int64_t* p, const int64_t* step) : p_(p), step_(step) {}
  int64_t i() {
    const int64_t kind = p_[0], value = p_[1];
    p_ += 2;
    return kind == 2 ? step_[value] : value;
  }
  int n() { return static_cast<int>(i()); }
  const void* ptr() { return reinterpret_cast<const void*>(i()); }
  void* mut() { return reinterpret_cast<void*>(i()); }
  float f() {
    const int64_t bits = p_[1];
    p_ += 2;
    double d;
    std::memcpy(&d, &bits, sizeof d);
    return static_cast<float>(d);
  }

 private:
  const int64_t* p_;
  const int64_t* step_;
};

// Token embeddings: out row t = table row ids[t], times scale when scale != 1 (rounded to the dtype
// as ``embedding * scale`` is in PyTorch: the product in float32, then rounded). Returns 1 for an id
// outside [0, vocab).
int embed(Args a) {
  const int dtype = a.n();
  const auto* table = static_cast<const char*>(a.ptr());
  const int64_t table_stride = a.i(), vocab = a.i(), D = a.i();
  auto* out = static_cast<char*>(a.mut());
  const int64_t out_stride = a.i(), rows = a.i();
  const auto* ids = static_cast<const int64_t*>(a.ptr());
  const float scale = a.f();
  for (int64_t t = 0; t < rows; ++t)
    if (ids[t] < 0 || ids[t] >= vocab) return 1;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < rows; ++t) {
      const T* src = reinterpret_cast<const T*>(table) + ids[t] * table_stride;
      T* dst = reinterpret_cast<T*>(out) + t * out_stride;
      if (scale == 1.0f) {
        std::memcpy(dst, src, D * sizeof(T));
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f32<T>(to_f32(src[d]) * scale);
      }
    }
  });
}

int call(int64_t kernel, const void* fn, Args a) {
  switch (kernel) {
    case kRmsNorm: {
      const int act = a.n();
      const int64_t T = a.i(), D = a.i();
      const void* x = a.ptr();
      const int64_t xs = a.i();
      const void* h = a.ptr();
      const int64_t hs = a.i();
      const float scale = a.f();
      void* x_out = a.mut();
      const int64_t xos = a.i();
      const void* w = a.ptr();
      const float eps = a.f();
      const int zc = a.n();
      void* out = a.mut();
      const int64_t os = a.i();
      return reinterpret_cast<RmsNormFn>(fn)(act, T, D, x, xs, h, hs, scale, x_out, xos, w, eps, zc, out, os);
    }
    case kLinear: {
      const int64_t M = a.i(), N = a.i(), K = a.i();
      const void* x = a.ptr();
      const int64_t xs = a.i();
      const void* packed = a.ptr();
      const void* bias = a.ptr();
      void* out = a.mut();
      const int64_t os = a.i();
      return reinterpret_cast<LinearFn>(fn)(M, N, K, x, xs, packed, bias, out, os);
    }
    case kConv: {
      const int act = a.n(), st = a.n();
      const int64_t S = a.i();
      const void* cu = a.ptr();
      const void* slots = a.ptr();
      const void* x = a.ptr();
      const int64_t xs = a.i();
      void* states = a.mut();
      const int64_t ss = a.i();
      const void* w = a.ptr();
      const void* bias = a.ptr();
      const int silu = a.n();
      void* out = a.mut();
      const int64_t os = a.i(), D = a.i(), K = a.i();
      return reinterpret_cast<ConvFn>(fn)(act, st, S, cu, slots, x, xs, states, ss, w, bias, silu, out, os, D, K);
    }
    case kScan: {
      const int act = a.n(), st = a.n();
      const int64_t S = a.i();
      const void* cu = a.ptr();
      const void* slots = a.ptr();
      const void* x = a.ptr();
      const int64_t xs = a.i();
      const void* B = a.ptr();
      const int64_t bs = a.i();
      const void* C = a.ptr();
      const int64_t cs = a.i();
      const void* dt = a.ptr();
      const int64_t dts = a.i();
      const void* A = a.ptr();
      const void* D = a.ptr();
      const void* dt_bias = a.ptr();
      const int softplus = a.n(), clamp = a.n();
      const float lo = a.f(), hi = a.f();
      void* states = a.mut();
      const int64_t ss = a.i();
      void* y = a.mut();
      const int64_t ys = a.i(), H = a.i(), P = a.i(), G = a.i(), N = a.i();
      return reinterpret_cast<ScanFn>(fn)(act, st, S, cu, slots, x, xs, B, bs, C, cs, dt, dts, A, D, dt_bias, softplus,
                                          clamp, lo, hi, states, ss, y, ys, H, P, G, N);
    }
    case kGatedNorm: {
      const int act = a.n();
      const int64_t T = a.i(), D = a.i();
      const void* y = a.ptr();
      const int64_t ys = a.i();
      const void* gate = a.ptr();
      const int64_t gs = a.i();
      const void* w = a.ptr();
      const int64_t G = a.i();
      const float eps = a.f();
      const int in_f32 = a.n();
      void* out = a.mut();
      const int64_t os = a.i();
      return reinterpret_cast<GatedNormFn>(fn)(act, T, D, y, ys, gate, gs, w, G, eps, in_f32, out, os);
    }
    case kSiluMul: {
      const int act = a.n();
      const int64_t T = a.i(), D = a.i();
      const void* x = a.ptr();
      const int64_t xs = a.i();
      const void* b = a.ptr();
      const int64_t bs = a.i();
      void* out = a.mut();
      const int64_t os = a.i();
      return reinterpret_cast<SiluMulFn>(fn)(act, T, D, x, xs, b, bs, out, os);
    }
    case kKvWrite: {
      const int act = a.n(), ct = a.n();
      const int64_t T = a.i();
      const void* slots = a.ptr();
      const void* k = a.ptr();
      const int64_t ks = a.i();
      const void* v = a.ptr();
      const int64_t vs = a.i();
      void* kc = a.mut();
      void* vc = a.mut();
      const int64_t bsz = a.i(), bst = a.i(), tst = a.i(), hst = a.i(), Hkv = a.i(), Dh = a.i();
      const float k_scale = a.f(), v_scale = a.f();
      return reinterpret_cast<KvWriteFn>(fn)(act, ct, T, slots, k, ks, v, vs, kc, vc, bsz, bst, tst, hst, Hkv, Dh,
                                             k_scale, v_scale);
    }
    case kAttention: {
      const int act = a.n(), ct = a.n();
      const int64_t S = a.i();
      const void* cu = a.ptr();
      const void* lens = a.ptr();
      const void* tables = a.ptr();
      const int64_t bts = a.i();
      const void* q = a.ptr();
      const int64_t qs = a.i();
      const void* kc = a.ptr();
      const void* vc = a.ptr();
      const int64_t bsz = a.i(), bst = a.i(), tst = a.i(), hst = a.i();
      void* out = a.mut();
      const int64_t os = a.i(), Hq = a.i(), Hkv = a.i(), Dh = a.i();
      const float scale = a.f(), k_scale = a.f(), v_scale = a.f();
      const int64_t window = a.i();
      return reinterpret_cast<AttentionFn>(fn)(act, ct, S, cu, lens, tables, bts, q, qs, kc, vc, bsz, bst, tst, hst, out,
                                               os, Hq, Hkv, Dh, scale, k_scale, v_scale, window);
    }
    case kRotary: {
      const int act = a.n();
      const int64_t T = a.i(), H = a.i(), Dh = a.i(), R = a.i();
      void* x = a.mut();
      const int64_t xs = a.i();
      const void* cos = a.ptr();
      const void* sin = a.ptr();
      const int64_t cs = a.i();
      return reinterpret_cast<RotaryFn>(fn)(act, T, H, Dh, R, x, xs, cos, sin, cs);
    }
    default:
      return 90;
  }
}

}  // namespace

extern "C" {

int hs_program_step_fields() { return kNumStepFields; }

// Runs the program code[0:n] with the per-step values step[0:kNumStepFields] and the kernel
// addresses kernels[0:kNumKernels]. Returns 0; or the failing op's return code (>0) with its index in
// *failed_op, the ops before it having run (91: a malformed program). With `nanoseconds` non-null,
// adds each op's wall time to nanoseconds[kernel] (the embedding: nanoseconds[kNumKernels]).
int hs_program_run(const int64_t* code, int64_t n, const int64_t* step, const int64_t* kernels, int64_t* failed_op,
                   int64_t* nanoseconds) {
  int64_t pc = 0, index = 0;
  while (pc < n) {
    if (pc + 2 > n) break;
    const int64_t op = code[pc], nargs = code[pc + 1];
    if (nargs < 1 || pc + 2 + 2 * nargs > n) break;
    const int64_t* args = code + pc + 2;
    const auto start = nanoseconds != nullptr ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    int rc;
    int64_t slot = kNumKernels;
    if (op == kOpEmbed) {
      rc = embed(Args(args, step));
    } else if (op == kOpCall) {
      // the first argument names the kernel; the rest are its arguments in order
      const int64_t kernel = args[1];
      slot = kernel;
      rc = kernel >= 0 && kernel < kNumKernels ? call(kernel, reinterpret_cast<const void*>(kernels[kernel]),
                                                        Args(args + 2, step))
                                               : 91;
    } else {
      rc = 91;
    }
    if (nanoseconds != nullptr && rc == 0)
      nanoseconds[slot] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    if (rc != 0) {
      *failed_op = index;
      return rc;
    }
    pc += 2 + 2 * nargs;
    ++index;
  }
  if (pc != n) {
    *failed_op = index;
    return 91;
  }
  return 0;
}

}  // extern "C"
