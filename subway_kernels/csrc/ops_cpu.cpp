// Fused elementwise ops of the Llama family for the CPU: one call where the PyTorch
// reference makes five to ten, each allocating its result. At decode batch sizes the
// per-op overhead, not the arithmetic, is what these ops cost.
//
// They round where Hugging Face's eager code rounds: every intermediate that transformers
// holds in the model dtype is rounded to it here too (`rnd`), so bfloat16 results match the
// reference bit for bit except where a float32 sum's order differs (the RMS mean).
#include <ATen/ATen.h>
#include <torch/types.h>  // not torch/extension.h: 2.5x faster to compile; bindings are in paged_decode_cpu.cpp
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// Rows per parallel task: elementwise work on a few rows is cheaper on one thread.
static constexpr int64_t kGrain = 64;

// Per-element conversions on the raw storage: bfloat16 as uint16_t bits, so that the loops
// below vectorise.
template <typename T>
struct Raw {
  using S = T;
  static float get(S x) { return static_cast<float>(x); }
  static S put(float f) { return static_cast<S>(f); }
};
template <>
struct Raw<c10::BFloat16> {
  using S = uint16_t;
  static float get(S x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  static S put(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : static_cast<uint16_t>(r);
  }
};

// out = weight * (x * rsqrt(mean(x^2) + eps)); with residual: x = x + residual first, and the
// sum is also returned as the new residual stream.
template <typename T>
static void rms_norm_rows(const T* xt, const T* rt, const T* wt, T* outt, T* nrt, int64_t n,
                          int64_t hidden, float eps) {
  using R = Raw<T>;
  using S = typename R::S;
  const S* x = reinterpret_cast<const S*>(xt);
  const S* res = reinterpret_cast<const S*>(rt);
  const S* w = reinterpret_cast<const S*>(wt);
  S* out = reinterpret_cast<S*>(outt);
  S* new_res = reinterpret_cast<S*>(nrt);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    float* hp = h.data();
    for (int64_t i = begin; i < end; ++i) {
      const S* xr = x + i * hidden;
      if (res != nullptr) {
        const S* rr = res + i * hidden;
        S* nr = new_res + i * hidden;
#pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) {
          const S s = R::put(R::get(xr[j]) + R::get(rr[j]));
          nr[j] = s;
          hp[j] = R::get(s);
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) hp[j] = R::get(xr[j]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < hidden; ++j) ss += hp[j] * hp[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      S* o = out + i * hidden;
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j)
        o[j] = R::put(R::get(w[j]) * R::get(R::put(hp[j] * inv)));
    }
  });
}

std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: dtypes differ");
  const int64_t hidden = x.size(-1), n = x.numel() / hidden;
  auto out = torch::empty_like(x);
  torch::Tensor new_res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual");
    new_res = torch::empty_like(x);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(
        x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
        weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        residual ? new_res.data_ptr<scalar_t>() : nullptr, n, hidden, static_cast<float>(eps));
  });
  if (residual.has_value()) return {out, new_res};
  return {out};
}

// Rotary embedding ("rotate_half") of one head vector, HF's rounding:
// out = round(round(x * cos) + round(rotate_half(x) * sin)).
template <typename T>
static inline void rope_head(const T* xt, const T* cst, T* outt, int64_t D) {
  using R = Raw<T>;
  using S = typename R::S;
  const S* x = reinterpret_cast<const S*>(xt);
  const S* c = reinterpret_cast<const S*>(cst);  // cos of the half frequencies, then sin
  S* out = reinterpret_cast<S*>(outt);
  const int64_t half = D / 2;
  const auto rnd = [](float f) { return R::get(R::put(f)); };
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = R::get(x[i]), x2 = R::get(x[i + half]);
    const float ci = R::get(c[i]), si = R::get(c[i + half]);
    out[i] = R::put(rnd(x1 * ci) + rnd(-x2 * si));
    out[i + half] = R::put(rnd(x2 * ci) + rnd(x1 * si));
  }
}

// One head vector into an 8-bit cache row: symmetric, scale = absmax / 127, q = round(x /
// scale) (to nearest even) clamped to +-127, all zeros where the scale is 0; then the
// float32 scale's 4 bytes. As subway_kernels/attention.py quantize_kv, bit for bit.
template <typename T>
static inline void quantize_head(const T* xt, int8_t* dst, int64_t D) {
  using R = Raw<T>;
  const typename R::S* x = reinterpret_cast<const typename R::S*>(xt);
  float m = 0.f;
  for (int64_t i = 0; i < D; ++i) m = std::max(m, std::fabs(R::get(x[i])));
  const float s = m / 127.f;
  if (s > 0.f) {
    for (int64_t i = 0; i < D; ++i) {
      const float r = std::nearbyint(R::get(x[i]) / s);
      dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
    }
  } else {
    std::memset(dst, 0, D);
  }
  std::memcpy(dst + D, &s, sizeof(s));
}

