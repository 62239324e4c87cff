// Pieces shared by the CPU linear kernels (fp8_linear.cpp, bf16_linear.cpp): buffers, masks, and the
// large-M GEMM machinery built on AVX512-BF16 (register-blocked micro kernel over bf16 pairs packed
// by column, and the transposing write-back of its float32 tiles).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
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
// Without AVX512-BF16 (AMD Zen 2-3, Intel before Cooper Lake): the AVX2 + FMA kernels at the end of this file.
#if !defined(FP8E_BF16_KERNELS) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FP8E_AVX2_KERNELS 1
#endif
#if defined(FP8E_BF16_KERNELS) || defined(FP8E_AVX512) || defined(FP8E_AVX2_KERNELS)
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

// ---- small M: weight rows across the lanes -----------------------------------------------------
//
// The GEMMs above put activation rows in the lanes, so below 16 rows most of each dot product is padding;
// the gemv puts K in the lanes and streams the weights again for every few rows. The "nt" kernels put 16
// weight rows in the lanes instead: a task transposes each K block of its kNtRows weight rows once, so that
// a vector holds one bf16 pair of 16 weight rows, and applies it to every activation row from registers,
// the row's pair broadcast. No lane is padding and the weights stream once whatever M is. Each output is
// its GEMM's arithmetic exactly — per K block one vdpbf16ps chain over the same pairs in the same order from
// zero, the same operands (weights first), the block's result added (scaled, in the FP8 kernel) into the
// running sum, the bias last — so a row gets the same bits from either, and batch_invariant can take this
// path at small M and the GEMM above it.

constexpr int64_t kNtRows = 32;  // weight rows per task: two vectors
constexpr int kNtVecs = static_cast<int>(kNtRows / 16);
constexpr int kNtMaxRows = 8;  // activation rows per register tile: 8 x 2 accumulator chains

// Lane L (128 bits) of the result: piece(4 L + i), 16 bytes of row 4 L + i (weight rows into the lanes of four
// vectors, i = 0..3, which in-lane unpacks then transpose: the nt kernels' conversions).
template <typename Piece>
inline __m512i lanes_of(const Piece& piece, int i) {
  __m512i v = _mm512_castsi128_si512(piece(i));
  v = _mm512_inserti32x4(v, piece(4 + i), 1);
  v = _mm512_inserti32x4(v, piece(8 + i), 2);
  return _mm512_inserti32x4(v, piece(12 + i), 3);
}
// lanes_of the 16 bytes at byte offset off of rows[0..15].
template <typename T>
inline __m512i lanes_of_rows(const T* const* rows, int i, int64_t off) {
  return lanes_of(
      [&](int r) {
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const char*>(rows[r]) + off));
      },
      i);
}
// The same, the bytes past mask zero (for partial blocks: on Zen 5 masked loads cost more than plain ones even with
// every lane set).
inline __m512i lanes_of_rows(const uint8_t* const* rows, int i, int64_t off, __mmask16 mask) {
  return lanes_of([&](int r) { return _mm_maskz_loadu_epi8(mask, rows[r] + off); }, i);
}

// tot[i][v] (running sums of activation row i and weight vector v) gets the K block's chain over `pairs`
// pairs of wt against x rows xb (ldx bf16 apart): tot = chain x (sx[i] * sw[v]) + tot when kScaled, else
// chain + tot; `first` starts the sums (tot taken as zero).
template <int MR, bool kScaled>
void nt_block(const float* wt, const uint16_t* xb, int64_t ldx, int64_t pairs, const float* sx, int64_t sx_ld,
              const __m512 (&sw)[kNtVecs], float* tot, bool first) {
  __m512 acc[MR][kNtVecs];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  int64_t q = 0;
  do {  // pairs >= 1
    __m512bh wv[kNtVecs];
    for (int v = 0; v < kNtVecs; ++v) wv[v] = as_bh(_mm512_castps_si512(_mm512_load_ps(wt + (q * kNtVecs + v) * 16)));
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, xb + i * ldx + 2 * q, 4);
      const __m512bh xv = as_bh(_mm512_set1_epi32(pair));
      for (int v = 0; v < kNtVecs; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv[v], xv);
    }
  } while (++q < pairs);
  for (int i = 0; i < MR; ++i) {
    const __m512 sxv = kScaled ? _mm512_set1_ps(sx[i * sx_ld]) : _mm512_setzero_ps();
    for (int v = 0; v < kNtVecs; ++v) {
      float* t = tot + (i * kNtVecs + v) * 16;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_load_ps(t);
      _mm512_store_ps(t, kScaled ? _mm512_fmadd_ps(acc[i][v], _mm512_mul_ps(sxv, sw[v]), prev)
                                 : _mm512_add_ps(acc[i][v], prev));
    }
  }
}

