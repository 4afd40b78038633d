// 16-float vectors (GCC vector extensions: AVX-512 registers where the CPU has them, pairs or
// quads of narrower ones elsewhere) and loads that convert each storage dtype to them.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace {

typedef float v16f __attribute__((vector_size(64), aligned(4)));        // no alignment assumed
typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef _Float16 v16h __attribute__((vector_size(32), aligned(2)));

inline v16f load16(const float* p) { return *reinterpret_cast<const v16f*>(p); }
inline v16f load16(const _Float16* p) { return __builtin_convertvector(*reinterpret_cast<const v16h*>(p), v16f); }
inline v16f load16(const BF16* p) {
  const v16u32 bits = __builtin_convertvector(*reinterpret_cast<const v16u16*>(p), v16u32) << 16;
  return reinterpret_cast<const v16f&>(bits);
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline float hsum(v16f v) {  // pairwise: 16 -> 8 -> 4 -> 1
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

}  // namespace
