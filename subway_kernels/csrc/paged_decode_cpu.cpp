// Paged decode attention for the CPU: one query token per sequence, keys and values read
// in place from the block-paged caches (no gather copy), GQA; scores, softmax, then values.
//
// q            [n, num_heads, head_dim]
// k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same);
//              an int8 cache goes to paged_decode_int8_cpu.cpp
// block_tables [n, max_blocks] int32
// context_lens [n] int32
// skip         [n] int32 or None (sliding windows): a sequence's first keys that lie before its
//              window, fewer than its context; they weigh 0 in every path below (each
//              path's softmax runs from the first key in the window, `softmax_from`)
// softcap      0, or a positive cap (Gemma 2): every path's scaled scores are soft-capped,
//              softcap * tanh(score / softcap), before its softmax (`softmax_from` again)
// returns      [n, num_heads, head_dim], q's dtype
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <omp.h>
#include "vec_math.h"

// Element loads as float. bfloat16 is the top half of a float32: a shift, which vectorises.
template <typename T>
static inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    dst[i] = f;
  }
}

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* tables,
                          const int32_t* ctx, const int32_t* skip,
                          T* out, int64_t n, int64_t H, int64_t KVH,
                          int64_t D, int64_t BS, int64_t max_blocks, float scale,
                          float softcap) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // stride between consecutive tokens of one block
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
        load_row(kc + ((int64_t)table[t / BS] * BS + t % BS) * row + h * D, row_f.data(), D);
        const float* k = row_f.data();
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          scores[g * L + t] = dot;
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_from(scores.data() + g * L, L, S, softcap, softmax);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        load_row(vc + ((int64_t)table[t / BS] * BS + t % BS) * row + h * D, row_f.data(), D);
        const float* v = row_f.data();
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(s * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}


#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
// Ask for the next block's rows of one head while this block is computed (into L2: filling
// L1 directly ties up its few line-fill buffers, measured 10% slower on AVX-512): blocks
// are scattered, so the hardware prefetcher cannot follow from one block to the next. Both
// fast paths (AVX-512, AVX2) use it.
template <typename T>
static inline void prefetch_block(const T* first_row, int64_t rows, int64_t row_stride,
                                  int64_t row_bytes) {
  for (int64_t j = 0; j < rows; ++j) {
    const char* p = reinterpret_cast<const char*>(first_row + j * row_stride);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }
}

#endif

#if defined(__AVX512F__)
// The fast path, AVX-512: head_dim 16, 32, 64, 128 or 256 (Gemma 3) (NC chunks of 16 floats).
// One work item is one (sequence, KV head) and its G query heads. Each block of BS keys is
// converted to float once into a small tile, then every query head of the group reads it
// from L1: the scores with one FMA chain and one horizontal sum per key, the values with
// NC accumulators per query head held in registers across the block.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The scores of up to 16 keys (rows of `kb`, `row` elements apart) against one query head.
// bfloat16 with AVX512-BF16: pairwise dot products straight from the cache (q unscaled in
// bfloat16, the scale applied to the sums); otherwise from the float tile, q pre-scaled.
template <typename T, int NC>
static inline __m512 block_scores(const T* kb, int64_t row, const float* tile, int64_t tile_row,
                                  const float* qf, const T* qraw, float scale, int64_t nt) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && NC % 2 == 0) {
    __m512 part[16];
    __m512bh qb[NC / 2];
    for (int c = 0; c < NC / 2; ++c)
      qb[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(qraw + c * 32));
    for (int64_t j = 0; j < 16; ++j) {
      __m512 a = _mm512_setzero_ps();
      if (j < nt)
        for (int c = 0; c < NC / 2; ++c)
          a = _mm512_dpbf16_ps(
              a, qb[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kb + j * row + c * 32)));
      part[j] = a;
    }
    return _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale));
  }
#endif
  __m512 qg[NC];
  for (int c = 0; c < NC; ++c) qg[c] = _mm512_loadu_ps(qf + c * 16);
  alignas(64) float out[16] = {};
  for (int64_t j = 0; j < nt; ++j) {  // (measured: the tree is slower here than per-key sums)
    const float* k = tile + j * tile_row;
    __m512 a = _mm512_mul_ps(qg[0], _mm512_loadu_ps(k));
    for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qg[c], _mm512_loadu_ps(k + c * 16), a);
    out[j] = _mm512_reduce_add_ps(a);
  }
  return _mm512_load_ps(out);
}

