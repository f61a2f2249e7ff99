// A bfloat16 linear for a few rows (decode at small batches) on AVX512-BF16, else on AVX2:
// y = x w^T (+ b).
//
// At one to four rows a linear only streams its weight once: the floor is the memory's
// bandwidth. oneDNN's packed matmul reaches about 17 GB/s there on this machine (130 us per
// SmolLM2 linear, with its per-call overhead), about 40% of what the memory gives. Here each
// task streams a stripe of weight rows once, four rows at a time, with the rows of x held in
// L1 and `_mm512_dpbf16_ps` accumulating in float32; each output is rounded to bfloat16 once.
// Sums run in another order than oneDNN's, so results may differ from F.linear's in the last
// place (the float32 sum rounded once: within one bfloat16 ulp of the exact result).
// From 5 rows on (up to 32), where the CPU has AMX, `small_linear` hands the weight's whole
// 32-row strips to amx_linear_cpu.cpp and keeps only the last N % 32 rows here.
// On AVX2 the weight is read in a layout of its own (`small_linear_pack`), described below.
#include <ATen/ATen.h>
#include <torch/types.h>  // not torch/extension.h: 2.5x faster to compile; bindings are in paged_decode_cpu.cpp
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>

#include <vector>

#include "vec_math.h"

static constexpr int64_t kStripe = 4;   // weight rows per inner pass
// Each weight line is prefetched this many bytes ahead of its load: with the hardware's
// streamer alone SmolLM2's 120 layer weights read at 11.4 GB/s (two threads, against 16.9
// for a plain sum); 12 KB ahead gave 15.4 GB/s, 4 KB 14.2 and 32 KB 14.3 (an ad-hoc sweep,
// docs/BENCHMARKS.md). On a 2-core AVX2 EPYC 12 KB also did best (`bench_gemv_prefetch`:
// 1.29x faster than none at one row, 1.34x at four; 4 KB to 32 KB all within 10% of it). A prefetch past the weight's end is only a
// hint: it cannot fault. `bench_gemv_prefetch` sweeps it (-DSUBWAY_PREFETCH_BYTES=N; 0: none).
#ifndef SUBWAY_PREFETCH_BYTES
#define SUBWAY_PREFETCH_BYTES 12288
#endif
static constexpr int64_t kPrefetchBytes = SUBWAY_PREFETCH_BYTES;