using NtBlockFn = void (*)(const float*, const uint16_t*, int64_t, int64_t, const float*, int64_t,
                           const __m512 (&)[kNtVecs], float*, bool);
template <bool kScaled>
inline constexpr NtBlockFn kNtBlock[kNtMaxRows + 1] = {
    nullptr,
    nt_block<1, kScaled>,
    nt_block<2, kScaled>,
    nt_block<3, kScaled>,
    nt_block<4, kScaled>,
    nt_block<5, kScaled>,
    nt_block<6, kScaled>,
    nt_block<7, kScaled>,
    nt_block<8, kScaled>};

// nt_block over G consecutive whole K blocks at once, for a row or two: each block's chain starts from zero and
// does not depend on another's, so interleaving the blocks gives the core G x MR x kNtVecs chains to overlap,
// where one block's MR x kNtVecs chains wait on vdpbf16ps's latency (at M=1 the chain took three quarters of
// nt_block's time on one instruction). The blocks' results then enter tot one after the other in block order, as
// G nt_block calls would add them: the same bits. wt: the G blocks' converted pairs, wt_ld floats apart; sw: G
// blocks' scales (kScaled).
constexpr int64_t kNtGroupMaxM = 2;

template <int64_t KB, int G, int MR, bool kScaled>  // KB: the K block's length
void nt_blocks(const float* wt, int64_t wt_ld, const uint16_t* xb, int64_t ldx, const float* sx, int64_t sx_ld,
               const __m512 (*sw)[kNtVecs], float* tot, bool first) {
  constexpr int64_t pairs = KB / 2;
  __m512 acc[G][MR][kNtVecs];
  for (auto& block : acc)
    for (auto& row : block)
      for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q)
    for (int g = 0; g < G; ++g) {
      __m512bh wv[kNtVecs];
      for (int v = 0; v < kNtVecs; ++v)
        wv[v] = as_bh(_mm512_castps_si512(_mm512_load_ps(wt + g * wt_ld + (q * kNtVecs + v) * 16)));
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, xb + i * ldx + g * KB + 2 * q, 4);
        const __m512bh xv = as_bh(_mm512_set1_epi32(pair));
        for (int v = 0; v < kNtVecs; ++v) acc[g][i][v] = _mm512_dpbf16_ps(acc[g][i][v], wv[v], xv);
      }
    }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < MR; ++i) {
      const __m512 sxv = kScaled ? _mm512_set1_ps(sx[i * sx_ld + g]) : _mm512_setzero_ps();
      for (int v = 0; v < kNtVecs; ++v) {
        float* t = tot + (i * kNtVecs + v) * 16;
        const __m512 prev = first && g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(t);
        _mm512_store_ps(t, kScaled ? _mm512_fmadd_ps(acc[g][i][v], _mm512_mul_ps(sxv, sw[g][v]), prev)
                                   : _mm512_add_ps(acc[g][i][v], prev));
      }
    }
}

using NtBlocksFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, const float*, int64_t,
                            const __m512 (*)[kNtVecs], float*, bool);
static_assert(kNtGroupMaxM == 2, "kNtBlocks lists nt_blocks at 1 and 2 rows");
template <int64_t KB, int G, bool kScaled>  // nt_blocks at m rows, m <= kNtGroupMaxM
inline constexpr NtBlocksFn kNtBlocks[kNtGroupMaxM + 1] = {nullptr, nt_blocks<KB, G, 1, kScaled>,
                                                           nt_blocks<KB, G, 2, kScaled>};