template <typename T, int NC>
#if defined(__AVX512BF16__)
static constexpr bool kDirectScores = std::is_same_v<T, c10::BFloat16> && NC % 2 == 0;
#else
static constexpr bool kDirectScores = false;
#endif

// The values of up to BS keys (rows of `vb`, `row` elements apart) weighted into GN query
// heads' accumulators at once: each value row is loaded (and widened) once for all GN heads,
// and the GN * NC accumulator chains run side by side.
template <typename T, int NC, int GN>
static inline void block_values(const T* vb, int64_t row, int64_t nt, const float* p,
                                int64_t p_stride, float* acc) {
  __m512 a[GN][NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * NC * 16 + c * 16);
  for (int64_t j = 0; j < nt; ++j) {
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(vb + j * row + c * 16);
    for (int g = 0; g < GN; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * p_stride + j]);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * NC * 16 + c * 16, a[g][c]);
}

// All G query heads of one KV head, in groups that keep the accumulators in registers.
template <typename T, int NC>
static inline void block_values_heads(const T* vb, int64_t row, int64_t nt, const float* p,
                                      int64_t L, float* acc, int64_t G) {
  constexpr int64_t D = NC * 16;
  int64_t g = 0;
  if constexpr (NC <= 4) {
    for (; G - g >= 4; g += 4) block_values<T, NC, 4>(vb, row, nt, p + g * L, L, acc + g * D);
    if (G - g == 3) {
      block_values<T, NC, 3>(vb, row, nt, p + g * L, L, acc + g * D);
      return;
    }
  }
  for (; G - g >= 2; g += 2) block_values<T, NC, 2>(vb, row, nt, p + g * L, L, acc + g * D);
  if (G - g == 1) block_values<T, NC, 1>(vb, row, nt, p + g * L, L, acc + g * D);
}

template <typename T, int NC>
static void decode_kernel_avx512(const T* q, const T* kc, const T* vc, const int32_t* tables,
                                 const int32_t* ctx, const int32_t* skip,
                                 T* out, int64_t n, int64_t H, int64_t KVH,
                                 int64_t BS, int64_t max_blocks, float scale, float softcap) {
  constexpr int64_t D = NC * 16;
  constexpr bool direct = kDirectScores<T, NC>;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;
  // One work item is a sequence with all its KV heads, so that each block is read as one
  // contiguous run (the heads of a token are adjacent); with fewer sequences than two per
  // thread, one (sequence, KV head) each, so that every thread has work. Longest contexts
  // first, handed out one at a time: contexts of a batch differ by 100x.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t split = n >= 2 * threads ? 1 : KVH;  // items per sequence
  const int64_t hp = KVH / split;                     // KV heads per item
  const int64_t items = n * split;
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ctx[a] > ctx[b]; });
  const int64_t run_bytes = hp * D * (int64_t)sizeof(T);  // one token's heads of an item