static inline uint16_t to_bf16(float f) {  // round to nearest even (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define SUBWAY_SMALL_LINEAR 1
// Rows it is used for: one to four. With its prefetch it reads SmolLM2's 120 layer weights
// in 12-14 ms at one to four rows, against oneDNN's 20-24 ms (2-core Sapphire Rapids VM);
// past four it is bound by the dot products (8 rows: 26 ms), where AMX takes over.
static constexpr int64_t kRowsUsed = 4;
// The weight stays in its natural rows (x stays bfloat16: dpbf16 takes both as they are).
torch::Tensor small_linear_pack(torch::Tensor w) { return w; }

// One stripe of `rows` (<= kStripe) weight rows from n, times the G (<= 4) rows of x at
// `x`; outputs to y (rows of N). `fetch`: this pass is the stripe's first, which streams it
// from memory, so it prefetches ahead; the later groups find it in L1.
template <int G>
static inline void group_times_stripe(const uint16_t* x, const uint16_t* w, const uint16_t* b,
                                      uint16_t* y, int64_t K, int64_t N, int64_t n, int64_t rows,
                                      bool fetch) {
  const int64_t chunks = K / 32;
  __m512 acc[G][kStripe];
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < kStripe; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512bh xv[G];
    for (int m = 0; m < G; ++m)
      xv[m] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * K + c * 32));
    for (int j = 0; j < rows; ++j) {
      const uint16_t* line = w + (n + j) * K + c * 32;
      if (kPrefetchBytes > 0 && fetch)
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(line));
      for (int m = 0; m < G; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv[m], wv);
    }
  }
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < rows; ++j) {
      float s = _mm512_reduce_add_ps(acc[m][j]);
      if (b != nullptr) s += bf16_to_float(b[n + j]);
      y[m * N + n + j] = to_bf16(s);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (no bfloat16 arithmetic, as on AMD before Zen 4): a register-tiled matmul over the
// weight in its own layout (`small_linear_pack`): blocks of 16 outputs, each [K][16], so one
// 32-byte load gives a k's 16 weights and two unpacks widen them (no shifts, no lane
// crossing). Each row of x is broadcast a value at a time against them: every output is one
// float32 lane summed k by k in order, from 0, with fused multiply-adds, whatever the row
// count, so a row's output is the same bits alone or in any batch this kernel takes (a
// speculative step's verification rows give what one-token steps give). The stripe kernel
// it replaced (dot products over natural rows, each chunk re-widened for every four rows of
// x, their 16 sums past the registers) ran 2 to 16 rows at 49-80 GFLOPS on a 2-core Zen 3;
// this one, x's k range in passes of kChunk so x and the block stay in L1, 110-127 in a
// replica at 8 to 16 rows. Its decode steps ran 1.2-1.6x faster than on oneDNN's float32
// matmul at 16 to 64 rows (`bench_small_linear`, docs/BENCHMARKS.md): so up to 64 rows.
#include <immintrin.h>
#define SUBWAY_SMALL_LINEAR 1
static constexpr int64_t kRowsUsed = 64;
static constexpr int64_t kBlock = 16;  // outputs per block of the packed weight
static constexpr int64_t kChunk = 256;  // k per pass over a block, for every group of rows
static constexpr int kMaxGroup = 5;  // rows of x per register tile: 10 sums, 2 weights, x, 0
// Where each of a k's 16 packed weights comes from: unpacking 16-bit words interleaves
// within each 128-bit half, so this order makes the low unpack give outputs 0-7, the high 8-15.
static constexpr int64_t kLaneOrder[kBlock] = {0, 1, 2, 3, 8, 9, 10, 11,
                                               4, 5, 6, 7, 12, 13, 14, 15};

static inline void widen16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

// G rows of x (float32, rows of K) against one block over k in [k0, k1): the sums start
// from `sums [G][16]` (from zero when `first`) and go back there. `fetch`: this pass streams
// the block from memory (the first group's), so it prefetches ahead.
template <int G>
static inline void block_pass(const float* x, int64_t K, const uint16_t* block, int64_t k0,
                              int64_t k1, float* sums, bool first, bool fetch) {
  __m256 acc[G][2];
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < 2; ++j)
      acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + m * kBlock + j * 8);
  for (int64_t k = k0; k < k1; ++k) {
    const uint16_t* p = block + k * kBlock;
    if (kPrefetchBytes > 0 && fetch && (k & 1) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
    __m256 w0, w1;
    widen16(p, w0, w1);
    for (int m = 0; m < G; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(sums + m * kBlock + j * 8, acc[m][j]);
}

// One row of x against two neighbouring blocks at once, all of k: four chains of sums in
// flight, two streams of weights (one row is bound by the memory, not the FMAs).
static inline void row_pair(const float* x, int64_t K, const uint16_t* block, float* sums) {
  const uint16_t* other = block + K * kBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* p = block + k * kBlock;
    const uint16_t* q = other + k * kBlock;
    if (kPrefetchBytes > 0 && (k & 1) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m256 w0, w1, v0, v1;
    widen16(p, w0, w1);
    widen16(q, v0, v1);
    const __m256 xb = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xb, w0, a0);
    a1 = _mm256_fmadd_ps(xb, w1, a1);
    b0 = _mm256_fmadd_ps(xb, v0, b0);
    b1 = _mm256_fmadd_ps(xb, v1, b1);
  }
  _mm256_storeu_ps(sums, a0);
  _mm256_storeu_ps(sums + 8, a1);
  _mm256_storeu_ps(sums + 16, b0);
  _mm256_storeu_ps(sums + 24, b1);
}

// block_pass for g (1 to kMaxGroup) rows.
static void group_pass(int g, const float* x, int64_t K, const uint16_t* block, int64_t k0,
                       int64_t k1, float* sums, bool first, bool fetch) {
  switch (g) {
    case 1: block_pass<1>(x, K, block, k0, k1, sums, first, fetch); break;
    case 2: block_pass<2>(x, K, block, k0, k1, sums, first, fetch); break;
    case 3: block_pass<3>(x, K, block, k0, k1, sums, first, fetch); break;
    case 4: block_pass<4>(x, K, block, k0, k1, sums, first, fetch); break;
    default: block_pass<kMaxGroup>(x, K, block, k0, k1, sums, first, fetch); break;
  }
}

// sums [M][16] of outputs n0.. (at most `count` of them) to y, each plus its bias, rounded.
static inline void finish(const float* sums, int64_t M, int64_t n0, int64_t count,
                          const uint16_t* b, uint16_t* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t l = 0; l < count; ++l) {
      float s = sums[m * kBlock + l];
      if (b != nullptr) s += bf16_to_float(b[n0 + l]);
      y[m * N + n0 + l] = to_bf16(s);
    }
}

