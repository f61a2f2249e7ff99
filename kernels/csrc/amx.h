// What the AMX kernels share (amx_linear_cpu.cpp, amx_int8_cpu.cpp): the permission to use
// AMX, one tile configuration, and x repacked as B tiles. Include only under __AMX_TILE__.
#pragma once
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

// x [M rows of `words` 32-bit words] as B tiles: for each group of 16 rows and each chunk
// of 16 words, 16 lines of 64 bytes, line p holding word 16c + p of each of the 16 rows in
// turn; rows past M are zero. A word is a pair of bfloat16 inputs, or four int8 ones.
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