#pragma omp parallel num_threads(std::min<int64_t>(threads, items))
  {
    std::vector<float> qf(hp * G * D), tile(BS * hp * D), scores, acc(hp * G * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < items; ++k) {
      const int64_t s = order[k / split], h0 = (k % split) * hp;
      const int64_t L = ctx[s], S = skip ? skip[s] : 0;  // S: keys before the window
      const int32_t* table = tables + s * max_blocks;
      const T* qs = q + (s * H + h0 * G) * D;  // this item's hp * G query heads, in order
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < hp * G; ++i)
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(qf.data() + i * D + c * 16,
                           _mm512_mul_ps(load16(qs + i * D + c * 16), vscale));
      scores.resize(hp * G * L);
      // Scores q.k for every key.
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t nt = std::min(BS, L - t0);
        const T* kb = kc + (int64_t)table[t0 / BS] * BS * row + h0 * D;
        if (t0 + BS < L)
          prefetch_block(kc + (int64_t)table[t0 / BS + 1] * BS * row + h0 * D,
                         std::min(BS, L - t0 - BS), row, run_bytes);
        if (!direct)
          for (int64_t j = 0; j < nt; ++j)
            for (int64_t c = 0; c < hp * NC; ++c)
              _mm512_storeu_ps(tile.data() + j * hp * D + c * 16, load16(kb + j * row + c * 16));
        for (int64_t j0 = 0; j0 < nt; j0 += 16) {  // blocks larger than 16: in pieces of 16
          const int64_t m = std::min<int64_t>(16, nt - j0);
          const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1u);
          for (int64_t hh = 0; hh < hp; ++hh)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t i = hh * G + g;
              const __m512 sc = block_scores<T, NC>(
                  kb + j0 * row + hh * D, row, tile.data() + (j0 * hp + hh) * D, hp * D,
                  qf.data() + i * D, qs + i * D, scale, m);
              _mm512_mask_storeu_ps(scores.data() + i * L + t0 + j0, valid, sc);
            }
        }
      }
      for (int64_t i = 0; i < hp * G; ++i) softmax_from(scores.data() + i * L, L, S, softcap, softmax16);
      // Weighted sum of the values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t nt = std::min(BS, L - t0);
        const T* vb = vc + (int64_t)table[t0 / BS] * BS * row + h0 * D;
        if (t0 + BS < L)
          prefetch_block(vc + (int64_t)table[t0 / BS + 1] * BS * row + h0 * D,
                         std::min(BS, L - t0 - BS), row, run_bytes);
        for (int64_t hh = 0; hh < hp; ++hh)
          block_values_heads<T, NC>(vb + hh * D, row, nt, scores.data() + hh * G * L + t0, L,
                                    acc.data() + hh * G * D, G);
      }
      T* os = out + (s * H + h0 * G) * D;
      for (int64_t i = 0; i < hp * G * D; ++i) os[i] = static_cast<T>(acc[i]);
    }
  }
}

static constexpr bool kHaveAvx512 = true;
#else
static constexpr bool kHaveAvx512 = false;
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The AVX2 path (CPUs without AVX-512, such as AMD's before Zen 4): the AVX-512 path's
// plan on 8 lanes, head_dim 16, 32, 64, 128 or 256 (NC chunks of 8 floats). A work item
// is a sequence with all its KV heads (one (sequence, KV head) each when sequences are
// few). Each key row is widened to float once, in registers, and every query head of the
// item takes it: scores with one FMA chain per key and an 8-key horizontal-add tree; the
// softmax on vectors (`softmax8`); each block of values is widened once into a tile in L1,
// which every query head then reads, with NC accumulators in registers across the block.
// (The 8-bit cache still widens its keys into the tile, with their row scales.) The next
// block is prefetched, as on AVX-512: from a cold cache (a 128 MB read between calls, as a
// step's weights leave it) one sequence's call took 1.14x less time at 200 keys and 1.21x
// at 800, level at 16 and 64 sequences (2-core AVX2 EPYC, an ad-hoc A/B of two builds, the
// same output).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) { return widen_bf16_8(p); }
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lane j: the sum of the 8 lanes of v[j].
static inline __m256 sum_lanes8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of `nt` (<= 8) keys, rows of the float tile `tile_row` apart, against query `qf`.
template <int NC>
static inline void scores8(const float* tile, int64_t tile_row, const float* qf, int64_t nt,
                           float* out) {
  __m256 part[8];
  for (int64_t j = 0; j < 8; ++j) {
    __m256 a = _mm256_setzero_ps();
    if (j < nt) {
      const float* k = tile + j * tile_row;
      for (int c = 0; c < NC; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + c * 8), _mm256_loadu_ps(k + c * 8), a);
    }
    part[j] = a;
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sum_lanes8(part));
  for (int64_t j = 0; j < nt; ++j) out[j] = sums[j];
}