// y [M, N] = x [M, K] (float32) times the packed weight (+ b).
static void blocked_linear(const float* x, const uint16_t* w, const uint16_t* b, uint16_t* y,
                           int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / kBlock;
  const int64_t groups = (M + kMaxGroup - 1) / kMaxGroup;  // near-equal groups of rows
  if (M == 1) {
    at::parallel_for(0, (blocks + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
      alignas(32) float sums[2 * kBlock];
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t blk = 2 * p;
        const uint16_t* wb = w + blk * K * kBlock;
        if (blk + 1 < blocks) {
          row_pair(x, K, wb, sums);
          finish(sums, 1, blk * kBlock, 2 * kBlock, b, y, N);
        } else {
          block_pass<1>(x, K, wb, 0, K, sums, true, true);
          finish(sums, 1, blk * kBlock, kBlock, b, y, N);
        }
      }
    });
  } else {
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      std::vector<float> sums(M * kBlock);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const uint16_t* wb = w + blk * K * kBlock;
        for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
          const int64_t k1 = std::min(K, k0 + kChunk);
          for (int64_t g = 0, m = 0; g < groups; ++g) {
            const int rows = static_cast<int>(M / groups + (g < M % groups ? 1 : 0));
            group_pass(rows, x + m * K, K, wb, k0, k1, sums.data() + m * kBlock, k0 == 0,
                       g == 0);
            m += rows;
          }
        }
        finish(sums.data(), M, blk * kBlock, kBlock, b, y, N);
      }
    });
  }
  // The last N % 16 outputs keep their natural rows: summed the same way, a lane at a time.
  for (int64_t n = blocks * kBlock; n < N; ++n) {
    const uint16_t* row = w + blocks * kBlock * K + (n - blocks * kBlock) * K;
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[m * K + k], bf16_to_float(row[k]), s);
      if (b != nullptr) s += bf16_to_float(b[n]);
      y[m * N + n] = to_bf16(s);
    }
  }
}

torch::Tensor small_linear_pack(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2, "a bfloat16 weight [out, in]");
  const int64_t N = w.size(0), K = w.size(1), whole = N - N % kBlock;
  auto out = torch::empty_like(w, at::MemoryFormat::Contiguous);
  if (whole > 0) {
    auto order = torch::tensor(std::vector<int64_t>(kLaneOrder, kLaneOrder + kBlock));
    out.narrow(0, 0, whole).view({whole / kBlock, K, kBlock})
        .copy_(w.narrow(0, 0, whole).reshape({whole / kBlock, kBlock, K}).transpose(1, 2)
                   .index_select(2, order));
  }
  if (whole < N) out.narrow(0, whole, N - whole).copy_(w.narrow(0, whole, N - whole));
  return out;
}

#endif

// amx_linear_cpu.cpp: 5 to 32 rows where the CPU has AMX.
bool amx_linear_supported();
int64_t amx_linear_max_rows();
void amx_linear(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t M,
                int64_t K, int64_t N);

#if defined(SUBWAY_SMALL_LINEAR)
// From this many rows on, AMX (where there is one) instead of the stripe kernel. `w` is the
// weight as `small_linear_pack` gives it (on AVX2 its own layout; elsewhere as it was).
static constexpr int64_t kAmxFromRows = 5;

bool small_linear_supported() { return true; }
int64_t small_linear_rows() { return std::max(kRowsUsed, amx_linear_max_rows()); }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(),
              "contiguous x [rows, in] and w [out, in]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t max_rows = small_linear_rows();
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && M >= 1 && M <= max_rows,
              "in a multiple of 32, 1 to ", max_rows, " rows");
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->numel() == N &&
                    bias->is_contiguous(),
                "a contiguous bfloat16 bias of the output's size");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if !defined(__AVX512BF16__)
  std::vector<float> xf(M * K);  // the rows of x widened once per call
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xh[i]);
  blocked_linear(xf.data(), wp, bp, yp, M, K, N);
  return y;
#else
  int64_t first = 0;  // the first weight row left to the stripe kernel
  if (M >= kAmxFromRows && amx_linear_supported()) {
    amx_linear(xh, wp, bp, yp, M, K, N);
    first = N - N % 32;
    if (first == N) return y;
  }
  // Tasks are stripes of kStripe weight rows, at least 16 of them (>= 72 KB here) to a
  // thread: at::parallel_for splits the range evenly, where stripes of 64 rows left one of
  // two threads a ninth more of a 576-row weight. Each stripe streams from memory once,
  // for its first group of up to four rows of x, and stays in L1 for the other groups.
  at::parallel_for(first / kStripe, (N + kStripe - 1) / kStripe, 16, [&](int64_t s0, int64_t s1) {
    for (int64_t n = s0 * kStripe; n < std::min<int64_t>(s1 * kStripe, N); n += kStripe) {
      const int64_t rows = std::min<int64_t>(kStripe, N - n);
      for (int64_t m = 0; m < M; m += 4) {
        const uint16_t* xg = xh + m * K;
        uint16_t* yg = yp + m * N;
        const bool fetch = m == 0;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: group_times_stripe<1>(xg, wp, bp, yg, K, N, n, rows, fetch); break;
          case 2: group_times_stripe<2>(xg, wp, bp, yg, K, N, n, rows, fetch); break;
          case 3: group_times_stripe<3>(xg, wp, bp, yg, K, N, n, rows, fetch); break;
          default: group_times_stripe<4>(xg, wp, bp, yg, K, N, n, rows, fetch); break;
        }
      }
    }
  });
  return y;
#endif
}

#else  // neither AVX512-BF16 nor AVX2: callers keep oneDNN

bool small_linear_supported() { return false; }
int64_t small_linear_rows() { return 0; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "small_linear needs AVX512-BF16 or AVX2");
  return x;
}

torch::Tensor small_linear_pack(torch::Tensor w) { return w; }

#endif