// ---- the AMX tiles' order on AVX-512 ------------------------------------------------------------
//
// TDPBF16PS adds each 32-k step of A x B into C as C + (even + odd): even is the float32 sum of the step's 16
// even-k products taken in k order from zero, odd that of the 16 odd-k ones, products of bf16 values exact in
// float32, denormal inputs read as zero and denormal results flushed (established on a Xeon with AMX against a
// million outputs of adversarial inputs: benchmarks/amx_order.cpp). The nt16 kernels reproduce it at small M
// (fp8_linear.cpp, bf16_linear.cpp: "tiles' order"), so that a batch-invariant engine gets the tiles' bits without
// the tiles where they are slow. These give a bf16 pair's halves as float32 (k even: the low half).
inline float pair_even(int32_t pair) {
  const uint32_t bits = static_cast<uint32_t>(pair) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float pair_odd(int32_t pair) {
  const uint32_t bits = static_cast<uint32_t>(pair) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline __m512 pairs_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 pairs_odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))); }

// MXCSR's flush-to-zero and denormals-are-zero on for this scope on this thread, as the tiles compute; restored
// after.
class TileDenormals {
 public:
  TileDenormals() : csr_(_mm_getcsr()) { _mm_setcsr(csr_ | 0x8040u); }
  ~TileDenormals() { _mm_setcsr(csr_); }
  TileDenormals(const TileDenormals&) = delete;
  TileDenormals& operator=(const TileDenormals&) = delete;

 private:
  unsigned csr_;
};

// Activation rows per register tile for m rows: as even as the tiles allow.
inline int64_t nt_rows_per_pass(int64_t m) { return cdiv(m, cdiv(m, kNtMaxRows)); }

struct GemmTask {
  int64_t n0, mv0, mv1;  // weight rows [n0, n0 + tile_n), activation vectors [mv0, mv1)
};

// Splits M into as few chunks as keep every thread equally busy (each chunk re-reads the weights).
inline int64_t m_chunks(int64_t n_tiles, int64_t mvecs, int64_t threads) {
  for (int64_t c = 1; c <= mvecs; ++c)
    if ((n_tiles * c) % threads == 0 || n_tiles * c >= 8 * threads) return c;
  return mvecs;
}

// Chunks of activation rows for a large-M GEMM: enough for the threads (m_chunks), and small enough that a
// chunk's packed rows (vec_bytes a 16-row vector, at least min_vecs vectors) take about 1 MiB and stay in L2
// while the thread's weight tiles stream past them: the tasks run chunk-major (chunk_major_task), so a thread's
// tasks are a chunk's tiles, then the next chunk's. Without it every tile re-read all M rows from L3: BF16 AMX at
// M = 2048 took 1.5-2x the time; FP8 (benchmarks/fp8_linear_micro.py, 3072 x 576 on a 2-core Xeon) AVX-512 at
// M=2048 0.82x -> 0.87-0.92x torch's BF16 F.linear, AMX at M=4096 18.0 -> 14.1-14.5 ms; a prefill of 128 x 32
// tokens 1.49 -> 1.30 s (AMX), 5.73 -> 5.37 s (AVX-512).
inline int64_t l2_chunks(int64_t n_tiles, int64_t mvecs, int64_t threads, int64_t vec_bytes, int64_t min_vecs) {
  return std::max(m_chunks(n_tiles, mvecs, threads), cdiv(mvecs, std::max(min_vecs, (int64_t(1) << 20) / vec_bytes)));
}

// Task i of n_tiles x chunks, chunk-major (see l2_chunks).
inline GemmTask chunk_major_task(int64_t i, int64_t n_tiles, int64_t tile_n, int64_t mvecs, int64_t chunks) {
  const int64_t c = i / n_tiles;
  return GemmTask{i % n_tiles * tile_n, c * mvecs / chunks, (c + 1) * mvecs / chunks};
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

// y[m, n0 + 16 v + j] = tot[m][v][j] + bias, for the nt kernels' running sums of all m rows.
template <typename OutT>
void nt_write(int64_t rows_m, int64_t cols_n, int64_t n0, const float* bias, const float* tot, OutT* y) {
  for (int v = 0; v < kNtVecs && n0 + 16 * v < cols_n; ++v) {
    const int64_t n = n0 + 16 * v;
    const __mmask16 mask = tail_mask16(cols_n - n);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows_m; ++m)
      store_row(y + m * cols_n + n, _mm512_add_ps(_mm512_load_ps(tot + (m * kNtVecs + v) * 16), bv), mask);
  }
}

