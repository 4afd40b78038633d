// Vectorizable float32 math shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

// exp(x) without a libm call, so that loops over it vectorize: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p the degree-6 Taylor polynomial (relative error < 2e-7). Inputs are clamped to
// [-87.3, 88.7]: below, the result is ~1e-38 instead of a subnormal or 0.
inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float silu(float x) { return x / (1.0f + exp_f32(-x)); }

}  // namespace
