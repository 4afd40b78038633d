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

#include "isa_level.h"
#include <chrono>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

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
  kRmsNorm = 0, kLinear, kConv, kScan, kGatedNorm, kSiluMul, kKvWrite, kAttention, kRotary, kLinearF16, kNumKernels
};

enum Op : int64_t { kOpEmbed = 1, kOpCall = 2 };

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
  // The next argument as a parameter of type T.
  template <typename T> T as() {
    if constexpr (std::is_same_v<T, float>) return f();
    else if constexpr (std::is_same_v<T, int>) return n();
    else if constexpr (std::is_same_v<T, int64_t>) return i();
    else if constexpr (std::is_same_v<T, void*>) return mut();
    else return ptr();
  }

 private:
  const int64_t* p_;
  const int64_t* step_;
};

// Token embeddings: out row t = table row ids[t], times scale when scale != 1 (rounded to the dtype
// as ``embedding * scale`` is in PyTorch: the product in float32, then rounded). Returns 1 for an id
// outside [0, vocab).
constexpr int64_t kEmbedArgs = 10;
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

// Calls fn, a kernel of C signature int(Ts...), with the op's `nargs` arguments read in order (a
// braced initializer evaluates them left to right). 91 when the op has another number of arguments.
template <typename... Ts>
int invoke(const void* fn, Args a, int64_t nargs) {
  if (nargs != static_cast<int64_t>(sizeof...(Ts))) return 91;
  const std::tuple<Ts...> values{a.as<Ts>()...};
  return std::apply(reinterpret_cast<int (*)(Ts...)>(fn), values);
}

// Parameter types of the C signatures (as in each kernel's extern "C" declaration).
using I = int;
using L = int64_t;
using F = float;
using P = const void*;
using W = void*;

int call(int64_t kernel, const void* fn, Args a, int64_t nargs) {
  switch (kernel) {
    case kRmsNorm: return invoke<I, L, L, P, L, P, L, F, W, L, P, F, I, W, L>(fn, a, nargs);
    case kLinear:
    case kLinearF16: return invoke<L, L, L, P, L, P, P, W, L>(fn, a, nargs);
    case kConv: return invoke<I, I, L, P, P, P, L, W, L, P, P, I, W, L, L, L>(fn, a, nargs);
    case kScan:
      return invoke<I, I, L, P, P, P, L, P, L, P, L, P, L, P, P, P, I, I, F, F, W, L, W, L, L, L, L, L>(fn, a, nargs);
    case kGatedNorm: return invoke<I, L, L, P, L, P, L, P, L, F, I, W, L>(fn, a, nargs);
    case kSiluMul: return invoke<I, L, L, P, L, P, L, W, L>(fn, a, nargs);
    case kKvWrite: return invoke<I, I, L, P, P, L, P, L, W, W, L, L, L, L, L, L, F, F>(fn, a, nargs);
    case kAttention:
      return invoke<I, I, L, P, P, P, L, P, L, P, P, L, L, L, L, W, L, L, L, L, F, F, F, L>(fn, a, nargs);
    case kRotary: return invoke<I, L, L, L, L, W, L, P, P, L>(fn, a, nargs);
    default: return 91;
  }
}

}  // namespace

extern "C" {

int hs_program_step_fields() { return kNumStepFields; }

// The number of kernels a program calls (KERNELS in kernels/program.py, in this order).
int hs_program_kernels() { return kNumKernels; }

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
      rc = nargs == kEmbedArgs ? embed(Args(args, step)) : 91;
    } else if (op == kOpCall) {
      // the first argument names the kernel; the rest are its arguments in order
      const int64_t kernel = args[1];
      slot = kernel;
      rc = kernel >= 0 && kernel < kNumKernels ? call(kernel, reinterpret_cast<const void*>(kernels[kernel]),
                                                        Args(args + 2, step), nargs - 1)
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