// 8 int8 values as floats.
static inline __m256 widen_i8_8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The scores of m (<= 8) keys, rows `row` apart from `kr0` (one KV head's part), against
// that KV head's G query heads (`qf`, rows of NC * 8 floats, pre-scaled): each key row
// widened once into registers, one FMA chain per key and query head, then an 8-key lane-sum
// tree; into out[g * L + j]. `part` holds G * 8 vectors. Both AVX2 paths' scores, one way.
template <typename T, int NC>
static inline void key_scores8(const T* kr0, int64_t row, int64_t m, const float* qf, int64_t G,
                               __m256* part, float* out, int64_t L) {
  constexpr int64_t D = NC * 8;
  for (int64_t j = 0; j < 8; ++j) {
    if (j >= m) {
      for (int64_t g = 0; g < G; ++g) part[g * 8 + j] = _mm256_setzero_ps();
      continue;
    }
    const T* kr = kr0 + j * row;
    __m256 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = load8(kr + c * 8);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 a = _mm256_setzero_ps();
      for (int c = 0; c < NC; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c * 8), kv[c], a);
      part[g * 8 + j] = a;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum_lanes8(part + g * 8));
    for (int64_t j = 0; j < m; ++j) out[g * L + j] = sums[j];
  }
}

// Fewer (sequence, KV head) items than two a thread (one sequence of SmolLM2's 3 KV heads
// on 2 threads): one item each would leave a thread idle for a third of the call. Here every
// thread works on each sequence in turn, in three phases with a barrier between them: the
// scores of its share of the key blocks (every head), the softmax of its share of the
// query heads' rows, then its share of the (query head, 8-float chunk) accumulators, each
// summed over every key in order. Each score, row and chunk is computed exactly as
// decode_kernel_avx2 computes it (the same chains and lane sums), so the output is the same
// to the bit; only the work is split another way.
template <typename T, int NC>
static void decode_few_avx2(const T* q, const T* kc, const T* vc, const int32_t* tables,
                            const int32_t* ctx, const int32_t* skip,
                            T* out, int64_t n, int64_t H, int64_t KVH,
                            int64_t BS, int64_t max_blocks, float scale, float softcap,
                            int64_t threads) {
  constexpr int64_t D = NC * 8;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;
  int64_t max_len = 0;
  for (int64_t s = 0; s < n; ++s) max_len = std::max<int64_t>(max_len, ctx[s]);
  std::vector<float> scores(H * max_len);  // shared: each phase reads what others wrote
#pragma omp parallel num_threads(threads)
  {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    std::vector<float> qf(H * D);
    std::vector<__m256> part(G * 8);
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t s = 0; s < n; ++s) {
      const int64_t L = ctx[s], S = skip ? skip[s] : 0;  // S: keys before the window
      const int32_t* table = tables + s * max_blocks;
      const T* qs = q + s * H * D;
      for (int64_t i = 0; i < H; ++i)
        for (int c = 0; c < NC; ++c)
          _mm256_storeu_ps(qf.data() + i * D + c * 8, _mm256_mul_ps(load8(qs + i * D + c * 8), vscale));
      // Scores: this thread's run of key blocks, every KV head and query head.
      const int64_t blocks = (L + BS - 1) / BS;
      const int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t t0 = blk * BS, nt = std::min(BS, L - t0);
        const T* kb = kc + (int64_t)table[blk] * BS * row;
        if (blk + 1 < b1)
          prefetch_block(kc + (int64_t)table[blk + 1] * BS * row, std::min(BS, L - t0 - BS), row,
                         row * (int64_t)sizeof(T));
        for (int64_t j0 = 0; j0 < nt; j0 += 8) {
          const int64_t m = std::min<int64_t>(8, nt - j0);
          for (int64_t hh = 0; hh < KVH; ++hh)
            key_scores8<T, NC>(kb + j0 * row + hh * D, row, m, qf.data() + hh * G * D, G,
                               part.data(), scores.data() + hh * G * L + t0 + j0, L);
        }
      }
#pragma omp barrier
      for (int64_t i = H * tid / nth; i < H * (tid + 1) / nth; ++i)
        softmax_from(scores.data() + i * L, L, S, softcap, softmax8);
#pragma omp barrier
      // Values: this thread's run of (query head, chunk) accumulators, over every key.
      const int64_t c0 = H * NC * tid / nth, c1 = H * NC * (tid + 1) / nth;
      T* os = out + s * H * D;
      for (int64_t ic = c0; ic < c1;) {
        const int64_t i = ic / NC, hh = i / G, cb = ic % NC;
        const int64_t ce = std::min<int64_t>(NC, cb + (c1 - ic));  // chunks [cb, ce) of head i
        const float* p = scores.data() + i * L;
        __m256 a[NC];
        for (int64_t c = cb; c < ce; ++c) a[c] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t t0 = blk * BS, nt = std::min(BS, L - t0);
          const T* vb = vc + (int64_t)table[blk] * BS * row + hh * D;
          for (int64_t j = 0; j < nt; ++j) {
            const __m256 pj = _mm256_set1_ps(p[t0 + j]);
            for (int64_t c = cb; c < ce; ++c)
              a[c] = _mm256_fmadd_ps(pj, load8(vb + j * row + c * 8), a[c]);
          }
        }
        for (int64_t c = cb; c < ce; ++c) {
          alignas(32) float v[8];
          _mm256_store_ps(v, a[c]);
          for (int d = 0; d < 8; ++d) os[i * D + c * 8 + d] = static_cast<T>(v[d]);
        }
        ic += ce - cb;
      }
