// Prototype for issue 31 (batch invariance at batch 1): an FP8 linear at one activation row, the gemv's walk over
// row-major E4M3 (8 rows a tile, K in the lanes, as fp8_linear.cpp's gemv_tile) against the nt kernels' arithmetic
// (weight rows in the lanes, one vdpbf16ps chain per output per 128-wide K block, pairs in order: the chain that
// batch_invariant runs at every M) over E4M3 stored with 16 rows interleaved at pair granularity. In that layout a
// 64-byte line holds two pairs of 16 rows, ordered so that the engine's E4m3ToBf16 converter (two table lookups and
// two byte unpacks) leaves pair 2c of rows 0..15 in one vector and pair 2c+1 in the other, lane r row r: no
// transposition, the gemv's own conversion per byte. nt's result is checked against a double reference; the gemv
// here reads the activations unpermuted (its result is not the linear's, only its time is).
//
//   g++ -O3 -march=native -fopenmp -std=c++17 -o /tmp/nt_layout benchmarks/nt_layout_proto.cpp
//   OMP_NUM_THREADS=2 /tmp/nt_layout
//
// Measured (docs/exact-rollouts.md): 2-vCPU Intel Xeon without AMX, 2 threads: from L2 (3072 x 512) nt 0.035 ms
// against the gemv's 0.038-0.039 (0.91x); from DRAM (three 107 MB copies cycled) 3.49-3.65 against 3.42-3.57 ms
// (1.00-1.04x). At 2 / 4 / 8 rows (one K block at a time, the rows' pairs broadcast) 3.94 / 6.06 / 10.54 ms from
// DRAM, where the engine's kernels take 6.36 / 9.12 / 12.67 ms (gemv, gemv, nt) over the default model's 30 layers
// (106 MB) in the same sitting and 4.01 (gemv) / 5.63 (nt) at one row (benchmarks/linear_stream.py; its shapes
// have K = 576 and 1536, partial blocks and the activations' quantization, so read the ratios as indicative).
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <random>
#include "../fp8engine/csrc/e4m3.h"
using namespace fp8e;
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
constexpr int64_t KB = 128;  // K block

// ---- gemv: 8 rows a tile, per K block a 16-lane chain per row, scaled into tot; hsum at the end
void gemv(const uint8_t* w, const float* sw, int64_t n, int64_t k, const uint16_t* x, float sx, float* y) {
  const int64_t nkb = k / KB;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n / 8; ++t) {
    const E4m3ToBf16 cvt;
    const int64_t n0 = t * 8;
    __m512 tot[8];
    for (auto& a : tot) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < nkb; ++b) {
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t kk = b * KB; kk < (b + 1) * KB; kk += 64) {
        const __m512bh x0 = as_bh(_mm512_loadu_si512(x + kk)), x1 = as_bh(_mm512_loadu_si512(x + kk + 32));
        for (int j = 0; j < 8; ++j) {
          const uint8_t* p = w + (n0 + j) * k + kk;
          _mm_prefetch((const char*)(p + 8 * k), _MM_HINT_T0);
          _mm_prefetch((const char*)(p + 16 * k), _MM_HINT_T2);
          __m512i w0, w1;
          cvt(_mm512_loadu_si512(p), w0, w1);
          acc[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[j], x0, as_bh(w0)), x1, as_bh(w1));
        }
      }
      const __m512 s = _mm512_set1_ps(sw[(n0 / 128) * nkb + b] * sx);
      for (int j = 0; j < 8; ++j) tot[j] = _mm512_fmadd_ps(acc[j], s, tot[j]);
    }
    for (int j = 0; j < 8; ++j) y[n0 + j] = _mm512_reduce_add_ps(tot[j]);
  }
}

// interleaved layout: group g (16 rows), 64-byte chunk c (pairs 2c, 2c+1): byte 16L + 2i + b = pair 2c of row 4L+i,
// byte 16L + 8 + 2i + b = pair 2c+1 of row 4L+i; so the converter's out0 = pair 2c of rows 0..15 (lane r = row r)
// and out1 = pair 2c+1.
void interleave(const uint8_t* w, int64_t n, int64_t k, uint8_t* out) {
  for (int64_t g = 0; g < n / 16; ++g)
    for (int64_t c = 0; c < k / 4; ++c) {
      uint8_t* dst = out + (g * (k / 4) + c) * 64;
      for (int L = 0; L < 4; ++L)
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h)
            for (int bb = 0; bb < 2; ++bb)
              dst[16 * L + 8 * h + 2 * i + bb] = w[(g * 16 + 4 * L + i) * k + 4 * c + 2 * h + bb];
    }
}

