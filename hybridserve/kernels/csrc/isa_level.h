// The ISA level (kernels/isa.py: LEVELS) this library was compiled for, read from the compiler's own
// feature macros, so that the loader can check that the flags it asked for are the ones in effect.
#pragma once

extern "C" int hs_built_isa_level() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return 4;  // amx
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return 3;  // avx512_bf16
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  return 2;  // avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return 1;  // avx2
#else
  return 0;  // generic
#endif
}
