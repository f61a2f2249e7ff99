// The int8 linear of `--quantization int8` on CPUs with AVX-512 VNNI but no AMX (Zen 4, Ice
// Lake, Cascade Lake): y = (xq wq^T) * x_scale[row] * w_scale[col] (+ bias).
//
// vpdpbusd multiplies unsigned bytes by signed bytes and adds each 4 products into an int32
// lane, without saturating. Both operands are symmetric int8 in [-127, 127] (quantize_weight,
// quantize_rows), so x goes in as u = x + 128 (x ^ 0x80: 1 to 255) and each output's sum
// then carries 128 * sum_k w[n, k] too, which the pack computes once per output and the
// kernel subtracts. int32 sums wrap, never saturate, so the result is the exact dot product
// wherever it fits in int32 (|sum| <= 127 * 127 * K: any K below 133,000), as on AMX or in
// the AVX2 kernel; the scales are applied as those kernels apply them (float(sum) * w_scale,
// then * x_scale + bias in one fma, rounded once to the output's dtype, bfloat16 by the
// AVX2 kernel's rounding), so the outputs are the same bits as theirs.
//
// The weight is packed once at load (avx512_int8_pack): strips of 16 outputs, each strip
// its 16 compensations (int32, 64 bytes) then, for every 4 inputs, the 16 outputs' 4 bytes
// (64 bytes: one zmm, one int32 lane per output). K is padded to a multiple of 4 with zero
// weights, so any K runs. Each thread takes a range of strips; for each block of up to 64
// rows it writes the block's u bytes into its own buffer (padded rows, in L1/L2), then runs
// tiles of R rows by S strips: R * S accumulators, each 4 bytes of a row broadcast once and
// used for S strips, each 64 bytes of the weight loaded once and used for R rows. One row
// (decode) takes 8 strips at once (8 independent sums hide vpdpbusd's latency), two rows 6,
// more 4 rows by 4 strips.
//
// Measured on this project's Zen 4 VM, one thread, the weight in L2 (ad-hoc runs while
// another job shared the machine, minimum of 15): from 16 rows every tile of 8 to 24 sums
// (4x4, 8x2, 6x4, 4x6, 8x3) ran within 3% of the others, about one vpdpbusd a cycle, the
// port's peak (64 x 576 x 1536 in 260 us, 3.4x the AVX2 kernel's speed on one thread);
// before the inline asm below, GCC's intrinsic made 4x4 1.3x slower. One row streams the
// weight at what L2 or memory gives; the prefetch distance (0 to 2 KB) changed nothing
// beyond the noise.
#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

// Built where the compiler targets AVX-512 F, BW, VL and VNNI (cpu_ext.py compiles with
// -march=native); worker/quant.py calls it where the CPU has them and no AMX.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SUBWAY_AVX512_INT8 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kStrip = 16;     // outputs per strip
constexpr int64_t kHeader = 64;    // a strip's 16 int32 compensations, before its weights
constexpr int64_t kTrailer = 64;   // the pack's last bytes: int64 N and K, checked at each call

inline int64_t padded_k(int64_t K) { return (K + 3) / 4 * 4; }
inline int64_t strip_bytes(int64_t K) { return kHeader + kStrip * padded_k(K); }
inline int64_t pack_bytes(int64_t N, int64_t K) {
  return (N + kStrip - 1) / kStrip * strip_bytes(K) + kTrailer;
}

}  // namespace

