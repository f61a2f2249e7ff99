// The int8 linear of `--quantization int8` on AMX:
// y = (xq wq^T) * x_scale[row] * w_scale[col] (+ bias), in x's dtype (bfloat16 or float32).
//
// x's int8 rows (from quantize_rows) are AMX's A operand as they lie, 16 rows to a tile,
// and the weight is the B operand, packed once at load (amx_int8_pack): for each 16
// outputs and each 64 inputs one 1 KB tile, each strip of 32 outputs contiguous. Each C
// tile holds the exact int32 sums of 16 rows by 16 outputs; each is scaled and rounded
// once and stored as it stands (oneDNN's path rounds twice: after the weight's scale, then
// after the row's). The threads split the strips.
//
// On this project's VM (docs/BENCHMARKS.md) oneDNN's int8 matmul reads the int8 weight no
// faster than its bfloat16 one, and this kernel is faster at every row count measured:
// about 2.3x at 1-16 rows, 1.6x at 64, 1.15-1.2x from 256 to 2048. So where the CPU has
// AMX, Int8Linear holds only this packed weight and calls this kernel for every call.
#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include "amx.h"

namespace {

// 16 consecutive values from n0 as float32 (zeros where `mask` is clear or b is null).
template <typename T>
inline __m512 load_bias(const T* b, int64_t n0, __mmask16 mask = 0xFFFF);
template <>
inline __m512 load_bias<float>(const float* b, int64_t n0, __mmask16 mask) {
  return b == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, b + n0);
}
template <>
inline __m512 load_bias<at::BFloat16>(const at::BFloat16* b, int64_t n0, __mmask16 mask) {
  if (b == nullptr) return _mm512_setzero_ps();
  const __m256i h = _mm256_maskz_loadu_epi16(mask, b + n0);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* y, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm512_mask_storeu_ps(y, mask, v);
}
inline void store16(at::BFloat16* y, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// A C tile to y: c[r][i] is the sum for output n0 + i of x's row m0 + r.
template <typename T>
inline void store_rows(const int32_t* c, const float* ws, const float* xs, const T* b, T* y,
                       int64_t N, int64_t n0, int64_t m0, int64_t M) {
  if (n0 >= N) return;  // the packed weight's zero rows, past N
  const __mmask16 mask = N - n0 >= 16 ? 0xFFFF : __mmask16((1u << (N - n0)) - 1);
  const __m512 w = _mm512_maskz_loadu_ps(mask, ws + n0), bias = load_bias(b, n0, mask);
  for (int64_t r = 0; r < 16 && m0 + r < M; ++r) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sum, w), _mm512_set1_ps(xs[m0 + r]), bias);
    store16(y + (m0 + r) * N + n0, v, mask);
  }
}

// Each thread takes its share of the weight's strips against each pair of x's groups in
// turn: the pair (32 rows, at most 48 KB) stays in L1 while the strips stream from L2 (a
// thread's share of a layer's weight is at most 0.9 MB here), and the first pair streams
// them in from memory. Against larger passes of x (each held while the strips go by), at
// 512 and 2048 rows against oneDNN: 1.15-1.2x this way, 1.0-1.14x with passes of 64 or 128
// rows, 0.85-0.93x with 256 or 512 (ad-hoc runs, docs/BENCHMARKS.md).
template <typename T>
void run(const int8_t* xq, const float* xs, const uint32_t* wb, const float* ws, const T* b, T* y,
         int64_t M, int64_t K, int64_t N) {
  const int64_t chunks = K / 64, groups = (M + 15) / 16, full = M / 16;
  const int64_t strips = (N + 31) / 32, strip_words = 2 * chunks * 256;
  // The last group of x, if partial, zero-padded to 16 rows: an A tile loads 16.
  static thread_local std::vector<int8_t> pad;
  if (full < groups) {
    pad.assign(16 * K, 0);
    std::memcpy(pad.data(), xq + full * 16 * K, (M - full * 16) * K);
  }
  const char* x = reinterpret_cast<const char*>(xq);
  const char* padded = reinterpret_cast<const char*>(pad.data());  // this thread's buffer
  auto group = [&](int64_t g) { return g < full ? x + g * 16 * K : padded; };
  const TileConfig config = tile_config();
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    _tile_loadconfig(&config);
    for (int64_t g = 0; g < groups; g += 2) {
      for (int64_t s = s0; s < s1; ++s) {
        const uint32_t* w0 = wb + s * strip_words;  // the strip's two halves' tiles
        const uint32_t* w1 = w0 + chunks * 256;
        // The first pair prefetches the next strip from memory into L2.
        const char* ahead =
            g == 0 && s + 1 < s1 ? reinterpret_cast<const char*>(w0 + strip_words) : nullptr;
        // y's lines for this block, fetched for writing while its sums are computed: y is
        // new memory, and stores that wait for their lines hold the tiles up (measured with
        // an earlier loop order, at 256 rows: 1.32x oneDNN's speed with this, 1.18x
        // without, one run each).
        for (int64_t m = g * 16; m < std::min(M, g * 16 + 32); ++m)
          for (int64_t n = s * 32; n < std::min(N, s * 32 + 32); n += 64 / int64_t(sizeof(T)))
            __builtin_prefetch(y + m * N + n, 1, 3);
        auto store = [&](const uint32_t* c, int64_t i, int64_t j) {
          store_rows(reinterpret_cast<const int32_t*>(c), ws, xs, b, y, N, s * 32 + 16 * j,
                     (g + i) * 16, M);
        };
        const int64_t bytes = strip_words * 4;
        if (groups - g >= 2)
          amx_block<2, 2, true>(group(g), group(g + 1), K, w0, w1, chunks, ahead, bytes, store);
        else
          amx_block<1, 2, true>(group(g), nullptr, K, w0, w1, chunks, ahead, bytes, store);
      }
    }
    _tile_release();
  });
}

}  // namespace