#pragma omp barrier
    }
  }
}

// C is the cache's element: T, or int8_t for the 8-bit cache (`--kv-cache-dtype int8`), whose
// rows are head_dim values and then their float32 scale (paged_decode_int8_cpu.cpp). Its
// rows are widened into the same float tile; each key's scale then multiplies its scores,
// each value's scale its weights (as the AVX-512 int8 kernel does).
template <typename T, int NC, typename C = T>
static void decode_kernel_avx2(const T* q, const C* kc, const C* vc, const int32_t* tables,
                               const int32_t* ctx, const int32_t* skip,
                               T* out, int64_t n, int64_t H, int64_t KVH,
                               int64_t BS, int64_t max_blocks, float scale, float softcap) {
  constexpr int64_t D = NC * 8;
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  constexpr int64_t W = kInt8 ? D + 4 : D;  // one head's row, in elements of C
  const int64_t G = H / KVH;
  const int64_t row = KVH * W;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if constexpr (!kInt8) {
    if (threads > 1 && n * KVH < 2 * threads && KVH % threads != 0)
      return decode_few_avx2<T, NC>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks,
                                    scale, softcap, threads);
  }
  const int64_t split = n >= 2 * threads ? 1 : KVH;  // items per sequence
  const int64_t hp = KVH / split;                     // KV heads per item
  const int64_t items = n * split;
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ctx[a] > ctx[b]; });
  const int64_t run_bytes = hp * W * (int64_t)sizeof(C);  // one token's heads of an item
