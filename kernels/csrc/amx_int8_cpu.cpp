// The int8 linear of `--quantization int8` for decode batches, on AMX:
// y = (xq wq^T) * x_scale[row] * w_scale[col] (+ bias), in x's dtype (bfloat16 or float32).
//
// The plan of amx_linear_cpu.cpp with int8 tiles: the weight's int8 rows as they lie (a tile
// of 16 rows by 64 inputs is AMX's A operand), x's int8 rows (from quantize_rows) repacked as
// words of four inputs into B tiles, int32 sums in C tiles, each output scaled and rounded
// once. oneDNN's int8 matmul reads this VM's int8 weights no faster than the bfloat16 ones
// (docs/BENCHMARKS.md); reading half the bytes is what int8 is for. Sums are exact integers,
// so the result differs from the oneDNN path only in rounding: that one rounds to x's dtype
// after the weight's scale, then again after the row's.
#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include "amx.h"

static constexpr int64_t kMaxRows = 64;

namespace {

template <typename T>
inline __m512 load_bias(const T* b, int64_t n0);
template <>
inline __m512 load_bias<float>(const float* b, int64_t n0) {
  return b == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(b + n0);
}
template <>
inline __m512 load_bias<at::BFloat16>(const at::BFloat16* b, int64_t n0) {
  if (b == nullptr) return _mm512_setzero_ps();
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n0));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(at::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// A C tile to y: c[i][j] is the sum for output n0 + i of x's row m0 + j.
template <typename T>
inline void store_tile(const int32_t* c, const float* ws, const float* xs, const T* b, T* y,
                       int64_t N, int64_t n0, int64_t m0, int64_t M) {
  const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                        208, 224, 240);
  const __m512 w = _mm512_loadu_ps(ws + n0), bias = load_bias(b, n0);
  for (int64_t j = 0; j < 16 && m0 + j < M; ++j) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(col, c + j, 4));
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sum, w), _mm512_set1_ps(xs[m0 + j]), bias);
    store16(y + (m0 + j) * N + n0, v);
  }
}

template <typename T>
void run(const int8_t* xq, const float* xs, const int8_t* w, const float* ws, const T* b, T* y,
         int64_t M, int64_t K, int64_t N) {
  static thread_local std::vector<uint32_t> xp;  // reused: no allocation per call
  pack_words(xq, M, K / 4, xp);
  amx_strips<true>(reinterpret_cast<const char*>(w), K, N, xp, (M + 15) / 16,
                   [&](const uint32_t* c, int64_t n0, int64_t m0) {
                     store_tile(reinterpret_cast<const int32_t*>(c), ws, xs, b, y, N, n0, m0, M);
                   });
}

// The rows and columns AMX does not cover (N % 32 outputs): scalar, exact integer sums.
template <typename T>
void tail(const int8_t* xq, const float* xs, const int8_t* w, const float* ws, const T* b, T* y,
          int64_t M, int64_t K, int64_t N, int64_t first) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = first; n < N; ++n) {
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += int32_t(xq[m * K + k]) * int32_t(w[n * K + k]);
      float v = float(acc) * ws[n] * xs[m];
      if (b != nullptr) v += static_cast<float>(b[n]);
      y[m * N + n] = static_cast<T>(v);
    }
}

}  // namespace

int64_t amx_int8_rows() { return amx_permitted() ? kMaxRows : 0; }

at::Tensor amx_int8_linear(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wq,
                           const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                           at::ScalarType dtype) {
  TORCH_CHECK(amx_permitted(), "amx_int8_linear: no AMX here");
  TORCH_CHECK(xq.scalar_type() == at::kChar && wq.scalar_type() == at::kChar && xq.dim() == 2 &&
                  wq.dim() == 2 && xq.is_contiguous() && wq.is_contiguous(),
              "amx_int8_linear: contiguous int8 x [rows, in] and w [out, in]");
  const int64_t M = xq.size(0), K = xq.size(1), N = wq.size(0);
  TORCH_CHECK(wq.size(1) == K && K % 64 == 0 && M >= 1 && M <= kMaxRows,
              "amx_int8_linear: in a multiple of 64, 1 to ", kMaxRows, " rows");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous() &&
                  ws.scalar_type() == at::kFloat && ws.numel() == N && ws.is_contiguous(),
              "amx_int8_linear: float32 scales, one per row of x and one per output");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "amx_int8_linear: float32 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(),
                "amx_int8_linear: a contiguous bias of the output's dtype and size");
  auto y = at::empty({M, N}, xq.options().dtype(dtype));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = wq.data_ptr<int8_t>();
  const float* xsp = xs.data_ptr<float>();
  const float* wsp = ws.data_ptr<float>();
  const int64_t first = N - N % 32;
  if (dtype == at::kFloat) {
    const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
    run(xp, xsp, wp, wsp, bp, y.data_ptr<float>(), M, K, N);
    tail(xp, xsp, wp, wsp, bp, y.data_ptr<float>(), M, K, N, first);
  } else {
    const at::BFloat16* bp = has_bias ? bias->data_ptr<at::BFloat16>() : nullptr;
    run(xp, xsp, wp, wsp, bp, y.data_ptr<at::BFloat16>(), M, K, N);
    tail(xp, xsp, wp, wsp, bp, y.data_ptr<at::BFloat16>(), M, K, N, first);
  }
  return y;
}

#else

int64_t amx_int8_rows() { return 0; }
at::Tensor amx_int8_linear(const at::Tensor& xq, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const c10::optional<at::Tensor>&, at::ScalarType) {
  TORCH_CHECK(false, "amx_int8_linear needs AMX-INT8 (and Linux)");
  return xq;
}

#endif

TORCH_LIBRARY_FRAGMENT(subway_int8, m) {
  m.def("amx_int8_rows() -> int", &amx_int8_rows);
  m.def("amx_int8_linear(Tensor xq, Tensor xs, Tensor wq, Tensor ws, Tensor? bias, ScalarType dtype) -> Tensor",
        &amx_int8_linear);
}
