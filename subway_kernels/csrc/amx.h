// What the AMX kernels share (amx_linear_cpu.cpp, amx_int8_cpu.cpp): the permission to use
// AMX, one tile configuration, rows repacked as B tiles, and one block of tile products.
// Include only under __AMX_TILE__.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstring>
#include <vector>

// Linux hands out AMX's 8 KB of tile state only to a process that asks for it.
static inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows by 64 bytes: C0..C3 accumulators, A4 and A5 two weight tiles,
// B6 and B7 two tiles of x.
static inline TileConfig tile_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

// M rows of `words` 32-bit words (x for amx_linear, the int8 weight for amx_int8_pack) as
// B tiles: for each group of 16 rows and each chunk of 16 words, 16 lines of 64 bytes, line
// p holding word 16c + p of each of the 16 rows in turn; rows past M are zero. A word is a
// pair of bfloat16 inputs, or four int8 ones.
static inline void pack_words(const void* x, int64_t M, int64_t words, std::vector<uint32_t>& out) {
  const int64_t chunks = words / 16, groups = (M + 15) / 16;
  out.assign(groups * chunks * 256, 0);
  const char* base = static_cast<const char*>(x);
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* g = out.data() + (m / 16) * chunks * 256 + (m % 16);
    const char* row = base + m * words * 4;
    for (int64_t p = 0; p < words; ++p) {
      uint32_t v;
      std::memcpy(&v, row + 4 * p, sizeof(v));
      g[(p / 16) * 256 + (p % 16) * 16] = v;
    }
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_INT8__)
// C += A B for tiles numbered c, a, b (literals: GCC's tile intrinsics paste them into
// assembly): int8 (int32 sums) or bfloat16 pairs (float32 sums).
#define SUBWAY_TILE_DP(kInt8, c, a, b) \
  do {                                  \
    if constexpr (kInt8)                \
      _tile_dpbssd(c, a, b);            \
    else                                \
      _tile_dpbf16ps(c, a, b);          \
  } while (0)

// One block of C tiles over `chunks` chunks of 64 bytes of the inputs: A tiles (16 rows, 64
// bytes each, `a_stride` apart) from a0 and, for NA == 2, a1; B tiles (16 lines of 64
// bytes, 256 words a chunk) from b0 and, for NB == 2, b1. C tile i + 2j is A i against B j.
// A chunk is 32 bfloat16 inputs or 64 int8 ones. `next` (not null): bytes to prefetch into
// L2, one share per chunk (they may be more than L1 holds). `store(c, i, j)` gets each C
// tile in memory, float32 or int32 sums.
template <int NA, int NB, bool kInt8, typename Store>
static inline void amx_block(const char* a0, const char* a1, int64_t a_stride, const uint32_t* b0,
                             const uint32_t* b1, int64_t chunks, const char* next,
                             int64_t next_bytes, Store&& store) {
  _tile_zero(0);
  if constexpr (NA == 2) _tile_zero(1);
  if constexpr (NB == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  const int64_t share = next == nullptr ? 0 : (next_bytes / chunks + 63) / 64 * 64;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t off = c * share; off < (c + 1) * share && off < next_bytes; off += 64)
      _mm_prefetch(next + off, _MM_HINT_T1);
    _tile_loadd(4, a0 + c * 64, a_stride);
    _tile_loadd(6, b0 + c * 256, 64);
    SUBWAY_TILE_DP(kInt8, 0, 4, 6);
    if constexpr (NA == 2) {
      _tile_loadd(5, a1 + c * 64, a_stride);
      SUBWAY_TILE_DP(kInt8, 1, 5, 6);
    }
    if constexpr (NB == 2) {
      _tile_loadd(7, b1 + c * 256, 64);
      SUBWAY_TILE_DP(kInt8, 2, 4, 7);
      if constexpr (NA == 2) SUBWAY_TILE_DP(kInt8, 3, 5, 7);
    }
  }
  alignas(64) uint32_t cbuf[256];
  _tile_stored(0, cbuf, 64);
  store(cbuf, 0, 0);
  if constexpr (NA == 2) {
    _tile_stored(1, cbuf, 64);
    store(cbuf, 1, 0);
  }
  if constexpr (NB == 2) {
    _tile_stored(2, cbuf, 64);
    store(cbuf, 0, 1);
  }
  if constexpr (NA == 2 && NB == 2) {
    _tile_stored(3, cbuf, 64);
    store(cbuf, 1, 1);
  }
}

// Every whole strip of 32 rows of the bfloat16 weight `w` (N rows, `row_bytes` each) as A
// tiles against x's B tiles `xp` (`groups` groups of 16 rows), at least 4 strips to a
// thread (at::parallel_for splits the range evenly). Each thread configures its tiles and
// releases them at the end; oneDNN configures its own on each call. `store_tile(c, n0,
// m0)`: the C tile of outputs n0.. of x's rows m0...
template <typename StoreTile>
static inline void amx_strips(const char* w, int64_t row_bytes, int64_t N,
                              const std::vector<uint32_t>& xp, int64_t groups,
                              StoreTile&& store_tile) {
  const int64_t strips = N / 32, chunks = row_bytes / 64, strip_bytes = 32 * row_bytes;
  const TileConfig config = tile_config();
  at::parallel_for(0, strips, 4, [&](int64_t s0, int64_t s1) {
    _tile_loadconfig(&config);
    for (int64_t s = s0; s < s1; ++s) {
      const char* strip = w + s * strip_bytes;
      const char* next = s + 1 < s1 ? strip + strip_bytes : nullptr;
      for (int64_t g = 0; g < groups; g += 2) {
        const char* ahead = g == 0 ? next : nullptr;  // the strip streams in once
        const uint32_t* xg = xp.data() + g * chunks * 256;
        const uint32_t* xg1 = xg + chunks * 256;
        auto store = [&](const uint32_t* c, int64_t half, int64_t group) {
          store_tile(c, s * 32 + 16 * half, (g + group) * 16);
        };
        if (groups - g >= 2)
          amx_block<2, 2, false>(strip, strip + 16 * row_bytes, row_bytes, xg, xg1, chunks, ahead,
                                 strip_bytes, store);
        else
          amx_block<2, 1, false>(strip, strip + 16 * row_bytes, row_bytes, xg, nullptr, chunks,
                                 ahead, strip_bytes, store);
      }
    }
    _tile_release();
  });
}
#endif