#if defined(SUBWAY_AVX512_INT8)
namespace {

constexpr int64_t kRowBlock = 64;  // rows of x held (as u bytes) while a thread's strips go by
// Each strip's weight this far ahead while it first streams in (for the first rows of a call).
constexpr int64_t kPrefetchBytes = 256;
constexpr int kMaxTile = 16;       // R * S accumulators at most

// acc + the 4-byte dot products of unsigned `a` and signed `b`, in place. GCC's intrinsic
// copied every accumulator at every step (a register move each) and loaded `b` again for
// each row; here b is loaded once into a register where it serves several rows (kReg), and
// read from memory by the instruction itself where it serves one.
template <bool kReg>
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  if (kReg)
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  else
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// The int32 sums of R rows of u (row stride Kp) against S strips from `w` (the first strip's
// weights; strip s's at w + s * stride, its compensations 64 bytes before them), minus the
// compensations: out[(r * S + s) * 16 + j] is the exact sum for output j of strip s.
template <int R, int S, bool kFetch>
void tile(const uint8_t* u, int64_t Kp, const int8_t* w, int64_t stride, int32_t* out) {
  __m512i acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 4) {
    __m512i b[S];
    for (int s = 0; s < S; ++s) {
      const int8_t* ws = w + s * stride + k * kStrip;
      b[s] = _mm512_load_si512(ws);
      if (kFetch) _mm_prefetch(reinterpret_cast<const char*>(ws) + kPrefetchBytes, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, u + r * Kp + k, 4);
      const __m512i a = _mm512_set1_epi32(quad);
      for (int s = 0; s < S; ++s) acc[r][s] = dpbusd<(R > 1)>(acc[r][s], a, b[s]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const __m512i comp = _mm512_load_si512(w + s * stride - kHeader);
    for (int r = 0; r < R; ++r)
      _mm512_store_si512(out + (r * S + s) * kStrip, _mm512_sub_epi32(acc[r][s], comp));
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*);

// tile<R, S, F> for R rows (1 to 4) and S strips (1 to 8 for up to 2 rows, else 1 to 4).
template <bool F>
TileFn pick_tile(int R, int S) {
#define SUBWAY_TILE(r, s) \
  case r * 16 + s:        \
    return &tile<r, s, F>;
  switch (R * 16 + S) {
    SUBWAY_TILE(1, 1) SUBWAY_TILE(1, 2) SUBWAY_TILE(1, 3) SUBWAY_TILE(1, 4)
    SUBWAY_TILE(1, 5) SUBWAY_TILE(1, 6) SUBWAY_TILE(1, 7) SUBWAY_TILE(1, 8)
    SUBWAY_TILE(2, 1) SUBWAY_TILE(2, 2) SUBWAY_TILE(2, 3) SUBWAY_TILE(2, 4)
    SUBWAY_TILE(2, 5) SUBWAY_TILE(2, 6) SUBWAY_TILE(2, 7) SUBWAY_TILE(2, 8)
    SUBWAY_TILE(3, 1) SUBWAY_TILE(3, 2) SUBWAY_TILE(3, 3) SUBWAY_TILE(3, 4)
    SUBWAY_TILE(4, 1) SUBWAY_TILE(4, 2) SUBWAY_TILE(4, 3) SUBWAY_TILE(4, 4)
    default: return nullptr;
  }
#undef SUBWAY_TILE
}

// 16 consecutive values from n as float32 (zeros where `mask` is clear or b is null).
inline __m512 load_bias(const float* b, int64_t n, __mmask16 mask) {
  return b == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, b + n);
}
inline __m512 load_bias(const at::BFloat16* b, int64_t n, __mmask16 mask) {
  if (b == nullptr) return _mm512_setzero_ps();
  const __m256i h = _mm256_maskz_loadu_epi16(mask, b + n);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
// Round to nearest even, NaN to 0x7FC0: the AVX2 kernel's rounding (and at::BFloat16's), with
// no need for AVX512-BF16 (Ice Lake and Cascade Lake lack it) and no flushing of denormals.
inline void store16(at::BFloat16* y, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm512_mask_cvtepi32_storeu_epi16(y, mask, r);
}

// The sums of a tile (R rows from m0, S strips from n0) to y: float(sum) * w_scale, then
// * x_scale + bias, rounded once.
template <typename T>
void store_tile(const int32_t* sums, int R, int S, const float* ws, const float* xs, const T* b,
                T* y, int64_t N, int64_t n0, int64_t m0) {
  for (int s = 0; s < S; ++s) {
    const int64_t n = n0 + s * kStrip;
    const int64_t cols = std::min<int64_t>(kStrip, N - n);
    if (cols <= 0) break;
    const __mmask16 mask = cols == kStrip ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 wscale = _mm512_maskz_loadu_ps(mask, ws + n), bias = load_bias(b, n, mask);
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + (r * S + s) * kStrip));
      const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sum, wscale), _mm512_set1_ps(xs[m0 + r]), bias);
      store16(y + (m0 + r) * N + n, v, mask);
    }
  }
}

// Rows m0 .. m0 + rows of x as u = x ^ 0x80 (x + 128), each padded to Kp with 0x80 (x = 0,
// against zero weights).
void to_unsigned(const int8_t* x, int64_t K, int64_t Kp, int64_t m0, int64_t rows, uint8_t* u) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* src = x + (m0 + r) * K;
    uint8_t* dst = u + r * Kp;
    for (int64_t k = 0; k < K; k += 64) {
      const int64_t n = std::min<int64_t>(64, K - k);
      const __mmask64 mask = n == 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
      const __m512i v = _mm512_maskz_loadu_epi8(mask, src + k);
      _mm512_mask_storeu_epi8(dst + k, mask, _mm512_xor_si512(v, flip));
    }
    for (int64_t k = K; k < Kp; ++k) dst[k] = 0x80;
  }
}

// Strips taken at once for a call of M rows, and rows per tile.
inline int strips_per_tile(int64_t M) { return M == 1 ? 8 : M == 2 ? 6 : 4; }
constexpr int kRows = 4;

