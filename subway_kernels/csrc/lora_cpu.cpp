// Batched multi-LoRA for a mixed batch (Punica's SGMV, S-LoRA): each segment of rows adds the
// delta of its own adapter slot, y[r] += B[s] (A[s] x[r]), in one call for every adapter.
//
//   x [rows, in], y [rows, out], same dtype (rows may be strided; each row contiguous);
//   a [S, P*R, in]: the A matrices of S slots, P parts (q/k/v of a fused projection) of rank R
//     (each A row contiguous);
//   b [S, out, R]: the B matrices, already scaled; part p owns outputs bounds[p]..bounds[p+1].
//     Either layout: contiguous (each output's R values together), or the transpose of a
//     contiguous [S, R, out] (b.stride(1) == 1: each j's outputs together), which is read as
//     it is; the first is transposed, a block at a time, in each call;
//   seg_start [G+1], seg_slot [G] (int32 or int64, CPU): segment g is rows
//     seg_start[g]..seg_start[g+1], with slot seg_slot[g] (-1: no adapter, rows untouched);
//   rows (optional, int32 or int64, CPU, each row at most once): the segments then index it,
//     segment g being rows rows[seg_start[g]]..rows[seg_start[g+1] - 1], read and written in
//     place: the rows of one adapter grouped without gathering them.
//
// Two passes, each an at::parallel_for over tasks:
//   shrink: t[r, i] = a[s, i, :] . x[r, :] in float32, for every row of an adapter's segment;
//     a task is (segment, block of kShrinkBlock A rows, chunk of up to kRowChunk rows); a
//     tile keeps the sums of up to kRowTile rows by 4 A rows in registers, W lanes each,
//     over `in`, then adds each one's lanes;
//   expand: y[r, o] = round(y[r, o] + sum_j t[r, p R + j] b[s, o, j]), for every output;
//     a task is (segment, part, block of kExpandBlock outputs, chunk of rows); a tile keeps
//     up to 4 rows by 2 vectors of W outputs, one lane per output, and adds j = 0..R-1 in
//     order with fused multiply-adds from zero, each B value (in the [R, out] layout: a
//     vector of W outputs) loaded once for all the tile's rows.
// Tasks are ordered weight block first and rows last, so that at::parallel_for's contiguous
// split gives each thread its own share of an adapter's weights: each block is read from
// memory once per call and from L1 for the other rows of its segment. A pass with less than
// kMinWorkPerThread multiply-adds for each thread runs on fewer threads (one at one row).
//
// Batch invariance: every t[r, i] and every y[r, o] is summed by the same instructions in
// the same order whatever rows share its call, segment or tile: rows are only grouped to
// share the weights' loads, each row has its own sums, and no block size depends on the
// row count. So a row's output is the same bits alone, in a batch of 64 or in a segment of
// any length, and on any number of threads (and B's two layouts give the same bits).
//
// AVX-512 (W = 16) or AVX2 with FMA (W = 8), chosen at compile time (-march=native; the
// tests also build it with -mno-avx512f); plain C++ (W = 1) elsewhere. float32 and bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "vec_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int W = 16;
constexpr int kRowTile = 4;  // shrink: 4 rows x 4 A rows = 16 sums, 4 x, 1 a of 32 registers
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vload(const at::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
// The 16 x 16 floats r[0..15] (rows) transposed in place: r[c] becomes column c.
inline void vtranspose(V* r) {
  V t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + q], in each 128-bit block k: rows 4i..4i+3 of column 4k + q
  for (int i = 0; i < 4; ++i) {
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int q = 0; q < 4; ++q) {
    const V v0 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x88);
    const V v1 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xDD);
    const V w0 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x88);
    const V w1 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xDD);
    r[q] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + q] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[4 + q] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + q] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