#pragma omp parallel num_threads(std::min<int64_t>(threads, items))
  {
    std::vector<float> qf(hp * G * D), tile(BS * hp * D), scores, acc(hp * G * D);
    std::vector<float> rs(kInt8 ? BS * hp : 0);  // the block's row scales (int8 cache)
    std::vector<__m256> part(kInt8 ? 0 : G * 8);  // 8 keys' partial scores, per query head
    // A block's nt rows of this item's heads, widened into the tile (and their scales).
    auto widen_block = [&](const C* b, int64_t nt) {
      const int64_t tr = hp * D;
      if constexpr (kInt8) {
        for (int64_t j = 0; j < nt; ++j)
          for (int64_t hh = 0; hh < hp; ++hh) {
            const int8_t* r = b + j * row + hh * W;
            std::memcpy(&rs[hh * BS + j], r + D, sizeof(float));
            for (int c = 0; c < NC; ++c)
              _mm256_storeu_ps(tile.data() + j * tr + hh * D + c * 8, widen_i8_8(r + c * 8));
          }
      } else {
        for (int64_t j = 0; j < nt; ++j)
          for (int64_t c = 0; c < hp * NC; ++c)
            _mm256_storeu_ps(tile.data() + j * tr + c * 8, load8(b + j * row + c * 8));
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < items; ++k) {
      const int64_t s = order[k / split], h0 = (k % split) * hp;
      const int64_t L = ctx[s], S = skip ? skip[s] : 0;  // S: keys before the window
      const int32_t* table = tables + s * max_blocks;
      const T* qs = q + (s * H + h0 * G) * D;
      const __m256 vscale = _mm256_set1_ps(scale);
      for (int64_t i = 0; i < hp * G; ++i)
        for (int c = 0; c < NC; ++c)
          _mm256_storeu_ps(qf.data() + i * D + c * 8, _mm256_mul_ps(load8(qs + i * D + c * 8), vscale));
      scores.resize(hp * G * L);
      const int64_t tr = hp * D;  // a tile row: one token's heads of this item
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t nt = std::min(BS, L - t0);
        const C* kb = kc + (int64_t)table[t0 / BS] * BS * row + h0 * W;
        if (t0 + BS < L)
          prefetch_block(kc + (int64_t)table[t0 / BS + 1] * BS * row + h0 * W,
                         std::min(BS, L - t0 - BS), row, run_bytes);
        if constexpr (!kInt8) {
          // Keys straight from the cache: each key row widened once into registers, then
          // every query head of its KV head takes it, with scores8's chains and lane sums
          // (the same bits). Against widening the block into the tile first, a batch-64
          // step's attention took 35.8 against 50.9 ms (`profile_step --batch 64`, medians
          // of three alternating builds; 2-core AVX2 EPYC, docs/BENCHMARKS.md).
          for (int64_t j0 = 0; j0 < nt; j0 += 8) {
            const int64_t m = std::min<int64_t>(8, nt - j0);
            for (int64_t hh = 0; hh < hp; ++hh)
              key_scores8<C, NC>(kb + j0 * row + hh * W, row, m, qf.data() + hh * G * D, G,
                                 part.data(), scores.data() + hh * G * L + t0 + j0, L);
          }
          continue;
        }
        widen_block(kb, nt);
        for (int64_t j0 = 0; j0 < nt; j0 += 8) {
          const int64_t m = std::min<int64_t>(8, nt - j0);
          for (int64_t hh = 0; hh < hp; ++hh)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t i = hh * G + g;
              float* sc = scores.data() + i * L + t0 + j0;
              scores8<NC>(tile.data() + j0 * tr + hh * D, tr, qf.data() + i * D, m, sc);
              if constexpr (kInt8)
                for (int64_t j = 0; j < m; ++j) sc[j] *= rs[hh * BS + j0 + j];
            }
        }
      }
      for (int64_t i = 0; i < hp * G; ++i) softmax_from(scores.data() + i * L, L, S, softcap, softmax8);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t nt = std::min(BS, L - t0);
        const C* vb = vc + (int64_t)table[t0 / BS] * BS * row + h0 * W;
        if (t0 + BS < L)
          prefetch_block(vc + (int64_t)table[t0 / BS + 1] * BS * row + h0 * W,
                         std::min(BS, L - t0 - BS), row, run_bytes);
        widen_block(vb, nt);
        for (int64_t hh = 0; hh < hp; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t i = hh * G + g;
            const float* p = scores.data() + i * L + t0;
            float* ai = acc.data() + i * D;
            __m256 a[NC];
            for (int c = 0; c < NC; ++c) a[c] = _mm256_loadu_ps(ai + c * 8);
            for (int64_t j = 0; j < nt; ++j) {
              const __m256 pj = _mm256_set1_ps(kInt8 ? p[j] * rs[hh * BS + j] : p[j]);
              const float* v = tile.data() + j * tr + hh * D;
              for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + c * 8), a[c]);
            }
            for (int c = 0; c < NC; ++c) _mm256_storeu_ps(ai + c * 8, a[c]);
          }
      }
      T* os = out + (s * H + h0 * G) * D;
      for (int64_t i = 0; i < hp * G * D; ++i) os[i] = static_cast<T>(acc[i]);
    }
  }
}
static constexpr bool kHaveAvx2 = true;

