// Small helpers the CPU kernels share: the softmax of decode attention (scalar, and on
// AVX-512 or AVX2 vectors) and its soft-capping (tanh), the vector exp and bfloat16 widening.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

// exp for x <= 0 (scores minus their max), vectorisable, relative error ~2e-7:
// 2^(x log2 e) split into 2^n * 2^f with a degree-6 polynomial for 2^f, f in [-0.5, 0.5].
static inline float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  const float n = __builtin_roundf(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// In place over one query head's scores, normalised before the values are summed.
static inline void softmax(float* sc, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < L; ++t) m = sc[t] > m ? sc[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < L; ++t) {
    sc[t] = exp_nonpos(sc[t] - m);
    sum += sc[t];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
  for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
}

// tanh for any x (Gemma 2's soft-capping, `softcap_row`), relative error ~3e-7: for
// |x| < 0.25 its odd Taylor polynomial to x^9 (the next term is below 1e-8 of tanh there);
// beyond, (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1] (exp_nonpos clamps at -87: 1
// from |x| = 43.5 on), the sign put back. The vector versions (tanh16, tanh8) compute the
// same two formulas and pick per lane.
static constexpr float kTanhSmall = 0.25f;
static inline float tanh_small(float x) {  // |x| < kTanhSmall
  const float z = x * x;
  float p = 62.f / 2835.f;
  p = p * z - 17.f / 315.f;
  p = p * z + 2.f / 15.f;
  p = p * z - 1.f / 3.f;
  return x + x * (z * p);
}
static inline float tanh_scalar(float x) {
  const float a = x < 0.f ? -x : x;
  if (a < kTanhSmall) return tanh_small(x);
  const float e = exp_nonpos(-2.f * a);
  const float r = (1.f - e) / (1.f + e);
  return x < 0.f ? -r : r;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// exp on 16 lanes, x clamped to [-87, 88]: 2^n * p(f), a degree-6 polynomial for 2^f with
// f in [-0.5, 0.5]; relative error ~2e-7.
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// tanh_scalar on 16 lanes: both formulas, each lane takes its own.
static inline __m512 tanh16(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512 a = _mm512_andnot_ps(sign, x);  // |x|
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(62.f / 2835.f);
  p = _mm512_sub_ps(_mm512_mul_ps(p, z), _mm512_set1_ps(17.f / 315.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, z), _mm512_set1_ps(2.f / 15.f));
  p = _mm512_sub_ps(_mm512_mul_ps(p, z), _mm512_set1_ps(1.f / 3.f));
  const __m512 small = _mm512_add_ps(x, _mm512_mul_ps(x, _mm512_mul_ps(z, p)));
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 r = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 big = _mm512_or_ps(r, _mm512_and_ps(sign, x));  // |x|'s sign back
  const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(is_small, big, small);
}

// Lane j of the result is the sum of the 16 lanes of v[j]: four add levels of a transpose
// tree instead of sixteen horizontal sums. The levels leave the tokens in the lane order
// 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15, which the final permutation undoes.
static inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)
    a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44),
                         _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 4], 0x88),
                         _mm512_shuffle_f32x4(a[j], a[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)
    c[j] = _mm512_add_ps(_mm512_unpacklo_ps(b[j], b[j + 2]), _mm512_unpackhi_ps(b[j], b[j + 2]));
  const __m512d c0 = _mm512_castps_pd(c[0]), c1 = _mm512_castps_pd(c[1]);
  const __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0, c1)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(c0, c1)));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, d);
}

// 16 bfloat16 values (raw bits) as floats: bfloat16 is the top half of a float32.
static inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The softmax on 16 lanes at once, with vec_math.h's exp16. (The scalar `softmax` does not
// vectorise: without -ffast-math the compiler keeps the max reduction in order and calls roundf.)
static inline void softmax16(float* sc, int64_t L) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sc + t));
  float m = _mm512_reduce_max_ps(vm);
  for (; t < L; ++t) m = sc[t] > m ? sc[t] : m;
  const __m512 mm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t < L; t += 16) {
    const __mmask16 k = L - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - t)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), mm));
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(sc + t, k, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
  for (t = 0; t < L; t += 16) {
    const __mmask16 k = L - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - t)) - 1u);
    _mm512_mask_storeu_ps(sc + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + t), inv));
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

// exp8, widen_bf16_8, softmax8: exp16, widen_bf16, softmax16 on AVX2's 8 lanes.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// tanh16 on 8 lanes.
static inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(62.f / 2835.f);
  p = _mm256_sub_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(17.f / 315.f));
  p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(2.f / 15.f));
  p = _mm256_sub_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(1.f / 3.f));
  const __m256 small = _mm256_add_ps(x, _mm256_mul_ps(x, _mm256_mul_ps(z, p)));
  const __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 r = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 big = _mm256_or_ps(r, _mm256_and_ps(sign, x));
  const __m256 is_small = _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ);
  return _mm256_blendv_ps(big, small, is_small);
}

static inline __m256 widen_bf16_8(const void* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline void softmax8(float* sc, int64_t L) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sc + t));
  float m = hmax8(vm);
  for (int64_t i = t; i < L; ++i) m = sc[i] > m ? sc[i] : m;
  const __m256 mm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= L; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mm));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_storeu_ps(sc + t, e);
  }
  float sum = hsum8(vsum);
  for (int64_t i = t; i < L; ++i) {
    sc[i] = exp_nonpos(sc[i] - m);
    sum += sc[i];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (t = 0; t + 8 <= L; t += 8) _mm256_storeu_ps(sc + t, _mm256_mul_ps(_mm256_loadu_ps(sc + t), vinv));
  for (int64_t i = t; i < L; ++i) sc[i] *= inv;
}
#endif

// Soft-capping (Gemma 2's attn_logit_softcapping), in place over one row of scaled scores:
// sc = cap * tanh(sc / cap), on vectors where the build has them (tanh16, tanh8), the
// tail (AVX2) and everything else with tanh_scalar. `scalar`: tanh_scalar everywhere (tests).
static inline void softcap_row(float* sc, int64_t L, float cap, bool scalar = false) {
  int64_t t = 0;
  if (!scalar) {
#if defined(__AVX512F__)
    const __m512 vc = _mm512_set1_ps(cap);
    for (; t < L; t += 16) {
      const __mmask16 k = L - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - t)) - 1u);
      const __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(k, sc + t), vc);
      _mm512_mask_storeu_ps(sc + t, k, _mm512_mul_ps(tanh16(x), vc));
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const __m256 vc = _mm256_set1_ps(cap);
    for (; t + 8 <= L; t += 8)
      _mm256_storeu_ps(sc + t, _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_loadu_ps(sc + t), vc)), vc));
#endif
  }
  for (; t < L; ++t) sc[t] = tanh_scalar(sc[t] / cap) * cap;
}

// A row of decode scores into weights. Sliding windows (paged_decode's `skip`): its first
// `skip` keys lie before the window and weigh 0; the softmax (`sm`: softmax, softmax16 or
// softmax8) runs over the rest, from the first key in the window (skip < L: the query's own
// key is in it). `cap` > 0: those scores soft-capped first (`softcap_row`); 0: not (one
// test a row, so uncapped models keep their speed).
template <typename Softmax>
static inline void softmax_from(float* sc, int64_t L, int64_t skip, float cap, Softmax sm) {
  for (int64_t t = 0; t < skip; ++t) sc[t] = 0.f;
  if (cap > 0.f) softcap_row(sc + skip, L - skip, cap);
  sm(sc + skip, L - skip);
}
