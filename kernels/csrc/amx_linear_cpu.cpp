// A bfloat16 linear for decode batches (5 to kAmxMaxRows rows) on AMX: y = x w^T (+ b).
//
// At these row counts the linear still only streams its weight once; the arithmetic is
// small next to AMX's. oneDNN's AMX matmul takes about as long at 16 rows as at 64 (about
// 22 ms for SmolLM2's 120 layer weights on this project's 2-core Sapphire Rapids VM, 9-10
// GB/s), well below what the memory gives. Here the weight is read as it lies, row-major:
// a tile of 16 weight rows by 32 inputs is AMX's A operand as it stands, and x, repacked
// once per call into bfloat16 pairs (16 rows of x to a tile), is the B operand. Each task
// is a strip of 32 weight rows (contiguous in memory) and prefetches the next strip while
// it multiplies this one; each C tile holds 16 outputs of 16 rows of x in float32, rounded
// to bfloat16 once. The last N % 32 weight rows go to the AVX512-BF16 stripe kernel.
#include <ATen/ATen.h>
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include "amx.h"

static constexpr int64_t kAmxMaxRows = 32;

// A C tile to y: c[i][j] is output n0 + i of x's row m0 + j. Column j is gathered, the bias
// added, rounded to bfloat16 (nearest even) and stored as 16 consecutive outputs.
static inline void store_tile(const float* c, const uint16_t* b, uint16_t* y, int64_t N,
                              int64_t n0, int64_t m0, int64_t M) {
  const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                        208, 224, 240);
  const __m512 bias = b == nullptr ? _mm512_setzero_ps()
                                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n0))), 16));
  for (int64_t j = 0; j < 16 && m0 + j < M; ++j) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(col, c + j, 4), bias);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + j) * N + n0),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// One strip of 32 weight rows from n0 against groups g0 and (when two) g0 + 1 of x.
template <int NG>
static inline void strip_times_groups(const uint16_t* w, const uint32_t* xp, const uint16_t* b,
                                      uint16_t* y, int64_t K, int64_t N, int64_t M, int64_t n0,
                                      int64_t g0, const char* next, int64_t next_bytes) {
  const int64_t chunks = K / 32, stride = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NG == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint32_t* x0 = xp + g0 * chunks * 256;
  // The next strip, one share per chunk, into L2 (it may be larger than L1).
  const int64_t share = next == nullptr ? 0 : (next_bytes / chunks + 63) / 64 * 64;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t off = c * share; off < (c + 1) * share && off < next_bytes; off += 64)
      _mm_prefetch(next + off, _MM_HINT_T1);
    _tile_loadd(4, w + n0 * K + c * 32, stride);
    _tile_loadd(5, w + (n0 + 16) * K + c * 32, stride);
    _tile_loadd(6, x0 + c * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (NG == 2) {
      _tile_loadd(7, x0 + (chunks + c) * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float cbuf[256];
  _tile_stored(0, cbuf, 64);
  store_tile(cbuf, b, y, N, n0, g0 * 16, M);
  _tile_stored(1, cbuf, 64);
  store_tile(cbuf, b, y, N, n0 + 16, g0 * 16, M);
  if constexpr (NG == 2) {
    _tile_stored(2, cbuf, 64);
    store_tile(cbuf, b, y, N, n0, (g0 + 1) * 16, M);
    _tile_stored(3, cbuf, 64);
    store_tile(cbuf, b, y, N, n0 + 16, (g0 + 1) * 16, M);
  }
}

bool amx_linear_supported() { return amx_permitted(); }
int64_t amx_linear_max_rows() { return amx_permitted() ? kAmxMaxRows : 0; }

// y [M, N] for the first N - N % 32 weight rows; the caller does the rest. x, w, b, y are
// bfloat16 bits, contiguous, K a multiple of 32, 1 <= M <= kAmxMaxRows.
void amx_linear(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t M,
                int64_t K, int64_t N) {
  std::vector<uint32_t> xp;
  pack_words(x, M, K / 2, xp);
  const int64_t strips = N / 32, groups = (M + 15) / 16, strip_bytes = 32 * K * 2;
  const TileConfig config = tile_config();
  // At least 4 strips to a task: at::parallel_for splits the range evenly between threads.
  at::parallel_for(0, strips, 4, [&](int64_t s0, int64_t s1) {
    _tile_loadconfig(&config);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t n0 = s * 32;
      const char* next = s + 1 < s1 ? reinterpret_cast<const char*>(w + (n0 + 32) * K) : nullptr;
      for (int64_t g = 0; g < groups; g += 2) {
        const char* ahead = g == 0 ? next : nullptr;  // the strip streams in once
        if (groups - g >= 2)
          strip_times_groups<2>(w, xp.data(), b, y, K, N, M, n0, g, ahead, strip_bytes);
        else
          strip_times_groups<1>(w, xp.data(), b, y, K, N, M, n0, g, ahead, strip_bytes);
      }
    }
    _tile_release();  // oneDNN configures its own tiles on each call
  });
}

#else

bool amx_linear_supported() { return false; }
int64_t amx_linear_max_rows() { return 0; }
void amx_linear(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                int64_t) {
  TORCH_CHECK(false, "amx_linear needs AMX-BF16 (and Linux)");
}

#endif
