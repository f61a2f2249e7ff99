// Paged decode attention over an 8-bit KV cache (`--kv-cache-dtype int8`), for the CPU: the
// same work as paged_decode_cpu.cpp, reading the int8 blocks in place and dequantizing on
// the fly (score = scale_k * q.k_int8; values weighted by p * scale_v).
//
// q            [n, num_heads, head_dim], float32, bfloat16 or float16
// k_cache      [num_blocks, block_size, num_kv_heads, head_dim + 4] int8 (v_cache the same):
//              per slot and head, head_dim quantized values, then their float32 scale
//              (native byte order; subway_kernels/attention.py quantize_kv writes the same)
// block_tables [n, max_blocks] int32
// context_lens [n] int32
// skip         [n] int32 or None (sliding windows): a sequence's first keys that lie before its
//              window, fewer than its context; they weigh 0 in every path below (each
//              path's softmax runs from the first key in the window, `softmax_from`)
// softcap      0, or a positive cap (Gemma 2): every path's scaled scores are soft-capped,
//              softcap * tanh(score / softcap), before its softmax (`softmax_from` again)
// returns      [n, num_heads, head_dim], q's dtype
#include <ATen/ATen.h>
#include <torch/types.h>  // not torch/extension.h: 2.5x faster to compile; bindings are in paged_decode_cpu.cpp
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>
#include "vec_math.h"

static constexpr int64_t kScaleBytes = 4;

static inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// The generic kernel, any head size and any machine: one work item per (sequence, KV head).
template <typename T>
static void decode_int8_generic(const T* q, const int8_t* kc, const int8_t* vc,
                                const int32_t* tables, const int32_t* ctx, const int32_t* skip,
                                T* out, int64_t n,
                                int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                int64_t max_blocks, float scale, float softcap) {
  const int64_t G = H / KVH, W = D + kScaleBytes;
  const int64_t row = KVH * W;  // bytes between consecutive tokens of one block
  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row_f(D), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t s = idx / KVH, h = idx % KVH;
      const int64_t L = ctx[s], S = skip ? skip[s] : 0;  // S: keys before the window
      const int32_t* table = tables + s * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(s * H + h * G + g) * D + d]) * scale;
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int8_t* k = kc + ((int64_t)table[t / BS] * BS + t % BS) * row + h * W;
        const float ks = row_scale(k, D);
        for (int64_t d = 0; d < D; ++d) row_f[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * row_f[d];
          scores[g * L + t] = dot * ks;
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_from(scores.data() + g * L, L, S, softcap, softmax);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int8_t* v = vc + ((int64_t)table[t / BS] * BS + t % BS) * row + h * W;
        const float vs = row_scale(v, D);
        for (int64_t d = 0; d < D; ++d) row_f[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t] * vs;
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * row_f[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(s * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

#if defined(__AVX512F__)
// The fast path, AVX-512, head_dim a multiple of 16 up to 128, organised as the bfloat16
// kernel's: each block's keys widened once into a float tile that the G query heads of a
// KV head read from L1, the values widened once per row for all G heads.
static inline __m512 widen_i8(const int8_t* p) {  // 16 int8 values as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline __m512 load_q16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load_q16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 load_q16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The next block's rows of one item, into L2, while this block is computed.
static inline void prefetch_rows(const int8_t* first, int64_t rows, int64_t stride,
                                 int64_t bytes) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(first + j * stride + b), _MM_HINT_T1);
}

// The values of `nt` keys (int8 rows `row` bytes apart) weighted into GN query heads'
// accumulators at once, each weight p times the row's scale.
template <int NC, int GN>
static inline void block_values(const int8_t* vb, int64_t row, int64_t nt, const float* p,
                                int64_t p_stride, float* acc) {
  constexpr int64_t D = NC * 16;
  __m512 a[GN][NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + c * 16);
  for (int64_t j = 0; j < nt; ++j) {
    const int8_t* r = vb + j * row;
    const float vs = row_scale(r, D);
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = widen_i8(r + c * 16);
    for (int g = 0; g < GN; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * p_stride + j] * vs);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

template <int NC>
static inline void block_values_heads(const int8_t* vb, int64_t row, int64_t nt,
                                      const float* p, int64_t L, float* acc, int64_t G) {
  constexpr int64_t D = NC * 16;
  int64_t g = 0;
  if constexpr (NC <= 4) {
    for (; G - g >= 4; g += 4) block_values<NC, 4>(vb, row, nt, p + g * L, L, acc + g * D);
    if (G - g == 3) return block_values<NC, 3>(vb, row, nt, p + g * L, L, acc + g * D);
  }
  for (; G - g >= 2; g += 2) block_values<NC, 2>(vb, row, nt, p + g * L, L, acc + g * D);
  if (G - g == 1) block_values<NC, 1>(vb, row, nt, p + g * L, L, acc + g * D);
}

template <typename T, int NC>
static void decode_int8_avx512(const T* q, const int8_t* kc, const int8_t* vc,
                               const int32_t* tables, const int32_t* ctx, const int32_t* skip,
                               T* out, int64_t n,
                               int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks,
                               float scale, float softcap) {
  constexpr int64_t D = NC * 16, W = D + kScaleBytes;
  const int64_t G = H / KVH, row = KVH * W;
  // Work items as in paged_decode_cpu.cpp: a sequence with all its KV heads (one contiguous
  // run per token), or one (sequence, KV head) each when there are few sequences; longest
  // contexts first.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t split = n >= 2 * threads ? 1 : KVH;
  const int64_t hp = KVH / split, items = n * split;
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ctx[a] > ctx[b]; });
  const int64_t run_bytes = hp * W;
#pragma omp parallel num_threads(std::min<int64_t>(threads, items))
  {
    std::vector<float> qf(hp * G * D), tile(BS * hp * D), ks(BS * hp), scores, acc(hp * G * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < items; ++k) {
      const int64_t s = order[k / split], h0 = (k % split) * hp;
      const int64_t L = ctx[s], S = skip ? skip[s] : 0;  // S: keys before the window
      const int32_t* table = tables + s * max_blocks;
      const T* qs = q + (s * H + h0 * G) * D;
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < hp * G; ++i)
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(qf.data() + i * D + c * 16,
                           _mm512_mul_ps(load_q16(qs + i * D + c * 16), vscale));
      scores.resize(hp * G * L);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t nt = std::min(BS, L - t0);
        const int8_t* kb = kc + (int64_t)table[t0 / BS] * BS * row + h0 * W;
        if (t0 + BS < L)
          prefetch_rows(kc + (int64_t)table[t0 / BS + 1] * BS * row + h0 * W,
                        std::min(BS, L - t0 - BS), row, run_bytes);
        for (int64_t j = 0; j < nt; ++j)
          for (int64_t hh = 0; hh < hp; ++hh) {
            const int8_t* r = kb + j * row + hh * W;
            ks[hh * BS + j] = row_scale(r, D);
            for (int c = 0; c < NC; ++c)
              _mm512_storeu_ps(tile.data() + (j * hp + hh) * D + c * 16, widen_i8(r + c * 16));
          }
        for (int64_t hh = 0; hh < hp; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t i = hh * G + g;
            __m512 qg[NC];
            for (int c = 0; c < NC; ++c) qg[c] = _mm512_loadu_ps(qf.data() + i * D + c * 16);
            float* sc = scores.data() + i * L + t0;
            for (int64_t j = 0; j < nt; ++j) {
              const float* kr = tile.data() + (j * hp + hh) * D;
              __m512 a = _mm512_mul_ps(qg[0], _mm512_loadu_ps(kr));
              for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qg[c], _mm512_loadu_ps(kr + c * 16), a);
              sc[j] = _mm512_reduce_add_ps(a) * ks[hh * BS + j];
            }
          }
      }
      for (int64_t i = 0; i < hp * G; ++i) softmax_from(scores.data() + i * L, L, S, softcap, softmax16);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t nt = std::min(BS, L - t0);
        const int8_t* vb = vc + (int64_t)table[t0 / BS] * BS * row + h0 * W;
        if (t0 + BS < L)
          prefetch_rows(vc + (int64_t)table[t0 / BS + 1] * BS * row + h0 * W,
                        std::min(BS, L - t0 - BS), row, run_bytes);
        for (int64_t hh = 0; hh < hp; ++hh)
          block_values_heads<NC>(vb + hh * W, row, nt, scores.data() + hh * G * L + t0, L,
                                 acc.data() + hh * G * D, G);
      }
      T* os = out + (s * H + h0 * G) * D;
      for (int64_t i = 0; i < hp * G * D; ++i) os[i] = static_cast<T>(acc[i]);
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// paged_decode_cpu.cpp: its AVX2 kernel, reading the int8 rows into its float tile.
template <typename T>
bool decode_int8_avx2(const T* q, const int8_t* kc, const int8_t* vc, const int32_t* tables,
                      const int32_t* ctx, const int32_t* skip,
                      T* out, int64_t n, int64_t H, int64_t KVH, int64_t D,
                      int64_t BS, int64_t max_blocks, float scale, float softcap);