#endif  // FP8E_BF16_KERNELS


#ifdef FP8E_AVX2_KERNELS

// ---- AVX2 + FMA: one kernel for every M (batch invariant as it stands) --------------------------
//
// For each output (m, n) and 128-wide K block, 8 lanes along K add up the products chunk after chunk, the
// lanes reduce in one fixed tree, and the block sums (times sx[m][b] * sw(n, b) when scaled) add up block after
// block: the same arithmetic for a row whatever M is and wherever the row sits. Up to kAvx2DirectM rows, each
// group of kAvx2Nr weight rows is converted in registers as it streams, once per pair of rows (the second pair
// reads the block from L1: 3-4 rows of the 30-layer FP8 stream took 12-15 ms this way against 18-19 through the
// buffer on a Zen 3; at 5-6 the buffer was ahead); above, once per K block and per panel of kAvx2Mb activation
// rows into a float32 buffer in L1 (the same values, so the same bits).

constexpr int64_t kAvx2Block = 128;
constexpr int kAvx2Nr = 4;          // weight rows per group (a task's unit)
constexpr int kAvx2Mr = 2;          // activation rows per register tile from the buffer: kAvx2Mr x kAvx2Nr sums
constexpr int64_t kAvx2Mb = 48;     // activation rows per panel: their K block stays in L1 across the groups
constexpr int64_t kAvx2DirectM = 4; // up to this many rows the weights convert in registers (once per pair)
constexpr int64_t kAvx2Prefetch = 2; // groups ahead whose weights the direct path prefetches

// 8 E4M3 codes -> float32 times 2^-120, exactly, by moving bits (3 instructions, against 5 through half
// precision: 1.4-1.5x the GEMV's speed on a Zen 3 core, from L2 and from DRAM): the sign-extended byte shifted left
// by 20 puts the sign at bit 31, the 4 exponent bits at 23..26 and the 3 mantissa bits at 20..22, and the mask
// clears the sign's copies at 27..30. Read as float32, exponent e >= 1 is 2^(e-127) x 1.mmm and e = 0 the
// subnormal 2^-126 x 0.mmm: the E4M3 value (2^(e-7) x 1.mmm, 2^-6 x 0.mmm) times 2^-120 either way. The
// activations carry 2^112 (E4M3 x 2^112 <= 1.75 x 2^120) and their block scales 2^8, so a product is w x x x 2^-8,
// exact, and every partial sum is a multiple of 2^-26 (never subnormal): the block sums are 2^-8 times those of
// the unscaled values, bit for bit, and the scale's 2^8 restores them with the same rounding. Subnormal weights
// need MXCSR's denormals-are-zero off: SubnormalsOn clears it for a kernel's thread where a library set it. The
// NaN code 0x7F reads as 480 x 2^-120; quantized weights never hold it.
struct E4m3Weights {
  using Elem = uint8_t;
  static constexpr bool kSubnormal = true;
  static __m256 load8(const uint8_t* p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u))));
  }
};
constexpr float kE4m3ActivationFactor = 0x1p112f;  // what the activations carry for E4m3Weights
constexpr float kE4m3ScaleFactor = 0x1p8f;         // and their block scales

// MXCSR's denormals-are-zero (bit 6) off for this scope on this thread, restored after (only where it was on).
class SubnormalsOn {
 public:
  explicit SubnormalsOn(bool needed) : csr_(needed ? _mm_getcsr() : 0u) {
    if (csr_ & kDaz) _mm_setcsr(csr_ & ~kDaz);
  }
  ~SubnormalsOn() {
    if (csr_ & kDaz) _mm_setcsr(csr_);
  }
  SubnormalsOn(const SubnormalsOn&) = delete;
  SubnormalsOn& operator=(const SubnormalsOn&) = delete;

 private:
  static constexpr unsigned kDaz = 0x40u;
  unsigned csr_;
};

