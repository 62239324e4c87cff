// Pieces shared by the CPU linear kernels (fp8_linear.cpp, bf16_linear.cpp): buffers, masks, and the
// large-M GEMM machinery built on AVX512-BF16 (register-blocked micro kernel over bf16 pairs packed
// by column, and the transposing write-back of its float32 tiles).

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define FP8E_BF16_KERNELS 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FP8E_AVX512 1
#endif
#if defined(FP8E_BF16_KERNELS) || defined(FP8E_AVX512)
#include <immintrin.h>
#endif

namespace fp8e {

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], AlignedFree>;

template <typename T>
Buffer<T> alloc_buffer(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
  auto* p = static_cast<T*>(std::aligned_alloc(64, bytes));
  TORCH_CHECK(p != nullptr, "fp8engine linear kernels: out of memory");
  return Buffer<T>(p);
}

#ifdef FP8E_AVX512

inline __mmask16 tail_mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? 0 : __mmask16((1u << n) - 1);
}
inline __mmask32 tail_mask32(int64_t n) {
  return n >= 32 ? ~__mmask32(0) : n <= 0 ? 0 : (__mmask32(1) << n) - 1;
}
inline __mmask64 tail_mask64(int64_t n) {
  return n >= 64 ? ~__mmask64(0) : n <= 0 ? 0 : (__mmask64(1) << n) - 1;
}

#endif  // FP8E_AVX512

#ifdef FP8E_BF16_KERNELS

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline void transpose16x16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// out[t] = sum of the 16 floats of v[t], for 8 vectors at once.
inline void hsum8(const float (*v)[16], float* out) {
  __m256 h[8];
  for (int t = 0; t < 8; ++t) h[t] = _mm256_add_ps(_mm256_load_ps(v[t]), _mm256_load_ps(v[t] + 8));
  // a = [s0 s1 s2 s3] of the low 128-bit halves, then of the high halves; b likewise for s4..s7.
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

// ---- small M: dot products along K, MR activation rows x NR weight rows in registers -----------
//
// MR activation rows share each weight chunk; MR x NR <= 16 accumulators stay in registers.

constexpr int kGemvMaxRows = 4;
constexpr int kGemvAcc = 16;
constexpr int gemv_nr(int mr) { return mr <= 2 ? 8 : 4; }
constexpr int64_t kGemvRows = 16;  // weight rows per parallel task

// ---- large M: out^T tile = W tile (bf16, broadcast pairs) x X^T (bf16 pairs packed by column) ---
//
// A dp has a ~9 cycle latency at two per cycle, so NR x MV keeps >= 16 accumulator chains (measured
// on Zen 5).

constexpr int kMaxMv = 4;
constexpr int kMaxNr = 16;
constexpr int micro_nr(int mv) { return mv == 1 ? 16 : mv == 2 ? 12 : mv == 3 ? 8 : 6; }

// Adds (W rows x X pairs) into the float tile, scaled by sx[m] * sw[n] when kScaled; `first`
// overwrites instead of adding. wb: NR weight rows ldw bf16 apart; xp: [pairs][ldx] bf16 pairs.
template <int MV, bool kScaled>
void gemm_micro(const uint16_t* wb, int64_t ldw, const float* xp, int64_t ldx, int64_t pairs, const float* sx,
                const float* sw, float* ct, int64_t ldc, bool first) {
  constexpr int kNr = micro_nr(MV);
  __m512 acc[kNr][MV];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  int64_t q = 0;
  do {  // pairs >= 1; a do-while lets the compiler keep acc in registers
    __m512bh xv[MV];
    for (int i = 0; i < MV; ++i) xv[i] = as_bh(_mm512_castps_si512(_mm512_loadu_ps(xp + q * ldx + i * 16)));
    for (int j = 0; j < kNr; ++j) {
      int32_t pair;
      std::memcpy(&pair, wb + j * ldw + 2 * q, 4);
      const __m512bh wv = as_bh(_mm512_set1_epi32(pair));
      for (int i = 0; i < MV; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv, xv[i]);
    }
  } while (++q < pairs);
  __m512 sxv[MV];
  if (kScaled)
    for (int i = 0; i < MV; ++i) sxv[i] = _mm512_loadu_ps(sx + i * 16);
  for (int j = 0; j < kNr; ++j) {
    const __m512 swv = kScaled ? _mm512_set1_ps(sw[j]) : _mm512_setzero_ps();
    for (int i = 0; i < MV; ++i) {
      float* c = ct + j * ldc + i * 16;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c);
      _mm512_storeu_ps(c, kScaled ? _mm512_fmadd_ps(acc[j][i], _mm512_mul_ps(sxv[i], swv), prev)
                                  : _mm512_add_ps(acc[j][i], prev));
    }
  }
}

using MicroFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, int64_t, const float*, const float*,
                         float*, int64_t, bool);
template <bool kScaled>
inline constexpr MicroFn kMicro[kMaxMv + 1] = {nullptr, gemm_micro<1, kScaled>, gemm_micro<2, kScaled>,
                                               gemm_micro<3, kScaled>, gemm_micro<4, kScaled>};

struct GemmTask {
  int64_t n0, mv0, mv1;  // weight rows [n0, n0 + tile_n), activation vectors [mv0, mv1)
};

// Splits M into as few chunks as keep every thread equally busy (each chunk re-reads the weights).
inline int64_t m_chunks(int64_t n_tiles, int64_t mvecs, int64_t threads) {
  for (int64_t c = 1; c <= mvecs; ++c)
    if ((n_tiles * c) % threads == 0 || n_tiles * c >= 8 * threads) return c;
  return mvecs;
}

// Masked stores are slow on this class of CPU (Zen 5), so only the last, partial block uses them.
inline void store_row(float* y, __m512 v, __mmask16 m) {
  if (m == 0xFFFF) {
    _mm512_storeu_ps(y, v);
  } else {
    _mm512_mask_storeu_ps(y, m, v);
  }
}

// vcvtneps2bf16 rounds to nearest even like Tensor.to(bfloat16); it differs only on float32
// denormals (flushed to zero) and NaN payloads.
inline void store_row(at::BFloat16* y, __m512 v, __mmask16 m) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  if (m == 0xFFFF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), h);
  } else {
    _mm256_mask_storeu_epi16(y, m, h);
  }
}

// 32 values, lo then hi; m masks hi.
inline void store_rows(float* y, __m512 lo, __m512 hi, __mmask16 m) {
  _mm512_storeu_ps(y, lo);
  store_row(y + 16, hi, m);
}

inline void store_rows(at::BFloat16* y, __m512 lo, __m512 hi, __mmask16 m) {
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  if (m == 0xFFFF) {
    _mm512_storeu_si512(y, h);
  } else {
    _mm512_mask_storeu_epi16(y, __mmask32(0xFFFF) | __mmask32(m) << 16, h);
  }
}

// y[m, n] = tile[n, m] + bias[n] for y [rows_m, cols_n], transposing 16 x 16 blocks of the tile.
template <typename OutT>
void write_tile(int64_t rows_m, int64_t cols_n, int64_t tile_n, const float* bias, const GemmTask& t,
                const float* ct, int64_t ldc, OutT* y) {
  for (int64_t nb = 0; nb < tile_n && t.n0 + nb < cols_n; nb += 16) {
    const __mmask16 nmask = tail_mask16(cols_n - t.n0 - nb);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(nmask, bias + t.n0 + nb) : _mm512_setzero_ps();
    for (int64_t mv = t.mv0; mv < t.mv1; ++mv) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(ct + (nb + i) * ldc + (mv - t.mv0) * 16);
      transpose16x16(r);
      for (int i = 0; i < 16 && mv * 16 + i < rows_m; ++i)
        store_row(y + (mv * 16 + i) * cols_n + t.n0 + nb, _mm512_add_ps(r[i], bv), nmask);
    }
  }
}

#endif  // FP8E_BF16_KERNELS

}  // namespace fp8e
