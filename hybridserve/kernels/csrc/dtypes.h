// Storage dtypes shared by the CPU kernels: codes passed from Python, and float32 conversions.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct BF16 {
  uint16_t bits;
};

inline float to_f32(float v) { return v; }
inline float to_f32(_Float16 v) { return static_cast<float>(v); }
inline float to_f32(BF16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T> inline T from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline _Float16 from_f32<_Float16>(float v) { return static_cast<_Float16>(v); }
template <> inline BF16 from_f32<BF16>(float v) {
  // Round to nearest even, NaN -> canonical quiet NaN (as torch's c10::BFloat16).
  // Branch-free, so that loops storing bf16 vectorize.
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return BF16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded)};
}

// Calls fn(T{}) with T the storage type of a dtype code; returns 0, or 2 for an unknown code.
template <typename Fn>
int dispatch_dtype(int code, Fn&& fn) {
  switch (code) {
    case kF32: fn(float{}); return 0;
    case kBF16: fn(BF16{}); return 0;
    case kF16: fn(_Float16{}); return 0;
    default: return 2;
  }
}

// Calls fn(A{}, B{}) with A, B the storage types of two dtype codes (activations, and a state or
// cache); returns 0, or 2 when either code is unknown.
template <typename Fn>
int dispatch_dtype_pair(int code_a, int code_b, Fn&& fn) {
  int rc = 2;
  dispatch_dtype(code_a, [&](auto a) { rc = dispatch_dtype(code_b, [&](auto b) { fn(a, b); }); });
  return rc;
}

}  // namespace