// bf16 -> float32 (exact).
struct Bf16Weights {
  using Elem = uint16_t;
  static constexpr bool kSubnormal = false;
  static __m256 load8(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
};

// The sum of v's 8 lanes in one fixed order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
__attribute__((always_inline)) inline float hsum_fixed(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// hsum_fixed of four vectors at once, bit for bit: lane j of the result is hsum_fixed of the j-th argument
// (the same pairs added in the same order, four outputs per instruction instead of one).
__attribute__((always_inline)) inline __m128 hsum4_fixed(__m256 a, __m256 b, __m256 c, __m256 d) {
  // s = low half + high half: ab = [s(a) | s(b)], cd = [s(c) | s(d)]
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // t = (s0 + s2, s1 + s3) for each: [t(a), t(c) | t(b), t(d)]
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u = _mm256_hadd_ps(t, t);  // t0 + t1: [a, c, a, c | b, d, b, d]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// total[i][j] += hsum(acc[i][j]), times sx[i] * sw[j] when sx is given (std::fma's rounding, four at a time).
template <int MR>
__attribute__((always_inline)) inline void avx2_add_block(const __m256 (&acc)[MR][kAvx2Nr], const float* sx, int64_t ldsx, const float* sw,
                           float* total) {
  static_assert(kAvx2Nr == 4, "one hsum4_fixed per row");
  for (int i = 0; i < MR; ++i) {
    const __m128 s = hsum4_fixed(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    float* t = total + i * kAvx2Nr;
    const __m128 tv = _mm_loadu_ps(t);
    _mm_storeu_ps(t, sx != nullptr ? _mm_fmadd_ps(s, _mm_mul_ps(_mm_set1_ps(sx[i * ldsx]), _mm_loadu_ps(sw)), tv)
                                   : _mm_add_ps(tv, s));
  }
}

// acc[j] += xv * v[j] for a group's four converted weight vectors.
__attribute__((always_inline)) inline void fma4(__m256 xv, __m256 v0, __m256 v1, __m256 v2, __m256 v3,
                                                __m256 (&acc)[kAvx2Nr]) {
  acc[0] = _mm256_fmadd_ps(xv, v0, acc[0]);
  acc[1] = _mm256_fmadd_ps(xv, v1, acc[1]);
  acc[2] = _mm256_fmadd_ps(xv, v2, acc[2]);
  acc[3] = _mm256_fmadd_ps(xv, v3, acc[3]);
}

// One K block of MR rows of x (ldx apart) against a group's weights converted in wf, `padded` columns (a
// multiple of 8, zeros past the block's end on both sides). The group's four weight vectors load once a chunk
// and serve every row (a do-while, the loop form in which GCC kept the nt kernels' accumulators in registers).
template <int MR>
__attribute__((always_inline)) inline void avx2_tile(const float* x, int64_t ldx, const float (*wf)[kAvx2Block], int64_t padded, const float* sx,
                      int64_t ldsx, const float* sw, float* total) {
  __m256 acc[MR][kAvx2Nr];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kAvx2Nr; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t c = 0;
  do {
    const __m256 v0 = _mm256_load_ps(wf[0] + c), v1 = _mm256_load_ps(wf[1] + c);
    const __m256 v2 = _mm256_load_ps(wf[2] + c), v3 = _mm256_load_ps(wf[3] + c);
    for (int i = 0; i < MR; ++i) fma4(_mm256_loadu_ps(x + i * ldx + c), v0, v1, v2, v3, acc[i]);
    c += 8;
  } while (c < padded);
  avx2_add_block<MR>(acc, sx, ldsx, sw, total);
}

// The same block with the weights converted in registers: w[j] points at row j's block (rows past N repeat the
// last row; their sums are not stored); full = columns in whole chunks of 8, tail = a zero-padded copy of each
// row's last cols - full columns.
template <typename W, int MR>
__attribute__((always_inline)) inline void avx2_tile_direct(const float* x, int64_t ldx,
                                                            const typename W::Elem* const (&w)[kAvx2Nr], int64_t full,
                                                            const typename W::Elem (*tail)[8], bool has_tail,
                                                            const float* sx, int64_t ldsx, const float* sw,
                                                            float* total) {
  __m256 acc[MR][kAvx2Nr];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kAvx2Nr; ++j) acc[i][j] = _mm256_setzero_ps();
  const typename W::Elem *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
  static_assert(kAvx2Nr == 4, "the direct tile names its four weight rows");
  int64_t c = 0;
  if (full > 0) do {  // a do-while, as in avx2_tile
    const __m256 v0 = W::load8(w0 + c), v1 = W::load8(w1 + c), v2 = W::load8(w2 + c), v3 = W::load8(w3 + c);
    for (int i = 0; i < MR; ++i) fma4(_mm256_loadu_ps(x + i * ldx + c), v0, v1, v2, v3, acc[i]);
    c += 8;
  } while (c < full);
  if (has_tail)
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + full);
      for (int j = 0; j < kAvx2Nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, W::load8(tail[j]), acc[i][j]);
    }
  avx2_add_block<MR>(acc, sx, ldsx, sw, total);
}

struct Avx2Operands {
  int64_t m, n, k;
  const float* x;     // [M, ldx] float32, zero from K to ldx = ceil(K / 128) * 128
  int64_t ldx;
  const float* sx;    // [M, ldsx] per-block activation scales, or nullptr (no scales)
  int64_t ldsx;
  const float* bias;  // [N] or nullptr
};

// Weight rows [n0, n0 + kAvx2Nr) of K block b: pointers to the block (rows past N repeat the last), each row's last
// cols % 8 columns copied zero-padded into tail, and the scales.
template <typename E, typename Scale>
inline void avx2_group_block(const E* w, int64_t ldw, int64_t n, int64_t n0, int64_t c0, int64_t cols, int64_t b,
                             bool scaled, Scale& scale, const E* (&rows)[kAvx2Nr], E (&tail)[kAvx2Nr][8],
                             float (&sw)[kAvx2Nr]) {
  const int64_t full = cols / 8 * 8;
  for (int j = 0; j < kAvx2Nr; ++j) {
    const int64_t row = std::min(n0 + j, n - 1);
    rows[j] = w + row * ldw + c0;
    sw[j] = scaled ? scale(row, b) : 0.f;
    if (full < cols)
      for (int64_t c = 0; c < 8; ++c) tail[j][c] = full + c < cols ? rows[j][full + c] : E(0);
  }
}

// The same K block of the group kAvx2Prefetch ahead, into L1: weight rows are too short (a few hundred bytes
// to a few KB) for the hardware prefetchers to reach DRAM speed (default model at 1 row, 2 threads of a Zen 3:
// 20.7 -> 8.2 ms for the FP8 layers).
template <typename E>
inline void avx2_prefetch_ahead(const E* const (&rows)[kAvx2Nr], int64_t ldw, int64_t cols) {
  for (int j = 0; j < kAvx2Nr; ++j)
    for (int64_t c = 0; c < cols * static_cast<int64_t>(sizeof(E)); c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[j] + kAvx2Prefetch * kAvx2Nr * ldw) + c, _MM_HINT_T0);
}

