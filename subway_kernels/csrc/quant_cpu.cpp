// int8 activations for `--quantization int8` (worker/quant.py): each row quantized with its
// own symmetric scale before oneDNN's int8 matmul, and each output row scaled back after.
//
// Registered as torch ops (torch.ops.subway_int8.*), apart from the pybind module, so that
// this file owns its declarations.
#include <ATen/ATen.h>
#include <torch/types.h>  // not torch/extension.h: 2.5x faster to compile; bindings are in paged_decode_cpu.cpp
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include "vec_math.h"

namespace {

inline float load_float(const float* x, int64_t i) { return x[i]; }
inline float load_float(const at::BFloat16* x, int64_t i) { return static_cast<float>(x[i]); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define SUBWAY_QUANT_AVX2 1
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) { return widen_bf16_8(x); }
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
#endif

// One row: its absolute maximum, then q = round(x * 127 / max) (ties to even, as
// torch.round), clamped to [-127, 127]; the scale max / 127 (0 for an all-zero row).
template <typename T>
float quantize_row(const T* x, int8_t* q, int64_t n) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + i)));
  amax = _mm512_reduce_max_ps(vmax);
#elif defined(SUBWAY_QUANT_AVX2)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8(x + i), absmask));
  amax = hmax8(vmax);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(load_float(x, i)));
  const float scale = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(load16(x + i), vinv);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(r));
  }
#elif defined(SUBWAY_QUANT_AVX2)
  // The same steps 8 at a time: multiply, clamp, round to nearest even (MXCSR's default, as
  // std::nearbyint), then narrow (every value is already in [-127, 127]).
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(load8(x + i), vinv);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i r = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
  }
#endif
  for (; i < n; ++i) {
    const float v = std::min(std::max(load_float(x, i) * inv, -127.f), 127.f);
    q[i] = static_cast<int8_t>(std::nearbyint(v));
  }
  return scale;
}

template <typename T>
void rescale_row(T* y, float s, const T* bias, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float v = static_cast<float>(y[j]) * s;
    if (bias != nullptr) v += static_cast<float>(bias[j]);
    y[j] = static_cast<T>(v);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
void rescale_row(at::BFloat16* y, float s, const at::BFloat16* bias, int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_mul_ps(load16(y + j), vs);
    if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + j));
    const __m256bh r = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j), reinterpret_cast<const __m256i&>(r));
  }
  for (; j < n; ++j) {
    float v = static_cast<float>(y[j]) * s;
    if (bias != nullptr) v += static_cast<float>(bias[j]);
    y[j] = static_cast<at::BFloat16>(v);
  }
}
#endif

constexpr int64_t kGrain = 1 << 17;  // elements per thread: decode batches run on one, no fork/join

}  // namespace

// x [rows, n] float32 or bfloat16 -> (int8 [rows, n], float32 scales [rows]).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows: a contiguous [rows, n] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantize_rows: float32 or bfloat16");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor q = at::empty({rows, n}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({rows}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
  AT_DISPATCH_SWITCH(x.scalar_type(), "quantize_rows",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* xp = x.data_ptr<float>();
      at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) sp[r] = quantize_row(xp + r * n, qp + r * n, n);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
      at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) sp[r] = quantize_row(xp + r * n, qp + r * n, n);
      });
    }));  // fmt: skip
  return {q, s};
}

// y [rows, n] *= scales[row], then + bias [n] when given; in place, y's dtype.
at::Tensor rescale_rows_(at::Tensor y, const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "rescale_rows_: a contiguous [rows, n] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == y.size(0) &&
                  scales.is_contiguous(), "rescale_rows_: float32 scales, one per row");
  const int64_t rows = y.size(0), n = y.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == y.scalar_type() && bias->numel() == n && bias->is_contiguous(),
                "rescale_rows_: bias of y's dtype, one per column");
  }
  const float* sp = scales.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
  AT_DISPATCH_SWITCH(y.scalar_type(), "rescale_rows_",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      float* yp = y.data_ptr<float>();
      const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
      at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) rescale_row(yp + r * n, sp[r], bp, n);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::BFloat16* yp = y.data_ptr<at::BFloat16>();
      const at::BFloat16* bp = has_bias ? bias->data_ptr<at::BFloat16>() : nullptr;
      at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) rescale_row(yp + r * n, sp[r], bp, n);
      });
    }));  // fmt: skip
  return y;
}

TORCH_LIBRARY(subway_int8, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)", &quantize_rows);
  m.def("rescale_rows_(Tensor(a!) y, Tensor scales, Tensor? bias) -> Tensor(a!)", &rescale_rows_);
}
