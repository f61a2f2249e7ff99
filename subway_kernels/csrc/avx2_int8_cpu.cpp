// The int8 linear of `--quantization int8` on CPUs with AVX2 but no VNNI (AMD before Zen 4,
// Intel before Ice Lake / Alder Lake): y = (xq wq^T) * x_scale[row] * w_scale[col] (+ bias).
//
// Without VNNI, oneDNN's int8 matmul multiplies unsigned by signed bytes (vpmaddubsw) and
// its pairs of products saturate at 16 bits. Here the pairs cannot: both operands are
// symmetric int8 in [-127, 127] (quantize_weight, quantize_rows), and the weight is split
// into |w| (unsigned) and its sign, which vpsignb moves onto the x byte. Each pair is
// then at most 2 * 127 * 127 = 32258 < 32767, and vpmaddwd widens the pairs to int32 exactly.
// So every sum is the exact int32 dot product, as on AMX or VNNI; the scales are applied as
// amx_int8_cpu.cpp applies them (float(sum) * w_scale, then * x_scale + bias, rounded once),
// so the outputs are the same bits as the AMX kernel's.
//
// The weight is packed once at load (avx2_int8_pack): strips of 16 outputs; in each, for
// every 4 inputs, the 16 outputs' 4 bytes (64 bytes, two registers). A block of up to 3
// rows of x keeps 6 int32 accumulators; each 4 bytes of a row are broadcast. The threads
// split the strips; each strip is read from memory once, for its first block of rows, and
// from L1 for the rest (a strip is 16 * K bytes: 9 KB at K = 576, 24 KB at 1536).
#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>

// Built wherever AVX2 and FMA are (AVX-512 CPUs too, so that its tests run there); worker/quant.py
// calls it only where there is neither AMX nor VNNI.
#if defined(__AVX2__) && defined(__FMA__)
#define SUBWAY_AVX2_INT8 1
#include <immintrin.h>

namespace {

constexpr int64_t kStrip = 16;          // outputs per strip
constexpr int64_t kRowBlock = 64;       // rows of x held while a thread's strips go by
constexpr int64_t kRows = 3;            // rows of x a strip's sums are kept for at once
// The first block's strip, this far ahead. 0 to 16 KB measured level within this VM's noise
// (ad-hoc builds, 16 and 64 rows); the next strip fetched during the second block was no
// better either.
constexpr int64_t kPrefetchBytes = 1024;

inline __m256 load_bias8(const float* b, int64_t n) {
  return b == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(b + n);
}
inline __m256 load_bias8(const at::BFloat16* b, int64_t n) {
  if (b == nullptr) return _mm256_setzero_ps();
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + n));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
// Round to nearest even, as _mm512_cvtneps_pbh and at::BFloat16 do (NaN to a quiet NaN).
inline void store8(at::BFloat16* y, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}

// The exact int32 sums of R rows of x against one strip: acc[r][h] holds outputs h*8..h*8+7.
// Each product is |w| * (x with w's sign): the weight's |w| is taken once per 4 inputs for
// all R rows, where |x| would be taken once per row. With 3 rows the sums, the weight and
// its |w| fit the 16 registers (4 spilled two sums).
template <int R>
inline void strip_sums(const int8_t* x, int64_t K, const int8_t* w, __m256i (&acc)[R][2],
                       bool fetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  // Local sums, copied out at the end: written through `acc`, which as far as the compiler
  // knows may alias the int8 weight, they were stored and reloaded at every step.
  __m256i a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 4) {
    const int8_t* wk = w + k * kStrip;
    if (fetch) _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wk));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wk + 32));
    const __m256i u0 = _mm256_abs_epi8(w0);
    const __m256i u1 = _mm256_abs_epi8(w1);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, x + r * K + k, 4);
      const __m256i xs = _mm256_set1_epi32(quad);
      const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(xs, w0));
      const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_sign_epi8(xs, w1));
      a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(p0, ones));
      a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(p1, ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    acc[r][0] = a0[r];
    acc[r][1] = a1[r];
  }
}

// R rows of y, outputs n0 .. n0 + min(16, N - n0): float(sum) * w_scale, * x_scale + bias.
template <int R, typename T>
inline void store_rows(const __m256i (&acc)[R][2], const float* ws, const float* xs, const T* b,
                       T* y, int64_t N, int64_t n0, int64_t m0) {
  const int64_t cols = std::min<int64_t>(kStrip, N - n0);
  for (int r = 0; r < R; ++r) {
    const __m256 xscale = _mm256_set1_ps(xs[m0 + r]);
    T* row = y + (m0 + r) * N + n0;
    for (int h = 0; h < 2; ++h) {
      const int64_t c0 = h * 8;
      if (c0 >= cols) break;
      if (cols - c0 >= 8) {
        const __m256 s = _mm256_cvtepi32_ps(acc[r][h]);
        const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_loadu_ps(ws + n0 + c0)), xscale,
                                         load_bias8(b, n0 + c0));
        store8(row + c0, v);
      } else {  // the last strip's tail: the same arithmetic, one output at a time
        alignas(32) int32_t sums[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[r][h]);
        for (int64_t c = c0; c < cols; ++c) {
          const float bias = b == nullptr ? 0.f : static_cast<float>(b[n0 + c]);
          row[c] = static_cast<T>(std::fma(static_cast<float>(sums[c - c0]) * ws[n0 + c], xs[m0 + r], bias));
        }
      }
    }
  }
}