// For paged_decode_int8_cpu.cpp: the AVX2 kernel over an 8-bit cache, where the head size
// suits it (head_dim 16, 32, 64, 128 or 256); false where it does not, for the generic kernel.
template <typename T>
bool decode_int8_avx2(const T* q, const int8_t* kc, const int8_t* vc, const int32_t* tables,
                      const int32_t* ctx, const int32_t* skip,
                      T* out, int64_t n, int64_t H, int64_t KVH, int64_t D,
                      int64_t BS, int64_t max_blocks, float scale, float softcap) {
  switch (D) {
    case 16: decode_kernel_avx2<T, 2, int8_t>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap); return true;
    case 32: decode_kernel_avx2<T, 4, int8_t>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap); return true;
    case 64: decode_kernel_avx2<T, 8, int8_t>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap); return true;
    case 128: decode_kernel_avx2<T, 16, int8_t>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap); return true;
    case 256: decode_kernel_avx2<T, 32, int8_t>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap); return true;
    default: return false;
  }
}
template bool decode_int8_avx2<float>(const float*, const int8_t*, const int8_t*, const int32_t*,
                                      const int32_t*, const int32_t*, float*, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, int64_t, float, float);
template bool decode_int8_avx2<c10::BFloat16>(const c10::BFloat16*, const int8_t*, const int8_t*,
                                              const int32_t*, const int32_t*, const int32_t*,
                                              c10::BFloat16*, int64_t, int64_t, int64_t, int64_t,
                                              int64_t, int64_t, float, float);
template bool decode_int8_avx2<c10::Half>(const c10::Half*, const int8_t*, const int8_t*,
                                          const int32_t*, const int32_t*, const int32_t*,
                                          c10::Half*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          int64_t, float, float);
#else
static constexpr bool kHaveAvx2 = false;
#endif

// The fast kernel where the machine and the head size allow, else the generic one.
template <typename T>
static void dispatch(const T* q, const T* kc, const T* vc, const int32_t* tables,
                     const int32_t* ctx, const int32_t* skip,
                     T* out, int64_t n, int64_t H, int64_t KVH, int64_t D,
                     int64_t BS, int64_t max_blocks, float scale, float softcap, bool generic) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (!generic) switch (D) {
      case 16: return decode_kernel_avx512<T, 1>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 32: return decode_kernel_avx512<T, 2>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 64: return decode_kernel_avx512<T, 4>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 128: return decode_kernel_avx512<T, 8>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 256: return decode_kernel_avx512<T, 16>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      default: break;
    }
  }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (!std::is_same_v<T, double>) {
    if (!generic) switch (D) {
      case 16: return decode_kernel_avx2<T, 2>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 32: return decode_kernel_avx2<T, 4>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 64: return decode_kernel_avx2<T, 8>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 128: return decode_kernel_avx2<T, 16>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      case 256: return decode_kernel_avx2<T, 32>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, BS, max_blocks, scale, softcap);
      default: break;
    }
  }
#endif
  decode_kernel<T>(q, kc, vc, tables, ctx, skip, out, n, H, KVH, D, BS, max_blocks, scale, softcap);
}

// paged_decode_int8_cpu.cpp: the same over an 8-bit cache (`--kv-cache-dtype int8`).
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_tables, torch::Tensor context_lens,
                                const int32_t* skip, double scale, double softcap, bool generic);

// `skip` (sliding windows; None: none): per sequence, its first keys that lie before its
// window (fewer than its context), which take no part in the softmax; the caller has
// shifted the block table past the blocks wholly before it (attention.py, WindowMetadata).
// `softcap` (Gemma 2's attn_logit_softcapping; 0: none): the scaled scores are capped,
// softcap * tanh(score / softcap), before the softmax (vec_math.h softmax_from).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           double scale, bool generic, c10::optional<torch::Tensor> skip,
                           double softcap) {
  // What every cache layout needs; the layout's own checks follow in its kernel's entry.
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32, "block_tables must be int32");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt32, "context_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_decode: cache shapes differ");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(softcap >= 0.0, "paged_decode: softcap is 0 (none) or positive");
  const int64_t n = q.size(0);
  torch::Tensor skip_t;
  const int32_t* skip_p = nullptr;
  if (skip.has_value()) {
    skip_t = skip->contiguous();
    TORCH_CHECK(skip_t.scalar_type() == torch::kInt32 && skip_t.numel() == n &&
                    context_lens.numel() >= n, "paged_decode: skip is int32, one per sequence");
    skip_p = skip_t.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    for (int64_t s = 0; s < n; ++s)
      TORCH_CHECK(skip_p[s] >= 0 && skip_p[s] < lens[s], "paged_decode: skip outside [0, context)");
  }
  if (k_cache.scalar_type() == torch::kInt8)
    return paged_decode_int8(q, k_cache, v_cache, block_tables, context_lens, skip_p, scale, softcap,
                             generic);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_decode: q and cache dtypes differ");
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "paged_decode: head shapes do not match");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                       v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                       context_lens.data_ptr<int32_t>(), skip_p, out.data_ptr<scalar_t>(), n, H,
                       KVH, D, BS, block_tables.size(1), static_cast<float>(scale),
                       static_cast<float>(softcap), generic);
  });
  return out;
}

