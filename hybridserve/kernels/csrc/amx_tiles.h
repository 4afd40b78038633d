// What every AMX tile kernel shares (gemm_amx.h, gemm_w8a8.h, mamba2_chunked_amx.h): the palette-1 tile
// configuration, a scope that loads it on a thread and releases the tiles after, and the split of a call's
// column blocks between the threads of a parallel region.
//
// Every tile these kernels use is 16 rows x 64 bytes (16 x 16 float32 or int32 sums, 16 rows of 32 bf16 or
// 64 int8 for A, 16 k-pairs or k-quads of 16 columns for B), so one configuration serves them all; a kernel
// names how many tiles it uses.
#pragma once

#include <immintrin.h>

#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

// Palette 1 with tiles 0 .. tiles - 1 of 16 rows x 64 bytes (the others unconfigured).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit AmxTileConfig(int tiles) {
    for (int t = 0; t < tiles && t < 16; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Loads a configuration on this thread for the scope's life and releases the tiles at its end.
class AmxTileScope {
 public:
  explicit AmxTileScope(const AmxTileConfig& config) { _tile_loadconfig(&config); }
  ~AmxTileScope() { _tile_release(); }
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};

// The contiguous share [begin, end) of `count` items (column blocks) that the calling thread of the enclosing
// OpenMP parallel region owns: the items split evenly, in thread order (all of them outside a region).
struct ThreadShare {
  int64_t begin, end;
};
inline ThreadShare thread_share(int64_t count) {
  int threads = 1, me = 0;
#ifdef _OPENMP
  threads = omp_get_num_threads();
  me = omp_get_thread_num();
#endif
  return ThreadShare{count * me / threads, count * (me + 1) / threads};
}

// The C tiles of a block of MT 16-row groups (1 or 2) by NP 16-column panels (1 or 2): tmm0 (rows 0-15, panel
// 0), tmm1 (rows 0-15, panel 1), tmm2 (rows 16-31, panel 0), tmm3 (rows 16-31, panel 1). Zeroed before the
// k-steps, then stored to c, a 32 x 32 array of 4-byte sums (float32 or int32; rows 128 bytes apart).
template <int MT, int NP>
inline void amx_zero_sums() {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (MT > 1) {
    _tile_zero(2);
    if constexpr (NP > 1) _tile_zero(3);
  }
}
template <int MT, int NP>
inline void amx_store_sums(void* c) {
  char* base = static_cast<char*>(c);
  _tile_stored(0, base, 128);
  if constexpr (NP > 1) _tile_stored(1, base + 64, 128);
  if constexpr (MT > 1) {
    _tile_stored(2, base + 16 * 128, 128);
    if constexpr (NP > 1) _tile_stored(3, base + 16 * 128 + 64, 128);
  }
}