template <int R, typename T>
inline void block(const int8_t* x, const int8_t* w, const float* ws, const float* xs, const T* b,
                  T* y, int64_t K, int64_t N, int64_t n0, int64_t m0, bool fetch) {
  __m256i acc[R][2];
  strip_sums<R>(x + m0 * K, K, w, acc, fetch);
  store_rows<R>(acc, ws, xs, b, y, N, n0, m0);
}

template <typename T>
void run(const int8_t* xq, const float* xs, const int8_t* wp, const float* ws, const T* b, T* y,
         int64_t M, int64_t K, int64_t N) {
  const int64_t strips = (N + kStrip - 1) / kStrip;
  // At least 4 strips (64 outputs) to a thread: a one-row call is little work a strip.
  at::parallel_for(0, strips, 4, [&](int64_t s0, int64_t s1) {
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t me = std::min(M, mb + kRowBlock);
      for (int64_t s = s0; s < s1; ++s) {
        const int8_t* w = wp + s * kStrip * K;
        const int64_t n0 = s * kStrip;
        for (int64_t m = mb; m < me; m += kRows) {
          const bool fetch = m == 0;
          switch (std::min<int64_t>(kRows, me - m)) {
            case 1: block<1>(xq, w, ws, xs, b, y, K, N, n0, m, fetch); break;
            case 2: block<2>(xq, w, ws, xs, b, y, K, N, n0, m, fetch); break;
            default: block<3>(xq, w, ws, xs, b, y, K, N, n0, m, fetch); break;
          }
        }
      }
    }
  });
}

}  // namespace
#endif

#if defined(SUBWAY_AVX2_INT8)
bool avx2_int8_supported() { return true; }
#else
bool avx2_int8_supported() { return false; }
#endif

// The weight [N, K] (symmetric int8, K a multiple of 4) as run() reads it: for each strip of
// 16 outputs, for each 4 inputs, 16 x 4 bytes; zero outputs past N.
at::Tensor avx2_int8_pack(const at::Tensor& wq) {
  TORCH_CHECK(wq.scalar_type() == at::kChar && wq.dim() == 2 && wq.is_contiguous() &&
                  wq.size(1) % 4 == 0 && wq.size(0) >= 1,
              "avx2_int8_pack: a contiguous int8 weight [out, in], in a multiple of 4");
  const int64_t N = wq.size(0), K = wq.size(1), strips = (N + 15) / 16;
  auto out = at::zeros({strips * 16 * K}, wq.options());
  const int8_t* w = wq.data_ptr<int8_t>();
  int8_t* p = out.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = n / 16, j = n % 16;
    for (int64_t k = 0; k < K; k += 4)
      std::memcpy(p + s * 16 * K + k * 16 + j * 4, w + n * K + k, 4);
  }
  return out;
}

// y [M, N] = int8 x [M, K] (from quantize_rows) against the packed weight, any rows.
at::Tensor avx2_int8_matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wp,
                            const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                            at::ScalarType dtype) {
  TORCH_CHECK(avx2_int8_supported(), "avx2_int8_matmul: not built here (needs AVX2 and FMA)");
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(1) % 4 == 0 && xq.size(0) >= 1,
              "avx2_int8_matmul: contiguous int8 x [rows, in], in a multiple of 4");
  const int64_t M = xq.size(0), K = xq.size(1), N = ws.numel();
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous() &&
                  ws.scalar_type() == at::kFloat && ws.is_contiguous() && N >= 1,
              "avx2_int8_matmul: float32 scales, one per row of x and one per output");
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.is_contiguous() && wp.numel() == (N + 15) / 16 * 16 * K,
              "avx2_int8_matmul: a weight from avx2_int8_pack of ", N, " outputs by ", K, " inputs");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(wp.data_ptr()) % 32 == 0,
              "avx2_int8_matmul: the packed weight must be 32-byte aligned");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "avx2_int8_matmul: float32 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(),
                "avx2_int8_matmul: a contiguous bias of the output's dtype and size");
  auto y = at::empty({M, N}, xq.options().dtype(dtype));
#if defined(SUBWAY_AVX2_INT8)
  if (dtype == at::kFloat)
    run(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), wp.data_ptr<int8_t>(), ws.data_ptr<float>(),
        has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N);
  else
    run(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), wp.data_ptr<int8_t>(), ws.data_ptr<float>(),
        has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), M, K, N);
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(subway_int8, m) {
  m.def("avx2_int8_supported() -> bool", &avx2_int8_supported);
  m.def("avx2_int8_pack(Tensor wq) -> Tensor", &avx2_int8_pack);
  m.def("avx2_int8_matmul(Tensor xq, Tensor xs, Tensor wp, Tensor ws, Tensor? bias, ScalarType dtype) -> Tensor",
        &avx2_int8_matmul);
}