// ---- nt on the interleaved layout at M=1: a task = 2 groups (32 rows); G=4 K blocks interleaved (8 chains)
template <int G>
void nt_il(const uint8_t* wi, const float* sw, int64_t n, int64_t k, const uint16_t* x, float sx, float* y) {
  const int64_t nkb = k / KB, chunks_per_block = KB / 4, gbytes = k * 16;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n / 32; ++t) {
    const E4m3ToBf16 cvt;
    const uint8_t* base[2] = {wi + (2 * t) * gbytes, wi + (2 * t + 1) * gbytes};
    __m512 tot[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b0 = 0; b0 < nkb; b0 += G) {
      __m512 acc[G][2];
      for (auto& r : acc) for (auto& a : r) a = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks_per_block; ++c)
        for (int g = 0; g < G; ++g) {
          const int64_t chunk = (b0 + g) * chunks_per_block + c;
          const uint16_t* xp = x + (b0 + g) * KB + 4 * c;
          int32_t p0, p1;
          std::memcpy(&p0, xp, 4); std::memcpy(&p1, xp + 2, 4);
          const __m512bh x0 = as_bh(_mm512_set1_epi32(p0)), x1 = as_bh(_mm512_set1_epi32(p1));
          for (int v = 0; v < 2; ++v) {
            const uint8_t* p = base[v] + chunk * 64;
            _mm_prefetch((const char*)(p + 2 * gbytes * 2), _MM_HINT_T2);
            __m512i w0, w1;
            cvt(_mm512_loadu_si512(p), w0, w1);
            acc[g][v] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g][v], as_bh(w0), x0), as_bh(w1), x1);
          }
        }
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < 2; ++v)
          tot[v] = _mm512_fmadd_ps(acc[g][v], _mm512_set1_ps(sw[((32 * t) / 128) * nkb + b0 + g] * sx), tot[v]);
    }
    _mm512_storeu_ps(y + 32 * t, tot[0]);
    _mm512_storeu_ps(y + 32 * t + 16, tot[1]);
  }
}

// ---- the same at MR activation rows (one K block at a time: MR x 2 chains), each row's pairs broadcast
template <int MR>
void nt_il_rows(const uint8_t* wi, const float* sw, int64_t n, int64_t k, const uint16_t* x, float sx, float* y) {
  const int64_t nkb = k / KB, chunks_per_block = KB / 4, gbytes = k * 16;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n / 32; ++t) {
    const E4m3ToBf16 cvt;
    const uint8_t* base[2] = {wi + (2 * t) * gbytes, wi + (2 * t + 1) * gbytes};
    __m512 tot[MR][2];
    for (auto& r : tot) for (auto& a : r) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < nkb; ++b) {
      __m512 acc[MR][2];
      for (auto& r : acc) for (auto& a : r) a = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks_per_block; ++c) {
        const int64_t chunk = b * chunks_per_block + c;
        for (int v = 0; v < 2; ++v) {
          const uint8_t* p = base[v] + chunk * 64;
          _mm_prefetch((const char*)(p + 2 * gbytes * 2), _MM_HINT_T2);
          __m512i w0, w1;
          cvt(_mm512_loadu_si512(p), w0, w1);
          for (int i = 0; i < MR; ++i) {
            int32_t p0, p1;
            std::memcpy(&p0, x + i * k + b * KB + 4 * c, 4);
            std::memcpy(&p1, x + i * k + b * KB + 4 * c + 2, 4);
            acc[i][v] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i][v], as_bh(w0), as_bh(_mm512_set1_epi32(p0))),
                                         as_bh(w1), as_bh(_mm512_set1_epi32(p1)));
          }
        }
      }
      const __m512 s = _mm512_set1_ps(sw[((32 * t) / 128) * nkb + b] * sx);
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < 2; ++v) tot[i][v] = _mm512_fmadd_ps(acc[i][v], s, tot[i][v]);
    }
    for (int i = 0; i < MR; ++i) {
      _mm512_storeu_ps(y + i * n + 32 * t, tot[i][0]);
      _mm512_storeu_ps(y + i * n + 32 * t + 16, tot[i][1]);
    }
  }
}

template <class F>
double timeit(F f, int reps) {
  f();
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  return best;
}