// q [n, H, D], k/v [n, KVH, D] (any token and head strides, unit last stride). Returns q
// rotated, contiguous; writes rotated k and v to the caches at `slots` (slot s: block s / BS,
// offset s % BS of a [num_blocks, BS, KVH, D] cache; of an int8 [num_blocks, BS, KVH, D + 4]
// cache, quantized by `quantize_head`).
torch::Tensor rope_write_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                            torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rope_write_kv: q, k, v are 3-d");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "unit last stride");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64,
              "positions and slots are int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos_sin.is_contiguous(),
              "caches contiguous");
  const bool int8 = k_cache.scalar_type() == torch::kInt8;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (int8 || q.scalar_type() == k_cache.scalar_type()) &&
                  q.scalar_type() == cos_sin.scalar_type(),
              "rope_write_kv: dtypes differ");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t W = int8 ? D + 4 : D;  // a cache row: an int8 one ends in its scale
  TORCH_CHECK(D % 2 == 0 && cos_sin.size(1) == D && k_cache.size(3) == W &&
                  k_cache.size(2) == KVH,
              "rope_write_kv: shapes do not match");
  positions = positions.contiguous();
  slots = slots.contiguous();
  auto out = torch::empty({n, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_write_kv", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const T* cs = cos_sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T *kc = int8 ? nullptr : k_cache.data_ptr<T>(), *vc = int8 ? nullptr : v_cache.data_ptr<T>();
    int8_t* kc8 = int8 ? k_cache.data_ptr<int8_t>() : nullptr;
    int8_t* vc8 = int8 ? v_cache.data_ptr<int8_t>() : nullptr;
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
    const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<T> rotated(int8 ? D : 0);  // k after RoPE, before it is quantized
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cs + pos[t] * D;
        for (int64_t h = 0; h < H; ++h) rope_head<T>(qp + t * qs0 + h * qs1, c, op + (t * H + h) * D, D);
        const int64_t slot = sl[t];
        for (int64_t h = 0; h < KVH; ++h) {
          if (int8) {
            rope_head<T>(kp + t * ks0 + h * ks1, c, rotated.data(), D);
            quantize_head<T>(rotated.data(), kc8 + (slot * KVH + h) * W, D);
            quantize_head<T>(vp + t * vs0 + h * vs1, vc8 + (slot * KVH + h) * W, D);
            continue;
          }
          rope_head<T>(kp + t * ks0 + h * ks1, c, kc + (slot * KVH + h) * D, D);
          std::memcpy(vc + (slot * KVH + h) * D, vp + t * vs0 + h * vs1, D * sizeof(T));
        }
      }
    });
  });
  return out;
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "vec_math.h"

static inline __m256i narrow(__m512 v) {  // round to nearest even, as torch's bfloat16 cast
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// One row of silu(gate) * up, rounded where the reference (F.silu(gate) * up) rounds: silu
// to bfloat16, then the product.
static void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* dst, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 gv = widen_bf16(_mm256_maskz_loadu_epi16(k, g + j));
    const __m512 uv = widen_bf16(_mm256_maskz_loadu_epi16(k, u + j));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = widen_bf16(narrow(_mm512_div_ps(gv, _mm512_add_ps(one, e))));
    _mm256_mask_storeu_epi16(dst + j, k, narrow(_mm512_mul_ps(s, uv)));
  }
}
#define SUBWAY_SILU_AND_MUL 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "vec_math.h"

// 8 floats to bfloat16 bits, round to nearest even and NaN to 0x7fc0, as torch's cast
// (Raw<BFloat16>::put on 8 lanes).
static inline __m128i narrow8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // packus interleaves the 128-bit lanes: [r0-3 r0-3 | r4-7 r4-7]; the permute gathers r0-7.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

// silu(g) * u on 8 lanes, rounded as the AVX-512 build rounds (the same exp polynomial,
// division and roundings, so the same bits).
static inline void silu_mul8(const uint16_t* g, const uint16_t* u, uint16_t* dst) {
  const __m256 gv = widen_bf16_8(g);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
  const __m128i s16 = narrow8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(s16), 16));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), narrow8(_mm256_mul_ps(s, widen_bf16_8(u))));
}

static void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) silu_mul8(g + j, u + j, dst + j);
  if (j < n) {  // a ragged tail: the same code on a zero-padded copy
    uint16_t gt[8] = {0}, ut[8] = {0}, ot[8];
    std::memcpy(gt, g + j, (n - j) * sizeof(uint16_t));
    std::memcpy(ut, u + j, (n - j) * sizeof(uint16_t));
    silu_mul8(gt, ut, ot);
    std::memcpy(dst + j, ot, (n - j) * sizeof(uint16_t));
  }
}
#define SUBWAY_SILU_AND_MUL 1
#endif

#ifdef SUBWAY_SILU_AND_MUL
// silu(gate) * up for a merged gate|up projection, bfloat16 rows [rows, 2n] -> [rows, n].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "silu_and_mul: [rows, 2n] bfloat16");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * n, "silu_and_mul: an odd width");
  auto out = torch::empty({rows, n}, x.options());
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * 2 * n, in + r * 2 * n + n, o + r * n, n);
  });
  return out;
}
bool silu_and_mul_supported() { return true; }
#else
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(false, "silu_and_mul: built without AVX512-BF16 or AVX2");
  return x;
}
bool silu_and_mul_supported() { return false; }
#endif