template <typename T>
void run(const int8_t* xq, const float* xs, const int8_t* wp, const float* ws, const T* b, T* y,
         int64_t M, int64_t K, int64_t N) {
  const int64_t Kp = padded_k(K), stride = strip_bytes(K), strips = (N + kStrip - 1) / kStrip;
  const int S = strips_per_tile(M);
  // At least 4 strips (64 outputs) to a thread: a one-row call is little work a strip.
  at::parallel_for(0, strips, 4, [&](int64_t s0, int64_t s1) {
    static thread_local std::vector<uint8_t> ubuf;
    ubuf.resize(kRowBlock * Kp);
    alignas(64) int32_t sums[kMaxTile * kStrip];
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t me = std::min(M, mb + kRowBlock);
      to_unsigned(xq, K, Kp, mb, me - mb, ubuf.data());
      for (int64_t s = s0; s < s1; s += S) {
        const int ns = int(std::min<int64_t>(S, s1 - s));
        const int8_t* w = wp + s * stride + kHeader;
        for (int64_t m = mb; m < me; m += kRows) {
          const int nr = int(std::min<int64_t>(kRows, me - m));
          // The weight streams in from memory for the call's first rows; later rows find it
          // in L2.
          const TileFn fn = m == 0 ? pick_tile<true>(nr, ns) : pick_tile<false>(nr, ns);
          fn(ubuf.data() + (m - mb) * Kp, Kp, w, stride, sums);
          store_tile(sums, nr, ns, ws, xs, b, y, N, s * kStrip, m);
        }
      }
    }
  });
}

bool cpu_has_it() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

bool avx512_int8_supported() {
  static const bool ok = cpu_has_it();
  return ok;
}
#else
bool avx512_int8_supported() { return false; }
#endif

// The weight [N, K] (symmetric int8, any K) as run() reads it: for each strip of 16 outputs,
// their 16 compensations 128 * sum_k w[n, k] (int32), then for each 4 inputs the 16 outputs'
// 4 bytes; zero outputs past N and zero inputs past K; then N and K (int64) in a 64-byte
// trailer. Plain C++: it packs wherever it builds, and the matmul checks the CPU.
at::Tensor avx512_int8_pack(const at::Tensor& wq) {
  TORCH_CHECK(wq.scalar_type() == at::kChar && wq.dim() == 2 && wq.is_contiguous() &&
                  wq.size(0) >= 1 && wq.size(1) >= 1,
              "avx512_int8_pack: a contiguous int8 weight [out, in]");
  const int64_t N = wq.size(0), K = wq.size(1), stride = strip_bytes(K);
  auto out = at::zeros({pack_bytes(N, K)}, wq.options());
  const int8_t* w = wq.data_ptr<int8_t>();
  int8_t* p = out.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    int8_t* strip = p + n / kStrip * stride;
    const int64_t j = n % kStrip;
    int32_t total = 0;
    for (int64_t k = 0; k < K; ++k) {
      strip[kHeader + k / 4 * 4 * kStrip + j * 4 + k % 4] = w[n * K + k];
      total += w[n * K + k];
    }
    const int32_t comp = 128 * total;
    std::memcpy(strip + j * 4, &comp, 4);
  }
  const int64_t shape[2] = {N, K};
  std::memcpy(p + out.numel() - kTrailer, shape, sizeof(shape));
  return out;
}

// y [M, N] = int8 x [M, K] (from quantize_rows) against the packed weight, any rows.
at::Tensor avx512_int8_matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wp,
                              const at::Tensor& ws, const c10::optional<at::Tensor>& bias,
                              at::ScalarType dtype) {
  TORCH_CHECK(avx512_int8_supported(),
              "avx512_int8_matmul: not built or not supported here (needs AVX-512 F, BW, VL and VNNI)");
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(0) >= 1 && xq.size(1) >= 1,
              "avx512_int8_matmul: contiguous int8 x [rows, in]");
  const int64_t M = xq.size(0), K = xq.size(1), N = ws.numel();
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous() &&
                  ws.scalar_type() == at::kFloat && ws.is_contiguous() && N >= 1,
              "avx512_int8_matmul: float32 scales, one per row of x and one per output");
  bool same = wp.scalar_type() == at::kChar && wp.is_contiguous() && wp.numel() == pack_bytes(N, K);
  if (same) {
    int64_t shape[2];
    std::memcpy(shape, wp.data_ptr<int8_t>() + wp.numel() - kTrailer, sizeof(shape));
    same = shape[0] == N && shape[1] == K;
  }
  TORCH_CHECK(same, "avx512_int8_matmul: a weight from avx512_int8_pack of ", N, " outputs by ", K,
              " inputs");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(wp.data_ptr()) % 64 == 0,
              "avx512_int8_matmul: the packed weight must be 64-byte aligned");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "avx512_int8_matmul: float32 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(),
                "avx512_int8_matmul: a contiguous bias of the output's dtype and size");
  auto y = at::empty({M, N}, xq.options().dtype(dtype));
#if defined(SUBWAY_AVX512_INT8)
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
  m.def("avx512_int8_supported() -> bool", &avx512_int8_supported);
  m.def("avx512_int8_pack(Tensor wq) -> Tensor", &avx512_int8_pack);
  m.def("avx512_int8_matmul(Tensor xq, Tensor xs, Tensor wp, Tensor ws, Tensor? bias, ScalarType dtype) -> Tensor",
        &avx512_int8_matmul);
}