// Round to nearest even, as at::BFloat16 does (NaN to a quiet NaN).
inline __m256i round_bf16(V v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void vstore(at::BFloat16* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16(v));
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define SUBWAY_LORA_MASKED 1  // the first n lanes: masked loads and stores (no fault past them)
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline V vload_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline V vload_n(const at::BFloat16* p, int64_t n) {
  return widen_bf16(_mm256_maskz_loadu_epi16(first_lanes(n), p));
}
inline void vstore_n(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline void vstore_n(at::BFloat16* p, V v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first_lanes(n), round_bf16(v));
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
constexpr int W = 8;
constexpr int kRowTile = 2;  // shrink: 2 rows x 4 A rows = 8 sums, 2 x, 1 a of 16 registers
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vload(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vset1(float f) { return _mm256_set1_ps(f); }
// The 8 x 8 floats r[0..7] (rows) transposed in place: r[c] becomes column c.
inline void vtranspose(V* r) {
  V t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + q], in each 128-bit half k: rows 4i..4i+3 of column 4k + q
  for (int i = 0; i < 2; ++i) {
    const __m256d t0 = _mm256_castps_pd(t[4 * i]), t1 = _mm256_castps_pd(t[4 * i + 1]);
    const __m256d t2 = _mm256_castps_pd(t[4 * i + 2]), t3 = _mm256_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
    u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
    u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
    u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x20);
    r[4 + q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x31);
  }
}
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void vstore(at::BFloat16* p, V v) {  // round to nearest even, NaN to a quiet NaN
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

#else  // plain C++: one lane
constexpr const char* kIsa = "scalar";
constexpr int W = 1;
constexpr int kRowTile = 4;
using V = float;
inline V vzero() { return 0.f; }
inline V vload(const float* p) { return *p; }
inline V vload(const at::BFloat16* p) { return static_cast<float>(*p); }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
inline V vadd(V a, V b) { return a + b; }
inline float vsum(V v) { return v; }
inline V vset1(float f) { return f; }
inline void vtranspose(V*) {}
inline void vstore(float* p, V v) { *p = v; }
inline void vstore(at::BFloat16* p, V v) { *p = static_cast<at::BFloat16>(v); }
#endif

#if !defined(SUBWAY_LORA_MASKED)
// The first n (< W) values at p, the rest zero; and the first n lanes of v stored to p.
template <typename T>
inline V vload_n(const T* p, int64_t n) {
  alignas(64) unsigned char buf[W * sizeof(T)] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return vload(reinterpret_cast<const T*>(buf));
}
template <typename T>
inline void vstore_n(T* p, V v, int64_t n) {
  alignas(64) unsigned char buf[W * sizeof(T)];
  vstore(reinterpret_cast<T*>(buf), v);
  std::memcpy(p, buf, n * sizeof(T));
}
#endif

constexpr int kShrinkRows = 4;        // A rows whose sums a shrink tile keeps at once
constexpr int64_t kShrinkBlock = 8;   // A rows per shrink task
constexpr int64_t kExpandBlock = 64;  // outputs per expand task
constexpr int64_t kRowChunk = 64;     // rows of a segment per task
constexpr int kExpandRows = 4;        // rows per expand tile
constexpr int kExpandVecs = 2;        // vectors of W outputs per expand tile (4 measured
                                      // slower at 64 rows on Zen 4, no faster at one)
constexpr int64_t kBtStride = kExpandVecs * W;  // a row of a transposed block of B
static_assert(kExpandBlock % kBtStride == 0, "expand blocks of whole tiles");
// Multiply-adds a thread should have before a pass forks: less, and fewer threads run it
// (a fork and join costs a few microseconds, about as long as this many multiply-adds).
constexpr int64_t kMinWorkPerThread = 1 << 15;

// ------------------------------------------------------------------ shrink

// sums[m * NI + i] = x row m . A row i, for M rows of x and NI A rows (rows `as` apart).
template <int M, int NI, typename T>
inline void shrink_tile(const T* const* xr, const T* a, int64_t as, int64_t in, float* sums) {
  V acc[M][NI];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < NI; ++i) acc[m][i] = vzero();
  const int64_t body = in - in % W;
  for (int64_t k = 0; k < body; k += W) {
    V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(xr[m] + k);
    for (int i = 0; i < NI; ++i) {
      const V av = vload(a + i * as + k);
      for (int m = 0; m < M; ++m) acc[m][i] = vfma(xv[m], av, acc[m][i]);
    }
  }
  if (body < in) {  // the tail: one more step, zero past the end
    V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload_n(xr[m] + body, in - body);
    for (int i = 0; i < NI; ++i) {
      const V av = vload_n(a + i * as + body, in - body);
      for (int m = 0; m < M; ++m) acc[m][i] = vfma(xv[m], av, acc[m][i]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < NI; ++i) sums[m * NI + i] = vsum(acc[m][i]);
}

template <int M, typename T>
inline void shrink_rows(int ni, const T* const* xr, const T* a, int64_t as, int64_t in,
                        float* sums) {
  switch (ni) {
    case 1: shrink_tile<M, 1>(xr, a, as, in, sums); break;
    case 2: shrink_tile<M, 2>(xr, a, as, in, sums); break;
    case 3: shrink_tile<M, 3>(xr, a, as, in, sums); break;
    default: shrink_tile<M, kShrinkRows>(xr, a, as, in, sums); break;
  }
}

template <typename T>
inline void shrink_any(int m, int ni, const T* const* xr, const T* a, int64_t as, int64_t in,
                       float* sums) {
  static_assert(kRowTile <= 4, "shrink_any takes up to 4 rows");
  switch (m) {
    case 1: shrink_rows<1>(ni, xr, a, as, in, sums); break;
    case 2: shrink_rows<2>(ni, xr, a, as, in, sums); break;
    case 3: shrink_rows<3>(ni, xr, a, as, in, sums); break;
    default: shrink_rows<4>(ni, xr, a, as, in, sums); break;
  }
}

// ------------------------------------------------------------------ expand

// B in its [out, R] layout: a block of n (<= kBtStride) outputs (rows `bo` apart) transposed
// to float32, bt[j * kBtStride + l] = b[l, j]; columns past n are left as they were.
template <typename T>
inline void transpose_b(const T* bb, int64_t bo, int64_t n, int64_t R, float* bt) {
  for (int v = 0; v < kExpandVecs; ++v) {
    const int64_t nv = std::min<int64_t>(W, n - v * W);
    if (nv <= 0) break;
    for (int64_t c = 0; c < R; c += W) {
      const int64_t k = std::min<int64_t>(W, R - c);
      V r[W];
      if (nv == W && k == W) {
        for (int l = 0; l < W; ++l) r[l] = vload(bb + (v * W + l) * bo + c);
      } else {
        for (int l = 0; l < W; ++l) {
          const T* p = bb + (v * W + l) * bo + c;
          r[l] = l >= nv ? vzero() : k == W ? vload(p) : vload_n(p, k);
        }
      }
      vtranspose(r);
      if (k == W) {
        for (int q = 0; q < W; ++q) vstore(bt + (c + q) * kBtStride + v * W, r[q]);
      } else {
        for (int64_t q = 0; q < k; ++q) vstore(bt + (c + q) * kBtStride + v * W, r[q]);
      }
    }
  }
}

// For M rows and the first n (<= NV W) outputs of a block of B in the [R, out] layout (bt,
// rows of j `bs` apart: the transposed block, or b itself): y[l] = round(y[l] + sum_j
// t[j] bt[j][l]), a lane per output, j = 0..R-1 in order from zero. tr: each row's t of the
// part; yr: each row's y at the block's first output.
template <int M, int NV, typename B, typename T>
inline void expand_tile(const B* bt, int64_t bs, int64_t n, int64_t R, const float* const* tr,
                        T* const* yr) {
  int64_t nv[NV];
  bool full = true;
  for (int v = 0; v < NV; ++v) {
    nv[v] = std::min<int64_t>(W, n - v * W);
    full = full && nv[v] == W;
  }
  V acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = vzero();
  for (int64_t j = 0; j < R; ++j) {
    V bv[NV];
    const B* bj = bt + j * bs;
    for (int v = 0; v < NV; ++v) bv[v] = full ? vload(bj + v * W) : vload_n(bj + v * W, nv[v]);
    for (int m = 0; m < M; ++m) {
      const V tv = vset1(tr[m][j]);
      for (int v = 0; v < NV; ++v) acc[m][v] = vfma(tv, bv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) {
      T* yo = yr[m] + v * W;
      if (nv[v] == W) {
        vstore(yo, vadd(vload(yo), acc[m][v]));
      } else {
        vstore_n(yo, vadd(vload_n(yo, nv[v]), acc[m][v]), nv[v]);
      }
    }
}

template <int NV, typename B, typename T>
inline void expand_rows(int m, const B* bt, int64_t bs, int64_t n, int64_t R,
                        const float* const* tr, T* const* yr) {
  static_assert(kExpandRows == 4, "expand_rows takes up to 4 rows");
  switch (m) {
    case 1: expand_tile<1, NV>(bt, bs, n, R, tr, yr); break;
    case 2: expand_tile<2, NV>(bt, bs, n, R, tr, yr); break;
    case 3: expand_tile<3, NV>(bt, bs, n, R, tr, yr); break;
    default: expand_tile<4, NV>(bt, bs, n, R, tr, yr); break;
  }
}

template <typename B, typename T>
inline void expand_any(int m, const B* bt, int64_t bs, int64_t n, int64_t R,
                       const float* const* tr, T* const* yr) {
  static_assert(kExpandVecs == 2 || kExpandVecs == 4, "expand_any takes up to 4 vectors");
  switch ((n + W - 1) / W) {
    case 1: expand_rows<1>(m, bt, bs, n, R, tr, yr); break;
    case 2: expand_rows<2>(m, bt, bs, n, R, tr, yr); break;
    case 3: expand_rows<kExpandVecs == 4 ? 3 : 2>(m, bt, bs, n, R, tr, yr); break;
    default: expand_rows<kExpandVecs>(m, bt, bs, n, R, tr, yr); break;
  }
}

// ------------------------------------------------------------------ the op

struct Task {
  int64_t slot;
  int64_t r0, r1;  // rows
  int64_t c0, c1;  // shrink: A rows; expand: outputs
  int64_t part;    // expand only
};

std::vector<int64_t> read_index(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1, "lora_apply: ", what,
              " must be a 1-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "lora_apply: ", what,
              " must be int32 or int64");
  const at::Tensor c = t.contiguous();
  std::vector<int64_t> v(c.numel());
  if (c.scalar_type() == at::kInt) {
    const int32_t* p = c.data_ptr<int32_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  } else {
    const int64_t* p = c.data_ptr<int64_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  }
  return v;
}

// Runs fn(i) for the tasks i in [0, n), on as many threads as give each enough work.
template <typename F>
void run_tasks(int64_t n, int64_t work_per_task, const F& fn) {
  if (n <= 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, work_per_task));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

// `row_of[i]`: the row of x and y at position i of the segments (segments index positions;
// empty: position i is row i).
template <typename T>
void lora_apply_impl(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                     const at::Tensor& b, const std::vector<int64_t>& bounds,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& slots,
                     const std::vector<int64_t>& row_of) {
  const int64_t in = x.size(1);
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1, R = b.size(2), PR = P * R;
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const int64_t a_slot = a.stride(0), a_row = a.stride(1);
  const int64_t b_slot = b.stride(0), b_out = b.stride(1), b_j = b.stride(2);
  const bool b_by_j = b_out == 1 && !(b_j == 1 && R == 1);  // B's [R, out] layout: read as is
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t G = static_cast<int64_t>(slots.size());
  const int64_t base = starts[0];
  const bool gathered = !row_of.empty();
  const int64_t* rowp = row_of.data();

  std::vector<Task> shrink, expand;
  int64_t longest = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t s = slots[g], r0 = starts[g], r1 = starts[g + 1];
    if (s < 0 || r1 <= r0) continue;
    longest = std::max(longest, r1 - r0);
    for (int64_t i0 = 0; i0 < PR; i0 += kShrinkBlock)
      for (int64_t r = r0; r < r1; r += kRowChunk)
        shrink.push_back({s, r, std::min(r1, r + kRowChunk), i0, std::min(PR, i0 + kShrinkBlock), 0});
    for (int64_t p = 0; p < P; ++p)
      for (int64_t o0 = bounds[p]; o0 < bounds[p + 1]; o0 += kExpandBlock)
        for (int64_t r = r0; r < r1; r += kRowChunk)
          expand.push_back({s, r, std::min(r1, r + kRowChunk), o0,
                            std::min(bounds[p + 1], o0 + kExpandBlock), p});
  }
  if (shrink.empty()) return;

  const int64_t nrows = starts[G] - base;
  std::unique_ptr<float[]> tbuf(new float[nrows * PR]);  // t [rows, P*R]: rows from `base`
  float* t = tbuf.get();
  // Work per task for the thread count: an estimate (segments' rows differ).
  const int64_t task_rows = std::min<int64_t>(kRowChunk, std::max<int64_t>(1, nrows / std::max<int64_t>(1, G)));

  run_tasks(static_cast<int64_t>(shrink.size()), kShrinkBlock * in * task_rows, [&](int64_t id) {
    const Task& k = shrink[id];
    const T* as = ap + k.slot * a_slot;
    const T* xr[4];
    float sums[4 * kShrinkRows];
    for (int64_t i0 = k.c0; i0 < k.c1; i0 += kShrinkRows) {
      const int ni = static_cast<int>(std::min<int64_t>(kShrinkRows, k.c1 - i0));
      for (int64_t r = k.r0; r < k.r1; r += kRowTile) {
        const int m = static_cast<int>(std::min<int64_t>(kRowTile, k.r1 - r));
        for (int j = 0; j < m; ++j) xr[j] = xp + (gathered ? rowp[r + j] : r + j) * xs;
        shrink_any(m, ni, xr, as + i0 * a_row, a_row, in, sums);
        for (int j = 0; j < m; ++j) {
          float* trow = t + (r + j - base) * PR + i0;
          for (int i = 0; i < ni; ++i) trow[i] = sums[j * ni + i];
        }
      }
    }
  });

  run_tasks(static_cast<int64_t>(expand.size()), kExpandBlock * R * task_rows, [&](int64_t id) {
    const Task& k = expand[id];
    const T* bs = bp + k.slot * b_slot;
    const float* tr[kExpandRows];
    T* yr[kExpandRows];
    float* bt = nullptr;
    if (!b_by_j) {
      thread_local std::vector<float> bt_buf;
      if (static_cast<int64_t>(bt_buf.size()) < R * kBtStride) bt_buf.resize(R * kBtStride);
      bt = bt_buf.data();
    }
    for (int64_t o = k.c0; o < k.c1; o += kBtStride) {
      const int64_t n = std::min<int64_t>(kBtStride, k.c1 - o);
      if (!b_by_j) transpose_b(bs + o * b_out, b_out, n, R, bt);
      for (int64_t r = k.r0; r < k.r1; r += kExpandRows) {
        const int m = static_cast<int>(std::min<int64_t>(kExpandRows, k.r1 - r));
        for (int j = 0; j < m; ++j) {
          tr[j] = t + (r + j - base) * PR + k.part * R;
          yr[j] = yp + (gathered ? rowp[r + j] : r + j) * ys + o;
        }
        if (b_by_j) {
          expand_any(m, bs + o, b_j, n, R, tr, yr);
        } else {
          expand_any(m, static_cast<const float*>(bt), kBtStride, n, R, tr, yr);
        }
      }
    }
  });
}

void lora_apply(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                at::IntArrayRef bounds_ref, const at::Tensor& seg_start, const at::Tensor& seg_slot,
                const c10::optional<at::Tensor>& rows_opt) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && a.device().is_cpu() &&
                  b.device().is_cpu(),
              "lora_apply: CPU tensors");
  const auto dt = y.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "lora_apply: float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == dt && a.scalar_type() == dt && b.scalar_type() == dt,
              "lora_apply: y, x, a and b of one dtype");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_apply: y [rows, out], x [rows, in], a [S, P*R, in], b [S, out, R]");
  const int64_t rows = y.size(0), in = x.size(1), out = y.size(1);
  const int64_t S = a.size(0), R = b.size(2);
  TORCH_CHECK((x.stride(1) == 1 || in <= 1) && (y.stride(1) == 1 || out <= 1) &&
                  (a.stride(2) == 1 || in <= 1),
              "lora_apply: rows of x, y and a must be contiguous");
  TORCH_CHECK(b.stride(2) == 1 || b.stride(1) == 1 || R <= 1 || out <= 1,
              "lora_apply: b contiguous, or the transpose of a contiguous [S, R, out]");
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(x.size(0) == rows, "lora_apply: x and y of one row count");
  TORCH_CHECK(P >= 1 && R >= 1 && a.size(1) == P * R && a.size(2) == in && b.size(0) == S &&
                  b.size(1) == out,
              "lora_apply: a [S, P*R, in] and b [S, out, R] for P = len(bounds) - 1 parts");
  TORCH_CHECK(bounds[0] >= 0 && bounds[P] <= out, "lora_apply: bounds within [0, out]");
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(bounds[p] <= bounds[p + 1], "lora_apply: bounds must not decrease");
  const std::vector<int64_t> starts = read_index(seg_start, "seg_start");
  const std::vector<int64_t> slots = read_index(seg_slot, "seg_slot");
  const int64_t G = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == G + 1,
              "lora_apply: seg_start has one more entry than seg_slot");
  std::vector<int64_t> row_of;  // with `rows`: the segments index it, each entry a row once
  int64_t positions = rows;
  if (rows_opt.has_value()) {
    row_of = read_index(*rows_opt, "rows");
    positions = static_cast<int64_t>(row_of.size());
    std::vector<char> seen(rows, 0);
    for (const int64_t r : row_of) {
      TORCH_CHECK(r >= 0 && r < rows && !seen[r], "lora_apply: rows holds each row at most once");
      seen[r] = 1;
    }
  }
  TORCH_CHECK(starts[0] >= 0 && starts[G] <= positions, "lora_apply: segments within the rows");
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(starts[g] <= starts[g + 1], "lora_apply: seg_start must not decrease");
    TORCH_CHECK(slots[g] < S && slots[g] >= -1, "lora_apply: a slot in [-1, S)");
  }
  if (G == 0 || in == 0) return;  // no segments; or t = 0: y unchanged
  if (dt == at::kFloat) {
    lora_apply_impl<float>(y, x, a, b, bounds, starts, slots, row_of);
  } else {
    lora_apply_impl<at::BFloat16>(y, x, a, b, bounds, starts, slots, row_of);
  }
}

std::string lora_isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY(subway_lora, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor b, int[] bounds, Tensor seg_start, "
        "Tensor seg_slot, Tensor? rows=None) -> ()",
        &lora_apply);
  m.def("lora_isa() -> str", &lora_isa);
}