int main() {
  const int64_t k = 512;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 1);
  for (int64_t n : {int64_t(3072), int64_t(208896)}) {  // 1.5 MB (L2), 107 MB (x2 copies cycled: 214 MB)
    const int copies = n > 10000 ? 3 : 1;
    std::vector<std::vector<uint8_t>> w(copies, std::vector<uint8_t>(n * k)), wi(copies, std::vector<uint8_t>(n * k));
    for (int c = 0; c < copies; ++c) {
      for (auto& v : w[c]) v = e4m3_from_f32(std::max(-448.f, std::min(448.f, nd(rng) * 60.f)));
      interleave(w[c].data(), n, k, wi[c].data());
    }
    std::vector<float> sw((n / 128) * (k / KB), 0.01f);
    std::vector<uint16_t> x(k);
    for (auto& v : x) v = kE4m3Bf16.full[e4m3_from_f32(nd(rng))];
    std::vector<float> y0(n), y1(n);
    int which = 0;
    for (int r = 0; r < 3; ++r) {
      const double a = timeit([&] { gemv(w[which].data(), sw.data(), n, k, x.data(), 1.f, y0.data()); which = (which + 1) % copies; }, 9);
      const double b = timeit([&] { nt_il<4>(wi[which].data(), sw.data(), n, k, x.data(), 1.f, y1.data()); which = (which + 1) % copies; }, 9);
      printf("n=%ld (%.0f MB) threads %d: gemv %.3f ms (%.1f GB/s)  nt-interleaved %.3f ms (%.1f GB/s)  ratio %.2f\n",
             (long)n, n * k / 1e6, omp_get_max_threads(), a * 1e3, n * k / a / 1e9, b * 1e3, n * k / b / 1e9, b / a);
    }
    gemv(w[0].data(), sw.data(), n, k, x.data(), 1.f, y0.data());
    nt_il<4>(wi[0].data(), sw.data(), n, k, x.data(), 1.f, y1.data());
    double maxrel = 0, maxref = 0;
    for (int64_t i = 0; i < n; i += 7) {  // scalar reference in double
      double ref = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        uint32_t bits = uint32_t(x[kk]) << 16; float xf; std::memcpy(&xf, &bits, 4);
        ref += (double)e4m3_value(w[0][i * k + kk]) * xf * 0.01;
      }
      maxrel = std::max(maxrel, std::fabs(y1[i] - ref) / (std::fabs(ref) + 1e-2));
      maxref = std::max(maxref, std::fabs(ref));
    }
    printf("  nt-interleaved vs a double reference: max |diff| / (|ref| + 0.01) %.2e (max |ref| %.1f)\n", maxrel, maxref);
    std::vector<uint16_t> xm(8 * k);
    for (auto& v : xm) v = kE4m3Bf16.full[e4m3_from_f32(nd(rng))];
    std::vector<float> ym(8 * n);
    const double t2 = timeit([&] { nt_il_rows<2>(wi[which].data(), sw.data(), n, k, xm.data(), 1.f, ym.data()); which = (which + 1) % copies; }, 9);
    const double t4 = timeit([&] { nt_il_rows<4>(wi[which].data(), sw.data(), n, k, xm.data(), 1.f, ym.data()); which = (which + 1) % copies; }, 9);
    const double t8 = timeit([&] { nt_il_rows<8>(wi[which].data(), sw.data(), n, k, xm.data(), 1.f, ym.data()); which = (which + 1) % copies; }, 9);
    printf("  nt-interleaved at 2 / 4 / 8 rows: %.3f / %.3f / %.3f ms\n", t2 * 1e3, t4 * 1e3, t8 * 1e3);
    nt_il_rows<8>(wi[0].data(), sw.data(), n, k, xm.data(), 1.f, ym.data());
    double rel8 = 0;
    for (int64_t i = 0; i < n; i += 7) {
      const int row = int(i % 8);
      double ref = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        uint32_t bits = uint32_t(xm[row * k + kk]) << 16; float xf; std::memcpy(&xf, &bits, 4);
        ref += (double)e4m3_value(w[0][i * k + kk]) * xf * 0.01;
      }
      rel8 = std::max(rel8, std::fabs(ym[row * n + i] - ref) / (std::fabs(ref) + 1e-2));
    }
    printf("  at 8 rows vs a double reference: max |diff| / (|ref| + 0.01) %.2e\n", rel8);
  }
}
