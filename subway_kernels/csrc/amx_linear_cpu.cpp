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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    defined(__linux__)
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

bool amx_linear_supported() { return amx_permitted(); }
int64_t amx_linear_max_rows() { return amx_permitted() ? kAmxMaxRows : 0; }

// y [M, N] for the first N - N % 32 weight rows; the caller does the rest. x, w, b, y are
// bfloat16 bits, contiguous, K a multiple of 32, 1 <= M <= kAmxMaxRows.
void amx_linear(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t M,
                int64_t K, int64_t N) {
  static thread_local std::vector<uint32_t> xp;  // reused: no allocation per call
  pack_words(x, M, K / 2, xp);
  amx_strips(reinterpret_cast<const char*>(w), K * 2, N, xp, (M + 15) / 16,
                    [&](const uint32_t* c, int64_t n0, int64_t m0) {
                      store_tile(reinterpret_cast<const float*>(c), b, y, N, n0, m0, M);
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