// The decode kernels' soft-capping on its own, for tests of its tanh's accuracy.
void softcap_rows(torch::Tensor x, double cap, bool scalar) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && cap > 0.0,
              "softcap_rows: contiguous float32 values, cap > 0");
  softcap_row(x.data_ptr<float>(), x.numel(), static_cast<float>(cap), scalar);
}

// ops_cpu.cpp
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps);
torch::Tensor rope_write_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                            torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots);

torch::Tensor silu_and_mul(torch::Tensor x);
bool silu_and_mul_supported();

// mask_cpu.cpp
void apply_token_bitmask(torch::Tensor scores, torch::Tensor bitmask, std::vector<int64_t> rows);

// argmax_cpu.cpp
torch::Tensor argmax_rows(torch::Tensor x);

// gemv_cpu.cpp
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor small_linear_pack(torch::Tensor w);
bool small_linear_supported();
int64_t small_linear_rows();

// decode_layers_cpu.cpp
std::vector<torch::Tensor> decode_layers(torch::Tensor h, torch::Tensor positions,
                                         torch::Tensor cos_sin, torch::Tensor slots,
                                         torch::Tensor block_tables, torch::Tensor context_lens,
                                         std::vector<torch::Tensor> k_caches,
                                         std::vector<torch::Tensor> v_caches,
                                         std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> biases,
                                         std::vector<torch::Tensor> scales, int64_t int8_path,
                                         int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, double eps, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers,
        "Every decoder layer of a few-row decode step in one call, the same kernels as the "
        "model's Python loop (CPU)");
  m.def("paged_decode", &paged_decode, "Paged decode attention (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("generic") = false, py::arg("skip") = py::none(),
        py::arg("softcap") = 0.0);
  m.def("softcap_rows", &softcap_rows,
        "x = cap * tanh(x / cap) over float32 values, in place, as the decode kernels cap their "
        "scores (vec_math.h softcap_row; `scalar`: its scalar tanh only): for tests");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding the residual (CPU)");
  m.def("rope_write_kv", &rope_write_kv, "Rotary q and k; k and v written to the caches (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "A grammar's packed token mask on some rows of float32 logits: the rest to -inf (CPU)");
  m.def("small_linear", &small_linear, "bfloat16 linear of a few rows (small_linear_rows), AVX512-BF16 or AVX2 (CPU)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("small_linear_pack", &small_linear_pack,
        "A bfloat16 weight [out, in] in the layout small_linear reads: on AVX2 its own (blocks "
        "of 16 outputs, [in][16] each; the same shape), elsewhere the weight itself");
  m.def("silu_and_mul", &silu_and_mul,
        "silu(gate) * up of bfloat16 rows, rounded as the reference rounds (CPU)");
  m.def("silu_and_mul_supported", &silu_and_mul_supported,
        "Whether silu_and_mul was compiled (AVX512-BF16)");
  m.def("argmax_rows", &argmax_rows,
        "First index of each row's largest value, bfloat16 rows without a float copy (CPU)");
  m.def("small_linear_supported", &small_linear_supported,
        "Whether small_linear was compiled (AVX512-BF16 or AVX2)");
  m.def("small_linear_rows", &small_linear_rows,
        "The most rows of x for which callers should take small_linear");
  m.def("has_avx512", [] { return kHaveAvx512; }, "Whether the AVX-512 fast path was compiled");
  m.def("has_avx2", [] { return kHaveAvx2; },
        "Whether the AVX2 fast path was compiled (machines without AVX-512)");
}
