/* What one core's vector and AMX instructions cost on this machine, single-threaded.
 * Built and run by bench_amx.py (gcc -O2 -march=native); prints "name value unit" lines.
 *
 * - fma: AVX-512 FMAs a second, 12 independent chains (the throughput, not the latency).
 * Each figure is the best of 5 timed loops (see kRounds).
 * - tdpbf16ps / tdpbssd: ns per tile product, four independent C tiles, A and B loaded once.
 * - load+tdp at a buffer size: ns per tile when each product's A tile is loaded first from a
 *   buffer of that size (L1, L2, memory), two C tiles, as the kernels stream a weight.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Each figure is the best of kRounds timed loops: the VM's neighbours only slow a loop down. */
static const int kRounds = 5;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#if defined(__AVX512F__)
static void probe_fma(void) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * i);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
  const long n = 20000000;
  double best = 1e30;
  for (int round = 0; round < kRounds; ++round) {  /* the first ones wake AVX-512 up */
    const double t = now();
    for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
      __asm__ volatile("" ::"v"(a[0]), "v"(a[1]), "v"(a[2]), "v"(a[3]), "v"(a[4]), "v"(a[5]),
                       "v"(a[6]), "v"(a[7]), "v"(a[8]), "v"(a[9]), "v"(a[10]), "v"(a[11]));
    }
    const double dt = now() - t;
    best = dt < best ? dt : best;
  }
  volatile float sink = 0.f;  /* the chains' results are used */
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(a[i]);
  printf("fma %.3f G/s\n", 12.0 * n / best / 1e9);
}
#else
static void probe_fma(void) { printf("fma none -\n"); }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__linux__)
struct __attribute__((aligned(64))) tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void probe_amx(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
    printf("amx refused -\n");
    return;
  }
  struct tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
  static int8_t small[4096] __attribute__((aligned(64)));
  memset(small, 1, sizeof small);
  _tile_loadd(4, small, 64);
  _tile_loadd(5, small + 1024, 64);
  _tile_loadd(6, small + 2048, 64);
  _tile_loadd(7, small + 3072, 64);
  const long n = 500000;
  double best;
/* Four independent products a loop, best of kRounds loops. DP is the instruction's
 * intrinsic: GCC pastes tile numbers into assembly, so they stay literals here. */
#define TIME_PRODUCTS(NAME, DP)                                       \
  best = 1e30;                                                        \
  for (int round = 0; round < kRounds; ++round) {                     \
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);       \
    const double t = now();                                           \
    for (long i = 0; i < n; ++i) {                                    \
      DP(0, 4, 6); DP(1, 5, 6); DP(2, 4, 7); DP(3, 5, 7);             \
    }                                                                 \
    const double dt = now() - t;                                      \
    best = dt < best ? dt : best;                                     \
  }                                                                   \
  printf(NAME " %.2f ns\n", best / (4.0 * n) * 1e9);
  TIME_PRODUCTS("tdpbf16ps", _tile_dpbf16ps)
  TIME_PRODUCTS("tdpbssd", _tile_dpbssd)
#undef TIME_PRODUCTS
  const long sizes_kb[] = {32, 1024, 65536};
  for (int s = 0; s < 3; ++s) {
    const long bytes = sizes_kb[s] * 1024, tiles = bytes / 1024;
    int8_t* buf = aligned_alloc(4096, bytes);
    memset(buf, 1, bytes);
    const long m = 200000;
    long idx = 0;
    best = 1e30;
    for (int round = 0; round < kRounds; ++round) {
      const double t = now();
      for (long i = 0; i < m; ++i) {
        _tile_loadd(4, buf + idx * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(5, buf + (idx + 1) * 1024, 64);
        _tile_dpbssd(1, 5, 6);
        idx = idx + 2 >= tiles ? 0 : idx + 2;
      }
      const double dt = now() - t;
      best = dt < best ? dt : best;
    }
    printf("load+tdp@%ldKB %.2f ns\n", sizes_kb[s], best / (2.0 * m) * 1e9);
    free(buf);
  }
  _tile_release();
}
#else
static void probe_amx(void) { printf("amx none -\n"); }
#endif

int main(void) {
  probe_fma();
  probe_amx();
  return 0;
}