template <typename T>
inline void avx2_store(const Avx2Operands& op, const float* total, int64_t m0, int64_t mb, int64_t n0, T* y) {
  const int64_t nr = std::min<int64_t>(kAvx2Nr, op.n - n0);
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < nr; ++j) {
      const float v = total[i * kAvx2Nr + j] + (op.bias != nullptr ? op.bias[n0 + j] : 0.f);
      y[(m0 + i) * op.n + n0 + j] = static_cast<T>(v);  // c10::BFloat16 rounds to nearest even
    }
}

// y[m, n] (N apart) = the blocked sums plus bias, weights W::Elem [N, ldw]; scale(row, b) is weight row `row`'s
// scale for K block b (unused without sx).
template <typename W, typename T, typename Scale>
void avx2_linear(const Avx2Operands& op, const typename W::Elem* w, int64_t ldw, T* y, Scale&& scale) {
  using E = typename W::Elem;
  const int64_t nkb = cdiv(op.k, kAvx2Block), groups = cdiv(op.n, kAvx2Nr);
  const bool scaled = op.sx != nullptr;
  auto sx_at = [&](int64_t m, int64_t b) { return scaled ? op.sx + m * op.ldsx + b : nullptr; };
  if (op.m <= kAvx2DirectM) {  // converted in registers
    at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
      const SubnormalsOn subnormals(W::kSubnormal);
      E tail[kAvx2Nr][8];
      const E* rows[kAvx2Nr];
      float total[kAvx2DirectM * kAvx2Nr], sw[kAvx2Nr];
      for (int64_t g = g0; g < g1; ++g) {
        std::fill_n(total, op.m * kAvx2Nr, 0.f);
        for (int64_t b = 0; b < nkb; ++b) {
          const int64_t c0 = b * kAvx2Block, cols = std::min(kAvx2Block, op.k - c0), full = cols / 8 * 8;
          avx2_group_block(w, ldw, op.n, g * kAvx2Nr, c0, cols, b, scaled, scale, rows, tail, sw);
          if (g + kAvx2Prefetch < g1) avx2_prefetch_ahead(rows, ldw, cols);
          int64_t i = 0;
          for (; i + 2 <= op.m; i += 2)  // rows after the first pair read the group's block from L1
            avx2_tile_direct<W, 2>(op.x + i * op.ldx + c0, op.ldx, rows, full, tail, full < cols, sx_at(i, b), op.ldsx,
                                   sw, total + i * kAvx2Nr);
          if (i < op.m)
            avx2_tile_direct<W, 1>(op.x + i * op.ldx + c0, op.ldx, rows, full, tail, full < cols, sx_at(i, b), op.ldsx,
                                   sw, total + i * kAvx2Nr);
        }
        avx2_store(op, total, 0, op.m, g * kAvx2Nr, y);
      }
    });
    return;
  }
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {  // converted once per block into wf
    const SubnormalsOn subnormals(W::kSubnormal);
    alignas(32) float wf[kAvx2Nr][kAvx2Block];
    E tail[kAvx2Nr][8];
    const E* rows[kAvx2Nr];
    float total[kAvx2Mb * kAvx2Nr], sw[kAvx2Nr];
    for (int64_t m0 = 0; m0 < op.m; m0 += kAvx2Mb) {
      const int64_t mb = std::min(kAvx2Mb, op.m - m0);
      for (int64_t g = g0; g < g1; ++g) {
        std::fill_n(total, mb * kAvx2Nr, 0.f);
        for (int64_t b = 0; b < nkb; ++b) {
          const int64_t c0 = b * kAvx2Block, cols = std::min(kAvx2Block, op.k - c0);
          const int64_t full = cols / 8 * 8, padded = cdiv(cols, 8) * 8;
          avx2_group_block(w, ldw, op.n, g * kAvx2Nr, c0, cols, b, scaled, scale, rows, tail, sw);
          if (g + kAvx2Prefetch < g1) avx2_prefetch_ahead(rows, ldw, cols);
          for (int j = 0; j < kAvx2Nr; ++j) {
            for (int64_t c = 0; c < full; c += 8) _mm256_store_ps(wf[j] + c, W::load8(rows[j] + c));
            if (padded > full) _mm256_store_ps(wf[j] + full, W::load8(tail[j]));
          }
          const float* xb = op.x + m0 * op.ldx + c0;
          int64_t i = 0;
          for (; i + kAvx2Mr <= mb; i += kAvx2Mr)
            avx2_tile<kAvx2Mr>(xb + i * op.ldx, op.ldx, wf, padded, sx_at(m0 + i, b), op.ldsx, sw, total + i * kAvx2Nr);
          for (; i + 2 <= mb; i += 2)
            avx2_tile<2>(xb + i * op.ldx, op.ldx, wf, padded, sx_at(m0 + i, b), op.ldsx, sw, total + i * kAvx2Nr);
          for (; i < mb; ++i)
            avx2_tile<1>(xb + i * op.ldx, op.ldx, wf, padded, sx_at(m0 + i, b), op.ldsx, sw, total + i * kAvx2Nr);
        }
        avx2_store(op, total, m0, mb, g * kAvx2Nr, y);
      }
    }
  });
}

#endif  // FP8E_AVX2_KERNELS

}  // namespace fp8e
