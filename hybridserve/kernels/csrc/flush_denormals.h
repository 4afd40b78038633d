// Subnormal floats flushed to zero for the extent of a scope, on the calling thread.
//
// The recurrences multiply their state by a decay exp(dt * A) every token. For a strongly decaying head
// (A = -64, dt ~ 1.5: dt * A in [-103, -87]) that decay is a subnormal float, and on x86 every multiply
// by it takes a microcode assist of ~100 cycles: a 512-token Mamba2 prefill ran 3-5x slower than the
// same call with ordinary decays. With FTZ and DAZ set in MXCSR, subnormal operands read as zero and
// subnormal results are written as zero (an error below 1.2e-38 per value), at full speed.
//
// A kernel puts one FlushDenormals at the top of its OpenMP parallel region, so every thread that
// runs its loops has the mode, and each thread's previous mode comes back when the region ends (the
// threads go on to run torch's operators, which keep IEEE subnormals). Elsewhere than x86 it does
// nothing.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>

class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000;      // MXCSR.FTZ: subnormal results become zero
  static constexpr unsigned kDenormalsAreZero = 0x0040; // MXCSR.DAZ: subnormal operands read as zero
  unsigned saved_;
};
#else
class FlushDenormals {
 public:
  FlushDenormals() = default;
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};
#endif
