// Memory probe for the benchmarks: the machine's streaming read bandwidth, measured the way a decode
// step reads its weights (every thread streams its own contiguous part once, with wide loads).

#include "isa_level.h"
#include <cstdint>

extern "C" {

// XOR of every 64-bit word of p[0, bytes) (bytes a multiple of 64), read by all OpenMP threads;
// returned so that the reads cannot be optimized away.
uint64_t hs_stream_read(const uint64_t* p, int64_t bytes) {
  const int64_t lines = bytes / 64;
  uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(^ : total)
  for (int64_t i = 0; i < lines; ++i) {
    const uint64_t* q = p + 8 * i;
    total ^= q[0] ^ q[1] ^ q[2] ^ q[3] ^ q[4] ^ q[5] ^ q[6] ^ q[7];
  }
  return total;
}

}  // extern "C"