#define SUBWAY_INT8_AVX2 1
#endif

template <typename T>
static void dispatch_int8(const T* q, const int8_t* kc, const int8_t* vc, const int32_t* tables,
                          const int32_t* ctx, const int32_t* skip,
                          T* out, int64_t n, int64_t H, int64_t KVH,
                          int64_t D, int64_t BS, int64_t max_blocks, float scale, float softcap,
                          bool generic) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (!generic) switch (D) {
      case 16: return decode_int8_avx512<T, 1>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 32: return decode_int8_avx512<T, 2>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 64: return decode_int8_avx512<T, 4>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 128: return decode_int8_avx512<T, 8>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 256: return decode_int8_avx512<T, 16>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      default: break;
    }
  }
#endif
#if defined(SUBWAY_INT8_AVX2)
  if constexpr (!std::is_same_v<T, double>) {
    if (!generic &&
        decode_int8_avx2<T>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, D, BS, max_blocks, scale, softcap))
      return;
  }
#endif
  decode_int8_generic<T>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, D, BS, max_blocks, scale, softcap);
}

// Called by paged_decode (paged_decode_cpu.cpp) for an int8 cache, after the checks every
// layout shares (ranks, int32 tables, contiguous caches of one shape): the int8 ones here.
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_tables, torch::Tensor context_lens,
                                const int32_t* skip, double scale, double softcap, bool generic) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kInt8 && v_cache.scalar_type() == torch::kInt8,
              "paged_decode: an 8-bit cache is int8, keys and values");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D + kScaleBytes,
              "paged_decode: head shapes do not match (an int8 cache row is head_dim + 4)");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_int8", [&] {
    dispatch_int8<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(),
                            v_cache.data_ptr<int8_t>(), block_tables.data_ptr<int32_t>(),
                            context_lens.data_ptr<int32_t>(), skip, out.data_ptr<scalar_t>(), n, H,
                            KVH, D, BS, block_tables.size(1), static_cast<float>(scale),
                            static_cast<float>(softcap), generic);
  });
  return out;
}