bool amx_int8_supported() { return amx_permitted(); }

// The weight [N, K] as B tiles for run(): pack_words' layout of its rows (for each 16
// outputs and each 64 inputs, 256 words), zero rows added up to a multiple of 32 outputs.
at::Tensor amx_int8_pack(const at::Tensor& wq) {
  TORCH_CHECK(wq.scalar_type() == at::kChar && wq.dim() == 2 && wq.is_contiguous() &&
                  wq.size(1) % 64 == 0,
              "amx_int8_pack: a contiguous int8 weight [out, in], in a multiple of 64");
  const int64_t N = wq.size(0), K = wq.size(1);
  std::vector<uint32_t> words;
  pack_words(wq.data_ptr<int8_t>(), N, K / 4, words);
  auto out = at::zeros({(N + 31) / 32 * 2 * (K / 64) * 256}, wq.options().dtype(at::kInt));
  std::memcpy(out.data_ptr<int32_t>(), words.data(), words.size() * sizeof(uint32_t));
  return out;
}

// y [M, N] = int8 x [M, K] against the packed weight (amx_int8_pack), any number of rows.
at::Tensor amx_int8_matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wb,
                           const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                           at::ScalarType dtype) {
  TORCH_CHECK(amx_permitted(), "amx_int8_matmul: no AMX here");
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(1) % 64 == 0 && xq.size(0) >= 1,
              "amx_int8_matmul: contiguous int8 x [rows, in], in a multiple of 64");
  const int64_t M = xq.size(0), K = xq.size(1), N = ws.numel();
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous() &&
                  ws.scalar_type() == at::kFloat && ws.is_contiguous() && N >= 1,
              "amx_int8_matmul: float32 scales, one per row of x and one per output");
  TORCH_CHECK(wb.scalar_type() == at::kInt && wb.is_contiguous() &&
                  wb.numel() == (N + 31) / 32 * 2 * (K / 64) * 256,
              "amx_int8_matmul: a weight from amx_int8_pack of ", N, " outputs by ", K, " inputs");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "amx_int8_matmul: float32 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(),
                "amx_int8_matmul: a contiguous bias of the output's dtype and size");
  auto y = at::empty({M, N}, xq.options().dtype(dtype));
  const auto* w = reinterpret_cast<const uint32_t*>(wb.data_ptr<int32_t>());
  if (dtype == at::kFloat)
    run(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), w, ws.data_ptr<float>(),
        has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N);
  else
    run(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), w, ws.data_ptr<float>(),
        has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), M, K,
        N);
  return y;
}

#else

bool amx_int8_supported() { return false; }
at::Tensor amx_int8_pack(const at::Tensor& wq) {
  TORCH_CHECK(false, "amx_int8_pack needs AMX-INT8 (and Linux)");
  return wq;
}
at::Tensor amx_int8_matmul(const at::Tensor& xq, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const c10::optional<at::Tensor>&, at::ScalarType) {
  TORCH_CHECK(false, "amx_int8_matmul needs AMX-INT8 (and Linux)");
  return xq;
}

#endif

TORCH_LIBRARY_FRAGMENT(subway_int8, m) {
  m.def("amx_int8_supported() -> bool", &amx_int8_supported);
  m.def("amx_int8_pack(Tensor wq) -> Tensor", &amx_int8_pack);
  m.def("amx_int8_matmul(Tensor xq, Tensor xs, Tensor wb, Tensor ws, Tensor? bias, ScalarType dtype) -> Tensor",
        &amx_int8_matmul);
}
