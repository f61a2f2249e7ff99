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
#include <ATen/ATen.h>
#include <torch/types.h>  // not torch/extension.h: 2.5x faster to compile; bindings are in paged_decode_cpu.cpp
#include <ATen/Parallel.h>
#include <algorithm>
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
using XRow = uint16_t;  // x stays bfloat16: dpbf16 takes it as it is
static const XRow* prepare_x(const uint16_t* xh, int64_t, std::vector<float>&) { return xh; }

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
// AVX2 (no bfloat16 arithmetic, as on AMD before Zen 4): the rows of x widened to float32
// once per call, each weight chunk of 8 widened in registers (a shift), float32 FMAs. With
// its prefetch it reads SmolLM2's weights at 21 GB/s at one row, against 24 for a plain sum
// (2-core AVX2 EPYC; 17 GB/s without the prefetch); at 2 to 4 rows oneDNN's call takes
// 1.5-2x as long, since it widens the whole weight for each. Same plan and rounding as the
// AVX512-BF16 path.
#include <immintrin.h>
#define SUBWAY_SMALL_LINEAR 1
// Up to 16 rows: oneDNN widens bfloat16 on every call here, and its float32 matmul on the
// packed float32 copy (`--bf16-matmul auto`) reads twice the bytes. Over SmolLM2's 120
// layer weights (an ad-hoc loop, 2-core AVX2 EPYC) this kernel was 2.1x faster than that at
// 4 rows, 1.34x at 8, 1.13x at 12, 1.07x at 16, and slower from 24 (0.83x): it widens each
// weight chunk again for every group of four rows, while oneDNN's cost grows more slowly.
static constexpr int64_t kRowsUsed = 16;
using XRow = float;  // the rows of x widened once per call
static const XRow* prepare_x(const uint16_t* xh, int64_t n, std::vector<float>& buf) {
  buf.resize(n);
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(xh[i]);
  return buf.data();
}

// widen_bf16_8 and hsum8 are vec_math.h's.
// The AVX512-BF16 path's group_times_stripe on 8 float32 lanes: each 64-byte line of the
// stripe's rows is prefetched kPrefetchBytes ahead when `fetch`, then taken as 4 chunks of 8.
// The sums run chunk by chunk in order, as without the prefetch (the same bits).
template <int G, int R>  // R: the stripe's rows, known (kStripe) or 0 (`rows`, the last one)
static inline void stripe_sums(const float* x, const uint16_t* w, __m256 (&acc)[G][kStripe],
                               int64_t K, int64_t n, int64_t rows_, bool fetch) {
  const int64_t rows = R > 0 ? R : rows_;
  for (int64_t c = 0; c < K; c += 32) {
    if (kPrefetchBytes > 0 && fetch)
      for (int j = 0; j < rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + j) * K + c) + kPrefetchBytes,
                     _MM_HINT_T0);
    for (int64_t q = c; q < c + 32; q += 8) {
      __m256 xv[G];
      for (int m = 0; m < G; ++m) xv[m] = _mm256_loadu_ps(x + m * K + q);
      for (int j = 0; j < rows; ++j) {
        const __m256 wv = widen_bf16_8(w + (n + j) * K + q);
        for (int m = 0; m < G; ++m) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
      }
    }
  }
}

template <int G>
static inline void group_times_stripe(const float* x, const uint16_t* w, const uint16_t* b,
                                      uint16_t* y, int64_t K, int64_t N, int64_t n, int64_t rows,
                                      bool fetch) {
  __m256 acc[G][kStripe];
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < kStripe; ++j) acc[m][j] = _mm256_setzero_ps();
  if (rows == kStripe)
    stripe_sums<G, kStripe>(x, w, acc, K, n, rows, fetch);
  else
    stripe_sums<G, 0>(x, w, acc, K, n, rows, fetch);
  for (int m = 0; m < G; ++m)
    for (int j = 0; j < rows; ++j) {
      float s = hsum8(acc[m][j]);
      if (b != nullptr) s += bf16_to_float(b[n + j]);
      y[m * N + n + j] = to_bf16(s);
    }
}

#endif

// amx_linear_cpu.cpp: 5 to 32 rows where the CPU has AMX.
bool amx_linear_supported();
int64_t amx_linear_max_rows();
void amx_linear(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t M,
                int64_t K, int64_t N);

#if defined(SUBWAY_SMALL_LINEAR)
// From this many rows on, AMX (where there is one) instead of the stripe kernel.
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
  std::vector<float> xbuf;
  const XRow* xp =
      prepare_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M * K, xbuf);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  int64_t first = 0;  // the first weight row left to the stripe kernel
  if (M >= kAmxFromRows && amx_linear_supported()) {
    amx_linear(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), wp, bp, yp, M, K, N);
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
        const XRow* xg = xp + m * K;
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
}

#else  // neither AVX512-BF16 nor AVX2: callers keep oneDNN

bool small_linear_supported() { return false; }
int64_t small_linear_rows() { return 0; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "small_linear needs AVX512-BF16 or AVX2");
  return x;
}

#endif
