// W8A8 blockwise FP8 (E4M3) linear layers and weight quantization for CPUs.
//
// Numerics follow fp8engine/weights/quant.py bit for bit: 1x128 activation groups, 128x128 weight
// blocks, scale = max(amax, 1e-12) / 448 (optionally rounded up to a power of two), x / scale in
// float32, clamp to +-448, round-to-nearest-even to E4M3. Every E4M3 value is exactly a bf16, so the
// dot products run on AVX512-BF16 (vdpbf16ps), or on AMX tiles (tdpbf16ps) where the CPU has them, over
// operands converted from E4M3; each 128-wide K block is summed in float32 and scaled once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "amx.h"
#include "e4m3.h"
#include "linear_common.h"
#include "next_weight.h"

namespace {

using namespace fp8e;

constexpr int64_t kBlock = 128;
constexpr float kMinAmax = 1e-12f;

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// scale = max(amax, 1e-12) / 448; ue8m0 rounds it up to a power of two exactly (mantissa carry).
float block_scale(float amax, bool ue8m0) {
  const float s = (amax < kMinAmax ? kMinAmax : amax) / kFp8Max;  // a NaN amax stays NaN
  if (!ue8m0 || std::isnan(s)) return s;
  return f32_from_bits((f32_bits(s) + 0x7FFFFFu) & 0x7F800000u);
}

template <typename T>
T from_f32(float v) {
  return static_cast<T>(v);  // c10::BFloat16 rounds to nearest even, like Tensor.to()
}

#ifdef FP8E_AVX512

__m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
__m512 load_f32(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
__m512 load_f32(const at::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// Calls f(offset, mask) over 16-lane chunks of [0, n); whole chunks get a constant all-ones mask.
template <typename F>
void for_chunks16(int64_t n, F&& f) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) f(c, __mmask16(0xFFFF));
  if (c < n) f(c, tail_mask16(n - c));
}

// E4M3 magnitude codes (round to nearest even) of the bit patterns a of |x|, x not NaN and below 480:
// below 2^-6 adding 2^14 lets the fp32 adder round onto the subnormal grid, above it the exponent is
// rebiased while rounding on the top 3 mantissa bits.
__m512i e4m3_magnitude_codes(__m512i a) {
  const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23));
  const __m512i denorm = _mm512_set1_epi32(141 << 23);
  const __m512i rs = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i rn = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(int(0xC407FFFFu))), odd), 20);
  return _mm512_mask_blend_epi32(small, rn, rs);
}

// c10's float -> float8_e4m3fn conversion for 16 lanes (round to nearest even; >= 480 and NaN -> 0x7F),
// one code per 32-bit lane (the upper 24 bits zero).
__m512i e4m3_dwords_from_f32x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __mmask16 nan = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(1087 << 20));
  const __m512i r = _mm512_mask_mov_epi32(e4m3_magnitude_codes(a), nan, _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
}

// v / scale rounded correctly, as a division would, at the cost of a multiply and two FMAs (a
// vector division is several times slower): q = v * recip with recip = 1 / scale rounded, then one
// Markstein correction with the exact remainder v - q * scale. Zero and infinite quotients (whose
// remainder would be 0 or NaN) pass through with their sign.
__m512 divide(__m512 v, __m512 scale, __m512 recip) {
  const __m512 q = _mm512_mul_ps(v, recip);
  const __m512 corrected = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, scale, v), recip, q);
  return _mm512_mask_mov_ps(corrected, _mm512_fpclass_ps_mask(q, 0x1E), q);  // +-0 and +-inf kept as they are
}

// E4M3 codes (one per 32-bit lane) of clamp(v / scale), with the quotient rounded as the reference's
// division rounds it.
__m512i quantize_f32x16(__m512 v, __m512 scale, __m512 recip) {
  const __m512 q = divide(v, scale, recip);
  // max(lo, q) / min(hi, .) return q when q is NaN, so NaN survives like torch.clamp.
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(kFp8Max), _mm512_max_ps(_mm512_set1_ps(-kFp8Max), q));
  return e4m3_dwords_from_f32x16(c);
}

// quantize_f32x16 for a finite, positive scale and finite v (what a validated weight update has):
// the quotient of |v| needs no zero/infinity fix-up and one clamp, and no lane can become NaN; the
// sign goes back on at the end. Same codes as quantize_f32x16.
__m512i quantize_finite_f32x16(__m512 v, __m512 scale, __m512 recip) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)));
  const __m512 av = _mm512_castsi512_ps(_mm512_xor_si512(bits, sign));
  const __m512 q0 = _mm512_mul_ps(av, recip);
  const __m512 q = _mm512_min_ps(_mm512_fmadd_ps(_mm512_fnmadd_ps(q0, scale, av), recip, q0), _mm512_set1_ps(kFp8Max));
  return _mm512_or_si512(e4m3_magnitude_codes(_mm512_castps_si512(q)), _mm512_srli_epi32(sign, 24));
}

// |v| bit patterns order like the values and a NaN's exceed them all, so an integer max is an amax
// that propagates NaN.
template <typename T>
float amax_rows(const T* p, int64_t ld, int64_t rows, int64_t cols) {
  __m512i mx = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r)
    for_chunks16(cols, [&](int64_t c, __mmask16 m) {
      const __m512i bits = _mm512_castps_si512(load_f32(p + r * ld + c, m));
      mx = _mm512_max_epu32(mx, _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
    });
  return f32_from_bits(_mm512_reduce_max_epu32(mx));
}

// Calls f(offset, mask) over 32-lane chunks of [0, n); whole chunks get a constant all-ones mask (a
// plain load or store: the masked forms are slow on Zen 5).
template <typename F>
void for_chunks32(int64_t n, F&& f) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) f(c, ~__mmask32(0));
  if (c < n) f(c, tail_mask32(n - c));
}

// The largest of 32 bf16 magnitudes (bit patterns, sign cleared) as a float.
float bf16_max(__m512i mx) {
  mx = _mm512_max_epu32(_mm512_srli_epi32(mx, 16), _mm512_and_si512(mx, _mm512_set1_epi32(0xFFFF)));
  return f32_from_bits(_mm512_reduce_max_epu32(mx) << 16);
}

// bf16 rows: the same ordering holds for the 16-bit patterns, so one integer max covers 32 values.
float amax_rows(const at::BFloat16* p, int64_t ld, int64_t rows, int64_t cols) {
  __m512i mx = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r)
    for_chunks32(cols, [&](int64_t c, __mmask32 m) {
      const __m512i v = _mm512_maskz_loadu_epi16(m, p + r * ld + c);
      mx = _mm512_max_epu16(mx, _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF)));
    });
  return bf16_max(mx);
}

template <typename T>
void quantize_span(const T* src, uint8_t* dst, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale), recip = _mm512_set1_ps(1.f / scale);
  for_chunks16(n, [&](int64_t c, __mmask16 m) {
    const __m128i q = _mm512_cvtepi32_epi8(quantize_f32x16(load_f32(src + c, m), s, recip));
    if (m == 0xFFFF) {  // masked stores are slow on Zen 5
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c), q);
    } else {
      _mm_mask_storeu_epi8(dst + c, m, q);
    }
  });
}

// bf16: 32 values per load, split into the fp32 of the even elements (shifted up) and of the odd ones
// (masked), whose codes recombine into 16-bit pairs in one narrowing.
template <bool kFinite>
void quantize_span_bf16(const at::BFloat16* src, uint8_t* dst, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale), recip = _mm512_set1_ps(1.f / scale);
  const auto quantize = kFinite ? quantize_finite_f32x16 : quantize_f32x16;
  for_chunks32(n, [&](int64_t c, __mmask32 m) {
    const __m512i v = _mm512_maskz_loadu_epi16(m, src + c);
    const __m512i even = quantize(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), s, recip);
    const __m512 odd_f32 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
    const __m512i odd = quantize(odd_f32, s, recip);
    const __m256i q = _mm512_cvtepi32_epi16(_mm512_or_si512(even, _mm512_slli_epi32(odd, 8)));
    if (m == ~__mmask32(0)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), q);
    } else {
      _mm256_mask_storeu_epi8(dst + c, m, q);
    }
  });
}

// A finite, positive block scale means the block is finite (its amax is), so the fast path applies.
void quantize_span(const at::BFloat16* src, uint8_t* dst, int64_t n, float scale) {
  if (std::isfinite(scale) && scale > 0.f) {
    quantize_span_bf16<true>(src, dst, n, scale);
  } else {
    quantize_span_bf16<false>(src, dst, n, scale);
  }
}

#else

template <typename T>
float to_f32(T v) {
  return static_cast<float>(v);
}

float clamp_fp8(float v) { return std::isnan(v) ? v : std::min(kFp8Max, std::max(-kFp8Max, v)); }

template <typename T>
float amax_rows(const T* p, int64_t ld, int64_t rows, int64_t cols) {
  float mx = 0.f;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = to_f32(p[r * ld + c]);
      if (std::isnan(v)) return v;
      mx = std::max(mx, std::fabs(v));
    }
  return mx;
}

template <typename T>
void quantize_span(const T* src, uint8_t* dst, int64_t n, float scale) {
  for (int64_t c = 0; c < n; ++c) dst[c] = e4m3_from_f32(clamp_fp8(to_f32(src[c]) / scale));
}

#endif  // FP8E_AVX512

// ------------------------------------------------------------------------------------------------
// Weight quantization: one 128-row panel per task, read row by row over the whole K (long runs the
// hardware prefetchers follow; 128x128 blocks of short row pieces left this DRAM-latency bound), once
// for the block amaxes and once to quantize while the panel is still in L2.

// max(a, b) that keeps a NaN from either side, as an amax must.
float nan_max(float a, float b) { return std::isnan(a) || a >= b ? a : b; }

// amax[b] over rows x 128 columns of block b, row by row.
template <typename T>
void panel_amax(const T* p, int64_t ld, int64_t rows, int64_t k, float* amax) {
  const int64_t nbk = cdiv(k, kBlock);
  std::fill_n(amax, nbk, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nbk; ++b)
      amax[b] = nan_max(amax[b], amax_rows(p + r * ld + b * kBlock, ld, 1, std::min(kBlock, k - b * kBlock)));
}

#ifdef FP8E_AVX512
// bf16: one integer max per 32 values into a vector per block, reduced once per panel.
void panel_amax(const at::BFloat16* p, int64_t ld, int64_t rows, int64_t k, float* amax) {
  const int64_t nbk = cdiv(k, kBlock);
  auto acc = alloc_buffer<uint16_t>(nbk * 32);  // a vector of 32 maxima per block
  std::fill_n(acc.get(), nbk * 32, uint16_t(0));
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  for (int64_t r = 0; r < rows; ++r)
    for_chunks32(k, [&](int64_t c, __mmask32 m) {
      uint16_t* a = acc.get() + c / kBlock * 32;
      const __m512i v = _mm512_and_si512(_mm512_maskz_loadu_epi16(m, p + r * ld + c), magnitude);
      _mm512_store_si512(a, _mm512_max_epu16(_mm512_load_si512(a), v));
    });
  for (int64_t b = 0; b < nbk; ++b) amax[b] = bf16_max(_mm512_load_si512(acc.get() + b * 32));
}
#endif

// Codes of rows x k values into q (rows k apart) with the panel's block scales s.
template <typename T>
void quantize_panel(const T* p, int64_t ld, int64_t rows, int64_t k, const float* s, uint8_t* q) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cdiv(k, kBlock); ++b)
      quantize_span(p + r * ld + b * kBlock, q + r * k + b * kBlock, std::min(kBlock, k - b * kBlock), s[b]);
}

// Which halves of the work a call does: the block scales, the codes, or both. Weight updates compute
// the scales while validating (staging: a NaN or Inf shows up as a non-finite scale) and quantize with
// them at commit, so the weights are read once per phase.
enum class QuantWork { kScales, kCodes, kBoth };

template <typename T>
void quantize_weight_impl(const at::Tensor& w, uint8_t* q, float* scales, bool ue8m0, QuantWork work) {
  const int64_t n = w.size(0), k = w.size(1), ld = w.stride(0);
  const int64_t nbk = cdiv(k, kBlock), panels = cdiv(n, kBlock);
  const T* base = w.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t r0 = panel * kBlock, rows = std::min(kBlock, n - r0);
      float* s = scales + panel * nbk;
      if (work != QuantWork::kCodes) {
        panel_amax(base + r0 * ld, ld, rows, k, s);
        for (int64_t b = 0; b < nbk; ++b) s[b] = block_scale(s[b], ue8m0);
      }
      if (work != QuantWork::kScales) quantize_panel(base + r0 * ld, ld, rows, k, s, q + r0 * k);
    }
  });
}

void quantize_weight(const at::Tensor& w, const at::Tensor* out_q, const at::Tensor& out_scale, bool ue8m0,
                     QuantWork work) {
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "fp8_quantize_weight_: w must be 2-D with unit inner stride");
  const int64_t n = w.size(0), k = w.size(1);
  if (out_q != nullptr)
    TORCH_CHECK(out_q->scalar_type() == at::kFloat8_e4m3fn && out_q->is_contiguous() && out_q->sizes() == w.sizes() &&
                    out_q->device().is_cpu(),
                "fp8_quantize_weight_: out_q must be a contiguous CPU float8_e4m3fn tensor shaped like w");
  TORCH_CHECK(out_scale.scalar_type() == at::kFloat && out_scale.is_contiguous() &&
                  out_scale.numel() == cdiv(n, kBlock) * cdiv(k, kBlock),
              "fp8_quantize_weight_: out_scale must be contiguous float32 [ceil(N/128), ceil(K/128)]");
  TORCH_CHECK(w.device().is_cpu() && out_scale.device().is_cpu(), "fp8_quantize_weight_: CPU tensors only");
  auto* q = out_q != nullptr ? static_cast<uint8_t*>(out_q->data_ptr()) : nullptr;
  float* scales = out_scale.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: return quantize_weight_impl<float>(w, q, scales, ue8m0, work);
    case at::kBFloat16: return quantize_weight_impl<at::BFloat16>(w, q, scales, ue8m0, work);
    case at::kHalf: return quantize_weight_impl<at::Half>(w, q, scales, ue8m0, work);
    default: TORCH_CHECK(false, "fp8_quantize_weight_: unsupported weight dtype ", w.scalar_type());
  }
}

// scales_given: out_scale already holds this weight's block scales (from fp8_block_scales_).
void fp8_quantize_weight_(const at::Tensor& w, const at::Tensor& out_q, const at::Tensor& out_scale, bool ue8m0,
                          bool scales_given) {
  quantize_weight(w, &out_q, out_scale, ue8m0, scales_given ? QuantWork::kCodes : QuantWork::kBoth);
}

// Returns whether every scale is finite, i.e. w holds no NaN or Inf.
bool fp8_block_scales_(const at::Tensor& w, const at::Tensor& out_scale, bool ue8m0) {
  quantize_weight(w, nullptr, out_scale, ue8m0, QuantWork::kScales);
  const float* s = out_scale.data_ptr<float>();
  return std::all_of(s, s + out_scale.numel(), [](float v) { return std::isfinite(v); });
}

struct Problem {
  int64_t m, n, k, nkb;
  const uint8_t* w;   // [N, K] E4M3
  const float* sw;    // [ceil(N/128), nkb], or [scale rows, nkb] read through scale_rows
  const float* bias;  // [N] or nullptr
  const int32_t* scale_rows;  // [N] row of sw holding each output row's scales, or nullptr (row / 128)
  bool nt16 = false;          // w in the nt16 layout (weights/layout.py): whole groups of 16 rows interleaved
  // Whether the 16 rows from row0 (a multiple of 16) are an interleaved group; rows past the last whole group
  // are stored as rows.
  bool grouped(int64_t row0) const { return nt16 && row0 + 16 <= n; }
  float sw_at(int64_t row, int64_t b) const {
    return sw[(scale_rows ? scale_rows[row] : row / kBlock) * nkb + b];
  }
  float bias_at(int64_t row) const { return bias ? bias[row] : 0.f; }
};

#ifdef FP8E_BF16_KERNELS

// bf16 operands use "lane order": each 64 consecutive k become two vectors of 32 bf16, the first
// holding k = 16L + 0..7 and the second k = 16L + 8..15 in 128-bit lane L (what unpacking bytes
// within lanes produces). Activations and weights share it, so the dot products are unchanged and
// each 32-bit lane still holds a pair of neighbouring k.

// clamp(v / scale) rounded to the nearest E4M3 value, as a float (the sign of a zero may differ from
// e4m3_from_f32, which no product sees).
__m512 e4m3_round_f32x16(__m512 v, __m512 scale, __m512 recip) {
  const __m512 q = divide(v, scale, recip);
  return e4m3_round_ps(_mm512_min_ps(_mm512_set1_ps(kFp8Max), _mm512_max_ps(_mm512_set1_ps(-kFp8Max), q)));
}

// Quantizes one row's K block (cols <= 128) into 4 vectors of 32 bf16 in lane order. E4M3 values are
// normal bf16 numbers, so vcvtne2ps2bf16 converts them exactly.
template <bool kFull, typename T>
void quantize_pairs(const T* src, int64_t cols, float scale, __m512i (&out)[4]) {
  const __m512 sv = _mm512_set1_ps(scale), rv = _mm512_set1_ps(1.f / scale);
  for (int h = 0; h < 2; ++h) {
    __m512i bf[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t k = 64 * h + 32 * i;
      const __mmask16 m0 = kFull ? __mmask16(0xFFFF) : tail_mask16(cols - k);
      const __mmask16 m1 = kFull ? __mmask16(0xFFFF) : tail_mask16(cols - k - 16);
      bf[i] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e4m3_round_f32x16(load_f32(src + k + 16, m1), sv, rv),
                                                            e4m3_round_f32x16(load_f32(src + k, m0), sv, rv)));
    }
    out[2 * h] = _mm512_shuffle_i64x2(bf[0], bf[1], 0x88);      // 128-bit lanes 0, 2 of each
    out[2 * h + 1] = _mm512_shuffle_i64x2(bf[0], bf[1], 0xDD);  // lanes 1, 3
  }
}

// ---- small M: dot products along K, MR activation rows x NR weight rows in registers -----------

struct RowsBf16 {
  int64_t kp = 0;
  Buffer<uint16_t> x;  // [M, kp] bf16 in lane order, zero padded to whole blocks
  Buffer<float> scale;  // [M, nkb]
};

// mpad > m: rows m .. mpad zero (the AMX A tiles read whole vectors of 16 rows).
template <typename T>
RowsBf16 quantize_rows(const T* x, int64_t m, int64_t k, int64_t nkb, bool ue8m0, int64_t mpad = 0) {
  const int64_t rows = std::max(m, mpad);
  RowsBf16 out{nkb * kBlock, alloc_buffer<uint16_t>(rows * nkb * kBlock), alloc_buffer<float>(rows * nkb)};
  std::memset(out.x.get() + m * out.kp, 0, sizeof(uint16_t) * (rows - m) * out.kp);
  std::fill_n(out.scale.get() + m * nkb, (rows - m) * nkb, 0.f);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nkb; ++b) {
        const T* src = x + r * k + b * kBlock;
        const int64_t cols = std::min(kBlock, k - b * kBlock);
        const float s = block_scale(amax_rows(src, 0, 1, cols), ue8m0);
        out.scale[r * nkb + b] = s;
        __m512i pairs[4];
        if (cols == kBlock) {
          quantize_pairs<true>(src, cols, s, pairs);
        } else {
          quantize_pairs<false>(src, cols, s, pairs);
        }
        for (int c = 0; c < 4; ++c) _mm512_storeu_si512(out.x.get() + r * out.kp + b * kBlock + 32 * c, pairs[c]);
      }
  });
  return out;
}

// dst[0, 128) = bf16 of w[row, 128 b + c] (zero past K), in lane order.
void convert_row_block(const Problem& p, const E4m3ToBf16& cvt, int64_t row, int64_t b, uint16_t* dst) {
  const int64_t k0 = b * kBlock;
  const uint8_t* src = p.w + row * p.k + k0;
  __m512i v[4];
  if (p.k - k0 >= kBlock) {  // plain loads: masked ones cost more on Zen 5 even with every lane set
    cvt(_mm512_loadu_si512(src), v[0], v[1]);
    cvt(_mm512_loadu_si512(src + 64), v[2], v[3]);
  } else {
    cvt(_mm512_maskz_loadu_epi8(tail_mask64(p.k - k0), src), v[0], v[1]);
    cvt(_mm512_maskz_loadu_epi8(tail_mask64(p.k - k0 - 64), src + 64), v[2], v[3]);
  }
  for (int i = 0; i < 4; ++i) _mm512_store_si512(dst + 32 * i, v[i]);
}

// The nt16 layout (weights/layout.py) stores each whole group of 16 weight rows as K / 4 lines of 64 bytes, line c
// holding columns 4 c .. 4 c + 3 of the 16 rows so that the converter's two outputs are pair 2 c and pair 2 c + 1
// of rows 0..15, lane r row r: the vectors nt's chains take, with no transposition. nt16_pair_slot gives where the
// chains (and the GEMM's converted rows) take pair 2 c of a K block, line c of it: pairs in lane order, as
// nt_store_pairs, 2 c + 1 the slot after.
inline int64_t nt16_pair_slot(int64_t c) { return (c >> 4) * 32 + (c & 2) * 8 + 4 * ((c >> 2) & 3) + 2 * (c & 1); }

// K block b of the nt16 group at row0 as 16 rows of dst (kBlock bf16 apart), each as convert_row_block leaves a
// row: the group's pair vectors (lanes: rows) put at their slots, then transposed 16 slots at a time.
void nt16_convert_rows(const Problem& p, const E4m3ToBf16& cvt, int64_t row0, int64_t b, uint16_t* dst) {
  const int64_t cols = std::min(kBlock, p.k - b * kBlock);
  const uint8_t* src = p.w + row0 * p.k + b * kBlock * 16;
  __m512 t[4][16];
  if (cols < kBlock)
    for (auto& h : t)
      for (auto& v : h) v = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols / 4; ++c) {
    __m512i a, d;
    cvt(_mm512_loadu_si512(src + 64 * c), a, d);
    const int64_t q = nt16_pair_slot(c);
    t[q / 16][q % 16] = _mm512_castsi512_ps(a);
    t[(q + 1) / 16][(q + 1) % 16] = _mm512_castsi512_ps(d);
  }
  for (int h = 0; h < 4; ++h) {
    transpose16x16(t[h]);
    for (int r = 0; r < 16; ++r) _mm512_store_ps(reinterpret_cast<float*>(dst + r * kBlock + 32 * h), t[h][r]);
  }
}

// acc[i][j] += x row i . w row j over [k0, kend) (at most one K block), in 64-k chunks. Each weight
// load also prefetches the line `ahead` bytes on (the next tile's row at the same k) into L1, and the line
// twice as far on (the tile after that) into L2: rows of a few hundred bytes are too short for the hardware
// prefetchers to get going, and without the first the loop waited on DRAM (30 layers of the default model at
// M=1: 5.7 -> 4.1 ms). The second keeps more lines in flight than L1's fill buffers hold: one weight streamed
// from DRAM at M=1, 18.4 -> 22.1 GB/s (28 MB), 17.1 -> 20.3 (3072 x 576), and a batch-1 decode step of the
// default model ~6% faster (docs/benchmarks.md); further on (4, 8, 16 tiles) or L2 alone (T1, T2) gained less.
//
// At 3-4 rows GCC read the activations from memory again for every weight row and moved the rows' prefetch pointers
// (row + distance, one per row and distance) in and out of vector registers. Opaque copies (empty asm) keep the
// activations in registers and make the prefetch addresses row pointer + one offset: 30 FP8 layers from DRAM at
// M=4 6.63-7.90 -> 6.26-7.42 ms, the FP8 head 1.53-1.61 -> 1.44-1.52, M=3 5.71 -> 5.58 (medians of 9-11 alternating
// rounds, 2 threads of a Zen 4, the same bits). At 1-2 rows, where the weights' DRAM stream sets the time, it
// changed nothing (3.71 / 3.76 ms), so they keep the plain code.
template <int MR, int NR, bool kFull>
void gemv_block(const E4m3ToBf16& cvt, const uint8_t* const (&wr)[NR], int64_t ahead, const uint16_t* xb, int64_t kp,
                int64_t k0, int64_t kend, __m512 (&acc)[MR][NR]) {
  for (int64_t k = k0; k < (kFull ? k0 + kBlock : kend); k += 64) {
    const __mmask64 mask = kFull ? ~__mmask64(0) : tail_mask64(kend - k);
    __m512bh xv[MR][2];
    for (int i = 0; i < MR; ++i)
      for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_loadu_si512(xb + i * kp + k + 32 * h);
        if constexpr (MR >= 3) asm("" : "+v"(v));
        xv[i][h] = as_bh(v);
      }
    int64_t k1 = k + ahead, k2 = k + 2 * ahead;
    if constexpr (MR >= 3) asm("" : "+r"(k1), "+r"(k2));
    for (int j = 0; j < NR; ++j) {
      __m512i w0, w1;
      _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k1), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k2), _MM_HINT_T2);
      cvt(_mm512_maskz_loadu_epi8(mask, wr[j] + k), w0, w1);
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i][j], xv[i][0], as_bh(w0)), xv[i][1], as_bh(w1));
    }
  }
}

// res[i * NR + j] = y[m0 + i, n0 + j] before bias. The block-scaled sums stay in registers (MR x NR of them
// next to as many accumulators) and each row's scale row is looked up once: the same arithmetic as keeping
// them in L1, whose per-block loads, stores and zeroing took a third of the time at M=1.
template <int MR, int NR>
void gemv_tile(const Problem& p, const E4m3ToBf16& cvt, const uint16_t* xb, int64_t kp, const float* sx,
               int64_t n0, float (&res)[kGemvAcc]) {
  const uint8_t* wr[NR];
  const float* swr[NR];
  for (int j = 0; j < NR; ++j) {
    const int64_t row = std::min(n0 + j, p.n - 1);  // clamped rows are dropped
    wr[j] = p.w + row * p.k;
    swr[j] = p.sw + (p.scale_rows ? p.scale_rows[row] : row / kBlock) * p.nkb;
  }
  __m512 tot[MR][NR];
  for (auto& row : tot)
    for (auto& t : row) t = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nkb; ++b) {
    __m512 acc[MR][NR];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    const int64_t k0 = b * kBlock, kend = std::min(p.k, k0 + kBlock);
    if (kend - k0 == kBlock) {
      gemv_block<MR, NR, true>(cvt, wr, NR * p.k, xb, kp, k0, kend, acc);
    } else {
      gemv_block<MR, NR, false>(cvt, wr, NR * p.k, xb, kp, k0, kend, acc);
    }
    for (int j = 0; j < NR; ++j)
      for (int i = 0; i < MR; ++i)
        tot[i][j] = _mm512_fmadd_ps(acc[i][j], _mm512_set1_ps(sx[i * p.nkb + b] * swr[j][b]), tot[i][j]);
  }
  alignas(64) float sums[kGemvAcc][16];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_store_ps(sums[i * NR + j], tot[i][j]);
  hsum8(sums, res);
  if (MR * NR > 8) hsum8(sums + 8, res + 8);
}

// Weight rows per register tile at MR activation rows. The tile holds 2 x MR x NR vectors (the block's sums and
// the block-scaled totals) beside 2 x MR of activations and the converter's 4 tables: at 3-4 rows the bf16
// kernel's 4 (linear_common.h) spill, 2 fit. Measured over the default model's 30 layers and FP8 head from DRAM
// (2 threads of a Zen 4, medians of 9 alternating rounds in one process, the same bits): M = 4 10.8-12.2 -> 9.0-10.3
// ms, M = 5 12.7-13.9 -> 10.9-13.0. 1-2 rows keep 8: there the weights' DRAM stream, not the spills, sets the time.
constexpr int fp8_gemv_nr(int mr) { return mr <= 2 ? 8 : 2; }

template <int MR, typename OutT>
void gemv_rows(const Problem& p, const E4m3ToBf16& cvt, const RowsBf16& x, int64_t m0, int64_t n0, OutT* y) {
  constexpr int NR = fp8_gemv_nr(MR);
  for (int64_t nj = n0; nj < std::min(p.n, n0 + kGemvRows); nj += NR) {
    float res[kGemvAcc];
    gemv_tile<MR, NR>(p, cvt, x.x.get() + m0 * x.kp, x.kp, x.scale.get() + m0 * p.nkb, nj, res);
    for (int j = 0; j < NR && nj + j < p.n; ++j)
      for (int i = 0; i < MR; ++i) y[(m0 + i) * p.n + nj + j] = from_f32<OutT>(res[i * NR + j] + p.bias_at(nj + j));
  }
}

template <typename OutT>
using GemvRowsFn = void (*)(const Problem&, const E4m3ToBf16&, const RowsBf16&, int64_t, int64_t, OutT*);
template <typename OutT>
constexpr GemvRowsFn<OutT> kGemvRowsFn[kGemvMaxRows + 1] = {
    nullptr, gemv_rows<1, OutT>, gemv_rows<2, OutT>, gemv_rows<3, OutT>, gemv_rows<4, OutT>};

template <typename T>
void linear_small_m(const Problem& p, const T* xin, bool ue8m0, T* y) {
  const RowsBf16 x = quantize_rows(xin, p.m, p.k, p.nkb, ue8m0);
  const int64_t groups = cdiv(p.n, kGemvRows);
  const int64_t rows_per_pass = cdiv(p.m, cdiv(p.m, kGemvMaxRows));  // balanced passes over the weights
  // Keep a task at >= ~64 KiB of weights so tiny layers are not split across threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kGemvRows * p.k));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    const E4m3ToBf16 cvt;
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m0 = 0; m0 < p.m; m0 += rows_per_pass)
        kGemvRowsFn<T>[std::min(rows_per_pass, p.m - m0)](p, cvt, x, m0, g * kGemvRows, y);
  });
}

// ---- large M (see linear_common.h) ------------------------------------------------------------
//
// A task owns kTileN weight rows and a range of 16-row activation vectors. Per K block it converts its
// weight rows to bf16 once (kTileN x 128, L1-resident), then runs the register-blocked micro kernel
// over the activation vectors, adding the scaled block result into a float32 tile.

constexpr int64_t kTileN = 48;
constexpr int64_t kPairs = kBlock / 2;

// Activations packed for the AVX-512 GEMM: 16-row vector mv of K block b, from at(b, mv), holds one bf16 pair of
// each row per 32-bit lane, pairs ld() floats apart, all rows side by side; sxp[b][m] are the group scales (0 for
// padding rows).
struct PackedX {
  int64_t mpad = 0;
  Buffer<float> xp;
  Buffer<float> sxp;
  // Side by side, one vector more than mpad: with M a multiple of 1024 the pairs would sit a multiple of
  // 4 KiB apart, all in the same few L1 sets, and the micro kernel's activation block (64 pairs x 64
  // rows) would evict itself between the weight rows that reuse it (M=2048: 10.2 -> 9.2 ms for 3072 x 576).
  int64_t ld() const { return mpad + 16; }
  float* at(int64_t b, int64_t mv) const { return xp.get() + b * kPairs * ld() + mv * 16; }
};

// Quantizes a 16-row x 1-block tile of activations straight into the packed layout.
template <bool kFull, typename T>
void pack_tile(const T* src, int64_t ld, int64_t rows, int64_t cols, bool ue8m0, float* scale, float* dst,
               int64_t ld_dst) {
  __m512 tiles[4][16];
  // Row amax for all 16 rows at once: the per-row maxima are transposed and reduced together.
  for (int r = 0; r < 16; ++r) {
    __m512i mx = _mm512_setzero_si512();
    for (int c = 0; c < 8 && r < rows; ++c) {
      const __mmask16 m = kFull ? __mmask16(0xFFFF) : tail_mask16(cols - 16 * c);
      const __m512i bits = _mm512_castps_si512(load_f32(src + r * ld + 16 * c, m));
      mx = _mm512_max_epu32(mx, _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
    }
    tiles[0][r] = _mm512_castsi512_ps(mx);
  }
  transpose16x16(tiles[0]);
  __m512i amax = _mm512_castps_si512(tiles[0][0]);
  for (int r = 1; r < 16; ++r) amax = _mm512_max_epu32(amax, _mm512_castps_si512(tiles[0][r]));
  alignas(64) float amax_f[16];
  _mm512_store_si512(amax_f, amax);
  for (int r = 0; r < 16; ++r) scale[r] = r < rows ? block_scale(amax_f[r], ue8m0) : 0.f;
  for (int r = 0; r < 16; ++r) {
    __m512i pairs[4] = {};
    if (r < rows) quantize_pairs<kFull>(src + r * ld, cols, scale[r], pairs);
    for (int c = 0; c < 4; ++c) tiles[c][r] = _mm512_castsi512_ps(pairs[c]);
  }
  for (int c = 0; c < 4; ++c) {
    transpose16x16(tiles[c]);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (c * 16 + i) * ld_dst, tiles[c][i]);
  }
}

template <typename T>
PackedX pack_activations(const T* x, int64_t m, int64_t k, int64_t nkb, bool ue8m0) {
  PackedX out{cdiv(m, 16) * 16, nullptr, nullptr};
  out.xp = alloc_buffer<float>(nkb * kPairs * out.ld());
  out.sxp = alloc_buffer<float>(nkb * out.mpad);
  const int64_t mvecs = out.mpad / 16;
  at::parallel_for(0, mvecs * nkb, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mv = t / nkb, b = t % nkb;
      const int64_t rows = std::min<int64_t>(16, m - mv * 16), cols = std::min(kBlock, k - b * kBlock);
      const T* src = x + mv * 16 * k + b * kBlock;
      float* scale = out.sxp.get() + b * out.mpad + mv * 16;
      if (cols == kBlock) {
        pack_tile<true>(src, k, rows, cols, ue8m0, scale, out.at(b, mv), out.ld());
      } else {
        pack_tile<false>(src, k, rows, cols, ue8m0, scale, out.at(b, mv), out.ld());
      }
    }
  });
  return out;
}

// wb[b][r][c] = bf16 of w[n0 + r, 128 b + c], r < tile_n: the task's whole tile, converted row by row,
// because tile_n consecutive rows are one contiguous stretch of the weight that the hardware prefetchers
// stream from DRAM (converting one 128-column block at a time read tile_n short strided pieces and
// stalled on each, without a software prefetch). The tile stays in L2 for the K blocks and the groups of
// activation rows that follow.
void convert_weight_tile(const Problem& p, const E4m3ToBf16& cvt, int64_t n0, int64_t tile_n, uint16_t* wb) {
  const int64_t rows = std::min(tile_n, p.n - n0);
  int64_t r = 0;
  for (; r + 16 <= rows && p.grouped(n0 + r); r += 16)
    for (int64_t b = 0; b < p.nkb; ++b) nt16_convert_rows(p, cvt, n0 + r, b, wb + (b * tile_n + r) * kBlock);
  for (; r < rows; ++r)
    for (int64_t b = 0; b < p.nkb; ++b) convert_row_block(p, cvt, n0 + r, b, wb + (b * tile_n + r) * kBlock);
}

// While a task computes, the FP8 rows of the one after it (next_n0, -1 for none) are prefetched into L2, a share
// per group of activation vectors, so that its conversion finds them there instead of waiting on DRAM (at M=128
// the conversion's share of a decode step halved; the step time did not move beyond this VM's noise).
struct TilePrefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines_per_call = 0;
  TilePrefetch(const Problem& p, int64_t next_n0, int64_t calls) {
    if (next_n0 < 0 || next_n0 >= p.n) return;
    next = reinterpret_cast<const char*>(p.w + next_n0 * p.k);
    end = reinterpret_cast<const char*>(p.w + std::min(p.n, next_n0 + kTileN) * p.k);
    lines_per_call = cdiv(cdiv(end - next, 64), std::max<int64_t>(calls, 1));
  }
  void step() {
    for (int64_t i = 0; i < lines_per_call && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

template <typename OutT>
void gemm_task(const Problem& p, const PackedX& x, const E4m3ToBf16& cvt, const GemmTask& t, int64_t next_n0,
               uint16_t* wb, float* ct, OutT* y) {
  const int64_t ldc = (t.mv1 - t.mv0) * 16;
  if (p.n - t.n0 < kTileN) std::memset(wb, 0, sizeof(uint16_t) * p.nkb * kTileN * kBlock);  // rows past N stay zero
  convert_weight_tile(p, cvt, t.n0, kTileN, wb);
  TilePrefetch ahead(p, next_n0, p.nkb * cdiv(t.mv1 - t.mv0, kMaxMv));
  for (int64_t b = 0; b < p.nkb; ++b) {
    const int64_t pairs = cdiv(std::min(kBlock, p.k - b * kBlock), 64) * 32;  // whole 64-k chunks
    const uint16_t* wblock = wb + b * kTileN * kBlock;
    for (int64_t mv = t.mv0; mv < t.mv1; mv += kMaxMv) {
      const int mvs = static_cast<int>(std::min<int64_t>(kMaxMv, t.mv1 - mv));
      const float* xp = x.at(b, mv);
      const float* sx = x.sxp.get() + b * x.mpad + mv * 16;
      const int nr = micro_nr(mvs);
      ahead.step();
      for (int64_t j0 = 0; j0 < kTileN; j0 += nr) {
        float sw[kMaxNr];
        for (int j = 0; j < nr; ++j) sw[j] = p.sw_at(std::min(t.n0 + j0 + j, p.n - 1), b);
        kMicro<true>[mvs](wblock + j0 * kBlock, kBlock, xp, x.ld(), pairs, sx, sw, ct + j0 * ldc + (mv - t.mv0) * 16,
                          ldc, b == 0);
      }
    }
  }
  write_tile(p.m, p.n, kTileN, p.bias, t, ct, ldc, y);
}

template <typename T>
void linear_large_m(const Problem& p, const T* xin, bool ue8m0, T* y) {
  const PackedX x = pack_activations(xin, p.m, p.k, p.nkb, ue8m0);
  const int64_t mvecs = x.mpad / 16, n_tiles = cdiv(p.n, kTileN);
  const int64_t chunks = l2_chunks(n_tiles, mvecs, at::get_num_threads(), 32 * p.k, 4);
  at::parallel_for(0, n_tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    const E4m3ToBf16 cvt;
    auto wb = alloc_buffer<uint16_t>(p.nkb * kTileN * kBlock);
    auto ct = alloc_buffer<float>(kTileN * cdiv(mvecs, chunks) * 16);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t next_n0 = i + 1 < end && n_tiles > 1 ? (i + 1) % n_tiles * kTileN : -1;
      gemm_task(p, x, cvt, chunk_major_task(i, n_tiles, kTileN, mvecs, chunks), next_n0, wb.get(), ct.get(), y);
    }
  });
}

// ---- small M: weight rows across the lanes (linear_common.h) ----------------------------------------

alignas(64) constexpr uint8_t kZeroRow[kBlock] = {};  // the E4M3 codes of rows past N

// The scales of K block b of the task's two weight vectors (rows past N repeat the last row's).
inline void nt_scales(const Problem& p, int64_t n0, int64_t b, __m512 (&sw)[kNtVecs]) {
  static_assert(kBlock % kNtRows == 0 && kNtVecs == 2, "a task's rows lie in one 128-row block");
  if (n0 + kNtRows <= p.n) {  // one scale for all the task's rows: broadcast it
    bool same = !p.scale_rows;
    if (!same) {
      const __m512i first = _mm512_set1_epi32(p.scale_rows[n0]);
      same = (_mm512_cmpeq_epi32_mask(_mm512_loadu_si512(p.scale_rows + n0), first) &
              _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(p.scale_rows + n0 + 16), first)) == 0xFFFF;
    }
    if (same) {
      for (auto& s : sw) s = _mm512_set1_ps(p.sw_at(n0, b));
      return;
    }
  }
  for (int v = 0; v < kNtVecs; ++v) {
    alignas(64) float s[16];
    for (int j = 0; j < 16; ++j) s[j] = p.sw_at(std::min(n0 + 16 * v + j, p.n - 1), b);
    sw[v] = _mm512_load_ps(s);
  }
}

// The prefetches of a task's K block b (rows: its weight rows there, as nt_convert_block's): the next block's lines
// into L1 (rows K bytes apart are too far apart for the hardware prefetchers at this stride) and the same block of
// the next task's rows into L2, as the gemv does (M=8 on AVX-512, a weight from DRAM 5.3-6.6 -> 5.8-7.3 GB/s; 8
// sequences decoding 267-282 -> 286-291 tok/s). Spread over the block's steps (16 bytes of 16 rows each, lines x
// kNtVecs x 4 of them): a burst of all 128 at the start overflowed the core's miss buffers.
struct NtPrefetch {
  const Problem& p;
  const uint8_t* const* rows;
  int64_t valid, b, steps, done = 0, issued = 0;
  NtPrefetch(const Problem& p, const uint8_t* const* rows, int64_t n0, int64_t b, int64_t line_vecs)
      : p(p), rows(rows), valid(std::min(kNtRows, p.n - n0)), b(b), steps(4 * line_vecs) {}
  void step() {
    const int64_t upto = std::min(++done * kNtRows / steps, valid);
    for (; issued < upto; ++issued) {
      const char* row = reinterpret_cast<const char*>(rows[issued]);
      if (b + 1 < p.nkb) {
        _mm_prefetch(row + kBlock, _MM_HINT_T0);
        _mm_prefetch(row + kBlock + 64, _MM_HINT_T0);
      }
      const char* after = row + kNtRows * p.k;
      _mm_prefetch(after, _MM_HINT_T2);  // past the weight's end it is dropped: a prefetch never faults
      _mm_prefetch(after + 64, _MM_HINT_T2);
    }
  }
};

// Two pairs of 16 rows in each t[j] (nt_convert_block) into wt at pairs q = line + ...: t[j] holds k = off + 4 j,
// off + 4 j + 2 of the rows, and in lane order k = 16 L + 2 d is pair 4 L + d of its 64-k line, k = 16 L + 8 + 2 d
// pair 16 + 4 L + d.
inline void nt_store_pairs(const E4m3ToBf16& cvt, __m512i (&l)[4], int64_t off, int v, float* wt) {
  const __m512i p0 = _mm512_unpacklo_epi16(l[0], l[1]), p1 = _mm512_unpackhi_epi16(l[0], l[1]);
  const __m512i q0 = _mm512_unpacklo_epi16(l[2], l[3]), q1 = _mm512_unpackhi_epi16(l[2], l[3]);
  const __m512i t[4] = {_mm512_unpacklo_epi32(p0, q0), _mm512_unpackhi_epi32(p0, q0), _mm512_unpacklo_epi32(p1, q1),
                        _mm512_unpackhi_epi32(p1, q1)};
  const int64_t line = off / 64 * 32, lane = off % 64 / 16;
  for (int j = 0; j < 4; ++j) {
    __m512i a, c;
    cvt(t[j], a, c);
    const int64_t q = line + (j < 2 ? 4 * lane + 2 * j : 16 + 4 * lane + 2 * (j - 2));
    _mm512_store_si512(wt + (q * kNtVecs + v) * 16, a);
    _mm512_store_si512(wt + ((q + 1) * kNtVecs + v) * 16, c);
  }
}

// Group row0's K block b (cols columns) into vector v of wt, as nt_convert_block leaves it. The next task's group
// is prefetched into L2 line by line, as nt's row-major path does.
inline void nt16_convert_group(const Problem& p, const E4m3ToBf16& cvt, int64_t row0, int64_t b, int64_t cols, int v,
                               float* wt) {
  const uint8_t* src = p.w + row0 * p.k + b * kBlock * 16;
  const int64_t lines = cols / 4, ahead = kNtRows * p.k;
  for (int64_t c = 0; c < lines; ++c) {
    __m512i a, d;
    cvt(_mm512_loadu_si512(src + 64 * c), a, d);
    _mm_prefetch(reinterpret_cast<const char*>(src + 64 * c + ahead), _MM_HINT_T2);
    const int64_t q = nt16_pair_slot(c);
    _mm512_store_si512(wt + (q * kNtVecs + v) * 16, a);
    _mm512_store_si512(wt + ((q + 1) * kNtVecs + v) * 16, d);
  }
  for (int64_t c = lines; c < cdiv(cols, 64) * 16; ++c) {  // the rest of the last 64-k chunk: zero, as past K
    const int64_t q = nt16_pair_slot(c);
    _mm512_store_si512(wt + (q * kNtVecs + v) * 16, _mm512_setzero_si512());
    _mm512_store_si512(wt + ((q + 1) * kNtVecs + v) * 16, _mm512_setzero_si512());
  }
}

// Converts K block b of the task's weight rows n0.. (zero past N and K) straight from E4M3 into wt, the pairs in
// the chain's (lane) order. Per 16 bytes of 16 rows, four vectors hold rows 4 L .. 4 L + 3 in lane L
// (lanes_of_rows), two rounds of in-lane unpacks (16-bit, then 32-bit) leave in each two pairs of all 16 rows, four
// rows' first pairs then their second in each lane, and the conversion's byte interleave splits them into one pair
// of the 16 rows a vector, lane r row r (nt_store_pairs). It replaced converting whole rows, then 16 x 16
// transposes: fewer shuffles and no round trip through memory (30 FP8 layers of the default model at M=1 from
// DRAM 7.7-8.3 -> 5.3-5.9 ms, M=5 11.7 -> 7.6-8.5 ms, over several runs of medians of 9 alternating rounds). Feeding
// the converted pairs straight into the chains at one or two rows, without wt, kept the pairs of each 64-k line's
// second half in registers until the first half's were in; it gained 7% at M=1 with the weight in L2 and nothing
// from DRAM, and lost at M=2 (one chain per weight vector waits on vdpbf16ps's latency, which the kNtGroup blocks
// of nt_blocks overlap).
void nt_convert_block(const Problem& p, const E4m3ToBf16& cvt_ref, int64_t n0, int64_t b, float* wt) {
  const E4m3ToBf16 cvt = cvt_ref;  // the tables in registers, not reloaded after the stores to wt (M=1, L2: -10%)
  const int64_t cols = std::min(kBlock, p.k - b * kBlock);
  bool grouped[kNtVecs], all_grouped = true;
  for (int v = 0; v < kNtVecs; ++v) {
    grouped[v] = p.grouped(n0 + 16 * v);
    all_grouped = all_grouped && grouped[v];
    if (grouped[v]) nt16_convert_group(p, cvt, n0 + 16 * v, b, cols, v, wt);
  }
  if (all_grouped) return;
  const uint8_t* rows[kNtRows];
  for (int64_t r = 0; r < kNtRows; ++r) rows[r] = n0 + r < p.n ? p.w + (n0 + r) * p.k + b * kBlock : kZeroRow;
  NtPrefetch prefetch(p, rows, n0, b, kNtVecs * cdiv(cols, 64));
  for (int v = 0; v < kNtVecs; ++v)
    for (int64_t off = 0; off < cdiv(cols, 64) * 64 && !grouped[v]; off += 16) {
      __m512i l[4];
      for (int i = 0; i < 4; ++i)
        l[i] = cols == kBlock ? lanes_of_rows(rows + 16 * v, i, off)
                              : lanes_of_rows(rows + 16 * v, i, off, tail_mask16(cols - off));
      nt_store_pairs(cvt, l, off, v, wt);
      prefetch.step();
    }
}

constexpr int64_t kNtWtFloats = kBlock / 2 * kNtRows;  // one converted K block of a task (nt_convert_block)
constexpr int kNtGroup = 4;  // K blocks nt_blocks takes at once

// The line of a K block that holds slots 2 j and 2 j + 1 (nt16_pair_slot's inverse).
constexpr int64_t nt16_line_of(int64_t j) { return (j & 0x11) | ((j >> 3) & 1) << 1 | ((j >> 1) & 3) << 2; }

// nt_blocks on a task whose two vectors are nt16 groups, at a row or two, without wt: each line converts in
// registers straight into its two pairs of 16 rows and enters the chains at once, the lines taken in slot order
// (the chains' order), so the sums are nt_blocks' bits. The G blocks from b0 may end with the partial last block of
// K, whose chain runs over whole 64-k chunks as nt_block's (zero weights past K). The next task's lines are
// prefetched into L2 as nt16's conversion does.
//
// kTiles sums in the AMX tiles' order instead (linear_common.h), so that the outputs are linear_amx's bits: the
// tiles' k is the lane-order slot here too (the converted weight rows and the packed activations share it), so a
// 32-k step is 16 slots: two FMA chains per output over them (the products of E4M3 values are exact and never
// denormal, so FMA rounds as the tiles add), folded into the block's sum as the tile does, then the block's scale
// and the running sum as amx_scale_tile applies them. (vdpbf16ps on pairs with one half zero gives the same bits
// without taking the weight's pairs apart, but took 1.2x the time of this at one row, 2x at six, on the Xeon.)
template <int G, int MR, bool kTiles = false>
void nt16_blocks(const Problem& p, const E4m3ToBf16& cvt_ref, int64_t n0, int64_t b0, const uint16_t* xb,
                 int64_t ldx, const float* sx, int64_t sx_ld, const __m512 (*sw)[kNtVecs], float* tot, bool first,
                 intptr_t ahead) {
  static_assert(kNtVecs == 2, "a task is two groups");
  const E4m3ToBf16 cvt = cvt_ref;
  const uint8_t* base[kNtVecs] = {p.w + n0 * p.k + b0 * kBlock * 16, p.w + (n0 + 16) * p.k + b0 * kBlock * 16};
  const int64_t last_cols = std::min(kBlock, p.k - (b0 + G - 1) * kBlock);
  const int64_t last_lines = last_cols / 4, last_slot_pairs = cdiv(last_cols, 64) * 16;
  __m512 acc[G][MR][kNtVecs], even[G][MR][kNtVecs], odd[G][MR][kNtVecs];  // even, odd: kTiles' step chains
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kNtVecs; ++v) acc[g][i][v] = even[g][i][v] = odd[g][i][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kBlock / 4; ++j) {
    const int64_t line = nt16_line_of(j);
    for (int g = 0; g < G; ++g) {
      const bool last = g == G - 1;
      if (last && j >= last_slot_pairs) continue;
      __m512i w[kNtVecs][2];
      for (int v = 0; v < kNtVecs; ++v) {
        w[v][0] = w[v][1] = _mm512_setzero_si512();
        if (!last || line < last_lines) {
          const uint8_t* src = base[v] + g * kBlock * 16 + 64 * line;
          _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<intptr_t>(src) + ahead), _MM_HINT_T2);
          cvt(_mm512_loadu_si512(src), w[v][0], w[v][1]);
        }
      }
      for (int i = 0; i < MR; ++i) {  // each row's two pairs broadcast as it goes (few registers at 8 rows)
        int32_t pair[2];
        std::memcpy(pair, xb + i * ldx + g * kBlock + 4 * j, 8);
        if constexpr (kTiles) {
          for (int h = 0; h < 2; ++h) {
            const __m512 xe = _mm512_set1_ps(pair_even(pair[h])), xo = _mm512_set1_ps(pair_odd(pair[h]));
            for (int v = 0; v < kNtVecs; ++v) {
              even[g][i][v] = _mm512_fmadd_ps(pairs_even(w[v][h]), xe, even[g][i][v]);
              odd[g][i][v] = _mm512_fmadd_ps(pairs_odd(w[v][h]), xo, odd[g][i][v]);
            }
          }
        } else {
          const __m512bh x0 = as_bh(_mm512_set1_epi32(pair[0])), x1 = as_bh(_mm512_set1_epi32(pair[1]));
          for (int v = 0; v < kNtVecs; ++v)
            acc[g][i][v] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g][i][v], as_bh(w[v][0]), x0), as_bh(w[v][1]), x1);
        }
      }
      if constexpr (kTiles) {
        if ((j & 7) == 7)  // the end of a 32-k step (16 slots)
          for (int i = 0; i < MR; ++i)
            for (int v = 0; v < kNtVecs; ++v) {
              acc[g][i][v] = _mm512_add_ps(acc[g][i][v], _mm512_add_ps(even[g][i][v], odd[g][i][v]));
              even[g][i][v] = odd[g][i][v] = _mm512_setzero_ps();
            }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < MR; ++i) {
      const __m512 sxv = _mm512_set1_ps(sx[i * sx_ld + g]);
      for (int v = 0; v < kNtVecs; ++v) {
        float* t = tot + (i * kNtVecs + v) * 16;
        const __m512 prev = first && g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(t);
        _mm512_store_ps(t, _mm512_fmadd_ps(acc[g][i][v], _mm512_mul_ps(sxv, sw[g][v]), prev));
      }
    }
}

using Nt16BlocksFn = void (*)(const Problem&, const E4m3ToBf16&, int64_t, int64_t, const uint16_t*, int64_t,
                              const float*, int64_t, const __m512 (*)[kNtVecs], float*, bool, intptr_t);
constexpr int kNt16MaxG = kNtGroup + 1;  // a K of 4 whole blocks and a partial one (576) goes in one call
constexpr Nt16BlocksFn kNt16Blocks[kNt16MaxG + 1][kNtGroupMaxM + 1] = {
    {nullptr, nullptr, nullptr},
    {nullptr, nt16_blocks<1, 1>, nt16_blocks<1, 2>},
    {nullptr, nt16_blocks<2, 1>, nt16_blocks<2, 2>},
    {nullptr, nt16_blocks<3, 1>, nt16_blocks<3, 2>},
    {nullptr, nt16_blocks<4, 1>, nt16_blocks<4, 2>},
    {nullptr, nt16_blocks<5, 1>, nt16_blocks<5, 2>}};
// Above two rows one block a call (the rows' chains are enough to overlap), up to a register tile of rows.
constexpr Nt16BlocksFn kNt16Block[kNtMaxRows + 1] = {
    nullptr, nt16_blocks<1, 1>, nt16_blocks<1, 2>, nt16_blocks<1, 3>, nt16_blocks<1, 4>,
    nt16_blocks<1, 5>, nt16_blocks<1, 6>, nt16_blocks<1, 7>, nt16_blocks<1, 8>};

// In the tiles' order two chains per output instead of one: two blocks at once at a row or two fill the registers.
constexpr int kTilesGroup = 2;
constexpr Nt16BlocksFn kNt16TileBlocks[kTilesGroup + 1][kNtGroupMaxM + 1] = {
    {nullptr, nullptr, nullptr},
    {nullptr, nt16_blocks<1, 1, true>, nt16_blocks<1, 2, true>},
    {nullptr, nt16_blocks<2, 1, true>, nt16_blocks<2, 2, true>}};
// The most rows linear_amx hands to nt16 in the tiles' order: the default model's 30 FP8 layers from DRAM on a
// 2-vCPU Xeon with AMX (benchmarks/linear_stream.py --kernels fp8-bi; the tiles then took their weights as A tiles),
// at 1 row 6.3 ms against the tiles' 10.9 and the gemv's 5.8; at 6 10.9 against 11.7; at 7 12.6 against 11.6.
constexpr int64_t kTilesNtMaxM = 6;
constexpr Nt16BlocksFn kNt16TileBlock[kTilesNtMaxM + 1] = {
    nullptr, nt16_blocks<1, 1, true>, nt16_blocks<1, 2, true>, nt16_blocks<1, 3, true>, nt16_blocks<1, 4, true>,
    nt16_blocks<1, 5, true>, nt16_blocks<1, 6, true>};

// A task of two nt16 groups at up to kNtMaxRows rows (kTilesNtMaxM in the tiles' order): every K block through
// nt16_blocks, at a row or two kNtGroup at a time (the last call takes one more rather than leave one block alone
// on its two chains; kTilesGroup in the tiles' order), above one at a time. Its lines prefetch the next task's
// into L2, or where `next` is given (a thread's last task: next_weight.h) the bytes as far into `next`.
template <bool kTiles = false, typename OutT>
void nt16_task(const Problem& p, const E4m3ToBf16& cvt, const RowsBf16& x, int64_t n0, float* tot, OutT* y,
               const char* next = nullptr) {
  const intptr_t ahead = next == nullptr
                             ? kNtRows * p.k
                             : reinterpret_cast<intptr_t>(next) - reinterpret_cast<intptr_t>(p.w + n0 * p.k);
  for (int64_t b = 0; b < p.nkb;) {
    const int64_t left = p.nkb - b;
    const int g = p.m > kNtGroupMaxM              ? 1
                  : kTiles                        ? static_cast<int>(std::min<int64_t>(kTilesGroup, left))
                  : left == kNt16MaxG             ? kNt16MaxG
                                                  : static_cast<int>(std::min<int64_t>(kNtGroup, left));
    __m512 sw[kNt16MaxG][kNtVecs];
    for (int i = 0; i < g; ++i) nt_scales(p, n0, b + i, sw[i]);
    const Nt16BlocksFn blocks = kTiles ? (p.m > kNtGroupMaxM ? kNt16TileBlock[p.m] : kNt16TileBlocks[g][p.m])
                                       : (p.m > kNtGroupMaxM ? kNt16Block[p.m] : kNt16Blocks[g][p.m]);
    blocks(p, cvt, n0, b, x.x.get() + b * kBlock, x.kp, x.scale.get() + b, p.nkb, sw, tot, b == 0, ahead);
    b += g;
  }
  nt_write(p.m, p.n, n0, p.bias, tot, y);
}

// wt holds kNtGroup blocks' room (nt_blocks takes whole K blocks kNtGroup at a time at one or two rows).
template <typename OutT>
void nt_task(const Problem& p, const E4m3ToBf16& cvt, const RowsBf16& x, int64_t n0, float* wt, float* tot, OutT* y,
             const char* next = nullptr) {
  if (p.m <= kNtMaxRows && p.grouped(n0) && p.grouped(n0 + 16)) return nt16_task(p, cvt, x, n0, tot, y, next);
  const int64_t per_pass = nt_rows_per_pass(p.m);
  int64_t b = 0;
  if (p.m <= kNtGroupMaxM)
    for (; (b + kNtGroup) * kBlock <= p.k; b += kNtGroup) {
      __m512 sw[kNtGroup][kNtVecs];
      for (int g = 0; g < kNtGroup; ++g) {
        nt_convert_block(p, cvt, n0, b + g, wt + g * kNtWtFloats);
        nt_scales(p, n0, b + g, sw[g]);
      }
      kNtBlocks<kBlock, kNtGroup, true>[p.m](
          wt, kNtWtFloats, x.x.get() + b * kBlock, x.kp, x.scale.get() + b, p.nkb, sw, tot, b == 0);
    }
  for (; b < p.nkb; ++b) {
    nt_convert_block(p, cvt, n0, b, wt);
    __m512 sw[kNtVecs];
    nt_scales(p, n0, b, sw);
    const int64_t pairs = cdiv(std::min(kBlock, p.k - b * kBlock), 64) * 32;  // whole 64-k chunks, as the GEMM
    for (int64_t m0 = 0; m0 < p.m; m0 += per_pass)
      kNtBlock<true>[std::min(per_pass, p.m - m0)](wt, x.x.get() + m0 * x.kp + b * kBlock, x.kp, pairs,
                                                   x.scale.get() + m0 * p.nkb + b, p.nkb, sw, tot + m0 * kNtRows,
                                                   b == 0);
  }
  nt_write(p.m, p.n, n0, p.bias, tot, y);
}

// linear_amx's bits at up to kTilesNtMaxM rows, from nt16 weights whose every task is two groups (N a multiple of
// kNtRows), without the tiles: the chains in the tiles' order (nt16_blocks). At one row the tiles, which compute 16
// activation rows whatever M is, took twice the gemv's time over the default model's 30 FP8 layers; this takes
// 1.02-1.08x the gemv's there (docs/exact-rollouts.md). linear_nt<true> runs it.
bool tiles_nt_takes(const Problem& p) { return p.m <= kTilesNtMaxM && p.nt16 && p.n % kNtRows == 0; }

// kTiles: every task through nt16_task in the tiles' order (tiles_nt_takes holds), which needs no wt.
template <bool kTiles = false, typename T>
void linear_nt(const Problem& p, const T* xin, bool ue8m0, T* y) {
  const RowsBf16 x = quantize_rows(xin, p.m, p.k, p.nkb, ue8m0);
  const NextWeight next = take_next_weight();
  at::parallel_for(0, cdiv(p.n, kNtRows), 1, [&](int64_t begin, int64_t end) {
    const E4m3ToBf16 cvt;
    auto wt = kTiles ? nullptr : alloc_buffer<float>(kNtGroup * kNtWtFloats);
    auto tot = alloc_buffer<float>(p.m * kNtRows);
    for (int64_t t = begin; t < end; ++t) {
      const char* pf = t + 1 == end ? next.share(kNtRows) : nullptr;
      if constexpr (kTiles) {
        nt16_task<true>(p, cvt, x, t * kNtRows, tot.get(), y, pf);
      } else {
        nt_task(p, cvt, x, t * kNtRows, wt.get(), tot.get(), y, pf);
      }
    }
  });
}

#ifdef FP8E_AMX

// ---- AMX: tiles from M = 7 on (nt16 in the tiles' order below) --------------------------------------
//
// A task converts its 32 weight rows' K blocks once into nt's pair vectors (nt_convert_block: a bf16 pair of 16
// weight rows in 64 bytes, the task's two vectors side by side, from rows or nt16 groups alike), which are B tiles
// as they lie, rows 128 bytes apart; the quantized activation rows (lane order, as the weight's slots) are the A
// tiles. TDPBF16PS multiplies the E4M3 values exactly and sums in float32 (in the order linear_common.h gives), so a
// K block's C tile holds the block's partial sums, scaled into a float32 accumulator as in the AVX-512 kernel; C rows
// are activation rows, written as they are. An output's arithmetic depends only on its weight row and activation
// row, so padding and grouping never change a row's result. It replaced weights as A tiles (converted rows) and
// activations packed as B tiles, with the same bits: the default model's 30 FP8 layers at M = 16 14.8 -> 12.0 ms,
// 64 25.6 -> 20.4, 512 136 -> 121 (2 vCPUs of a Xeon with AMX, best of 6 alternating rounds).

template <typename OutT>
void amx_task(const Problem& p, const RowsBf16& x, const E4m3ToBf16& cvt, const GemmTask& t, float* wt,
                   float* acc, OutT* y) {
  for (int64_t b = 0; b < p.nkb; ++b) nt_convert_block(p, cvt, t.n0, b, wt + b * kNtWtFloats);
  alignas(64) float c[4][256];
  for (int64_t mv = t.mv0; mv < t.mv1; mv += 2) {
    const int nb = mv + 1 < t.mv1 ? 2 : 1;
    const uint16_t* a = x.x.get() + mv * 16 * x.kp;
    for (int64_t b = 0; b < p.nkb; ++b) {
      const int64_t steps = cdiv(std::min(kBlock, p.k - b * kBlock), 64) * 2;
      amx_zero_group();
      for (int64_t s = 0; s < steps; ++s) {
        const float* w = wt + b * kNtWtFloats + s * 16 * kNtVecs * 16;
        amx_group_step(a + b * kBlock + 32 * s, x.kp * 2, w, w + 16, kNtVecs * 64, nb == 2);
      }
      amx_store_group(c, nb == 2);
      __m512 sw[kNtVecs];
      nt_scales(p, t.n0, b, sw);
      for (int j = 0; j < nb; ++j)
        for (int r = 0; r < 16; ++r) {
          const __m512 sx = _mm512_set1_ps(x.scale[((mv + j) * 16 + r) * p.nkb + b]);
          for (int v = 0; v < kNtVecs; ++v) {
            float* out = acc + ((16 * j + r) * kNtVecs + v) * 16;
            const __m512 prev = b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out);
            _mm512_store_ps(out, _mm512_fmadd_ps(_mm512_load_ps(c[2 * j + v] + 16 * r), _mm512_mul_ps(sx, sw[v]), prev));
          }
        }
    }
    const int64_t m0 = mv * 16;
    nt_write(std::min<int64_t>(16 * nb, p.m - m0), p.n, t.n0, p.bias, acc, y + m0 * p.n);
  }
}

template <typename T>
void linear_amx(const Problem& p, const T* xin, bool ue8m0, T* y) {
  const int64_t mpad = cdiv(p.m, 16) * 16, mvecs = mpad / 16, n_tiles = cdiv(p.n, kNtRows);
  const RowsBf16 x = quantize_rows(xin, p.m, p.k, p.nkb, ue8m0, mpad);
  const int64_t chunks = l2_chunks(n_tiles, mvecs, at::get_num_threads(), 32 * x.kp, 4);
  at::parallel_for(0, n_tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles;
    const E4m3ToBf16 cvt;
    auto wt = alloc_buffer<float>(p.nkb * kNtWtFloats);
    auto acc = alloc_buffer<float>(32 * kNtRows);
    for (int64_t i = begin; i < end; ++i)
      amx_task(p, x, cvt, chunk_major_task(i, n_tiles, kNtRows, mvecs, chunks), wt.get(), acc.get(), y);
  });
}

#endif  // FP8E_AMX

// Which AVX-512 kernel M picks, measured with every layer's weights from DRAM as in a forward (benchmarks/
// linear_stream.py: the default model's 30 layers, 2 threads of a 2-core Zen 5, ms per forward; docs/
// cpu-peers.txt): the gemv up to 6 rows (at 1 row 3.8 against nt's 6.4, at 6 7.4 vs 7.9), nt to 64 (at 8 8.4 vs
// the gemv's 11.9 and the GEMM's 16.2, at 64 32.5 vs the GEMM's 38.1), the GEMM above (level at 128: 52.0 vs
// 56.5 there, the other way round in a whole decode step of 128 sequences). On AMX machines the gemv beats the
// tiles at 1 and 2 rows (default model shapes, 1 or 2 cores of an Emerald Rapids Xeon: at M = 2 it takes 0.9x
// the tiles' time, at M = 3 1.04x-1.2x). Since nt converts E4M3 straight into its transposed pairs the gemv keeps
// only 4 rows (2 threads of a 2-core Zen 4, best of 9 rounds: at 4 6.35 vs nt's 6.60, at 5 7.76 vs 7.19, at 6 8.98
// vs 7.49; at 1 3.70 vs 6.05).
constexpr int64_t kGemvMaxM = 4;
constexpr int64_t kNtMaxM = 64;
constexpr int64_t kSmallMAmx = 2;

// The gemv sums a row's products in another order (along K in 16 lanes, then across them) than the nt kernel
// and the AVX-512 GEMM (one lane per output, pair after pair: the same bits, see linear_common.h) and the AMX
// tiles, so a row's result depends on which one M picks. batch_invariant never takes the gemv: nt then the
// AVX-512 GEMM by M, or AMX tiles for every M (which depends on the CPU, not on M).
template <typename T>
void linear_impl(const Problem& p, const T* x, bool ue8m0, T* y, bool batch_invariant, GemmChoice g) {
  if (g.kernel == Avx512Kernel::kByM && g.amx) {
#ifdef FP8E_AMX
    if (tiles_nt_takes(p)) return linear_nt<true>(p, x, ue8m0, y);
    if (batch_invariant || p.nt16 || p.m > kSmallMAmx) return linear_amx(p, x, ue8m0, y);
#endif
    return linear_small_m(p, x, ue8m0, y);
  }
  // nt16 weights never take the gemv (it reads rows): nt, which reads the groups as fast (docs/exact-rollouts.md)
  const Avx512Kernel kernel = g.avx512_kernel(p.m, batch_invariant || p.nt16, kGemvMaxM, kNtMaxM);
  if (kernel == Avx512Kernel::kGemv) {
    TORCH_CHECK(!p.nt16, "fp8_block_linear: the gemv reads weight rows, not nt16 groups");
    return linear_small_m(p, x, ue8m0, y);
  }
  if (kernel == Avx512Kernel::kNt) return linear_nt(p, x, ue8m0, y);
  linear_large_m(p, x, ue8m0, y);
}

#elif defined(FP8E_AVX2_KERNELS)

// AVX2 + FMA (linear_common.h): the activations quantized to E4M3 and held as float32 values times 2^112 (the
// weights convert to their values times 2^-120), each 128-wide K block's sum scaled by sx * 2^8 * sw. One kernel for
// every M.

float e4m3_to_f32(uint8_t v) { return e4m3_value(v); }

inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const at::BFloat16* p) { return Bf16Weights::load8(reinterpret_cast<const uint16_t*>(p)); }

// The largest |v| of n values: |v| bit patterns order like the values and a NaN's exceed them all, so an
// integer max is an amax that propagates NaN (as amax_rows does, to a NaN).
template <typename T>
float amax_avx2(const T* p, int64_t n) {
  __m256i mx = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(load8_f32(p + c)), _mm256_set1_epi32(0x7FFFFFFF)));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), mx);
  uint32_t m = *std::max_element(lanes, lanes + 8);
  for (; c < n; ++c) m = std::max(m, f32_bits(static_cast<float>(p[c])) & 0x7FFFFFFFu);
  return f32_from_bits(m);
}

// dst[c] = e4m3_round(src[c] / scale) times 2^112, 8 at a time: the division as the scalar path's, the magnitude
// rounded by e4m3_round_ps (the same values as e4m3_value(e4m3_from_f32(...)); a NaN stays NaN), the sign put back.
template <typename T>
void quantize_values_avx2(const T* src, float* dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale), top = _mm256_set1_ps(kFp8Max), sign_bit = _mm256_set1_ps(-0.f);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 v = load8_f32(src + c);
    const __m256 q = _mm256_min_ps(top, _mm256_div_ps(_mm256_andnot_ps(sign_bit, v), s));  // a NaN q stays
    const __m256 r = e4m3_round_ps(q);
    _mm256_storeu_ps(dst + c, _mm256_or_ps(_mm256_mul_ps(r, _mm256_set1_ps(kE4m3ActivationFactor)),
                                           _mm256_and_ps(sign_bit, v)));
  }
  for (; c < n; ++c) dst[c] = e4m3_round(static_cast<float>(src[c]) / scale) * kE4m3ActivationFactor;
}

template <typename T>
void linear_impl(const Problem& p, const T* x, bool ue8m0, T* y, bool /*batch_invariant*/, GemmChoice /*gemm*/) {
  const int64_t kp = p.nkb * kBlock;
  TORCH_CHECK(!p.nt16, "fp8_block_linear: nt16 weights need the AVX-512 BF16 kernels");
  auto xf = alloc_buffer<float>(p.m * kp);  // the activations' E4M3 values x 2^112, zero past K
  auto sx = alloc_buffer<float>(p.m * p.nkb);
  at::parallel_for(0, p.m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < p.nkb; ++b) {
        const int64_t c0 = b * kBlock, cols = std::min(kBlock, p.k - c0);
        const float s = block_scale(amax_avx2(x + r * p.k + c0, cols), ue8m0);
        sx[r * p.nkb + b] = s * kE4m3ScaleFactor;
        float* dst = xf.get() + r * kp + c0;
        quantize_values_avx2(x + r * p.k + c0, dst, cols, s);
        std::fill(dst + cols, dst + kBlock, 0.f);
      }
  });
  const Avx2Operands op{p.m, p.n, p.k, xf.get(), kp, sx.get(), p.nkb, p.bias};
  avx2_linear<E4m3Weights>(op, p.w, p.k, y, [&](int64_t row, int64_t b) { return p.sw_at(row, b); });
}

#else  // portable scalar path

float e4m3_to_f32(uint8_t v) { return e4m3_value(v); }

// One row at a time in a fixed order: batch invariant as it stands.
template <typename T>
void linear_impl(const Problem& p, const T* x, bool ue8m0, T* y, bool /*batch_invariant*/, GemmChoice /*gemm*/) {
  const int64_t kp = p.nkb * kBlock;
  TORCH_CHECK(!p.nt16, "fp8_block_linear: nt16 weights need the AVX-512 BF16 kernels");
  auto xq = alloc_buffer<uint8_t>(p.m * kp);
  auto sx = alloc_buffer<float>(p.m * p.nkb);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t b = 0; b < p.nkb; ++b) {
      const int64_t c0 = b * kBlock, cols = std::min(kBlock, p.k - c0);
      sx[r * p.nkb + b] = block_scale(amax_rows(x + r * p.k + c0, p.k, 1, cols), ue8m0);
      quantize_span(x + r * p.k + c0, xq.get() + r * kp + c0, cols, sx[r * p.nkb + b]);
    }
  at::parallel_for(0, p.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < p.m; ++m) {
        float total = 0.f;
        for (int64_t b = 0; b < p.nkb; ++b) {
          float acc = 0.f;
          for (int64_t k = b * kBlock; k < std::min(p.k, (b + 1) * kBlock); ++k)
            acc += e4m3_to_f32(xq[m * kp + k]) * e4m3_to_f32(p.w[n * p.k + k]);
          total += acc * (sx[m * p.nkb + b] * p.sw_at(n, b));
        }
        y[m * p.n + n] = from_f32<T>(total + p.bias_at(n));
      }
  });
}

#endif  // FP8E_BF16_KERNELS

// scale_rows (optional, int32 [N]) lets one call serve a layer that fuses several projections whose
// own 128-row scale grids are stacked (shards not multiples of 128 rows): output row n reads scale row
// scale_rows[n] instead of n / 128.
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale_inv,
                            const std::optional<at::Tensor>& bias, bool ue8m0,
                            const std::optional<at::Tensor>& scale_rows, bool batch_invariant,
                            const std::string& gemm, bool nt16) {
  const GemmChoice choice = choose_gemm(gemm, "fp8_block_linear");
  TORCH_CHECK(x.device().is_cpu() && w_q.device().is_cpu() && w_scale_inv.device().is_cpu(),
              "fp8_block_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fp8_block_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "fp8_block_linear: x must be bfloat16 or float32");
  TORCH_CHECK(w_q.dim() == 2 && w_q.is_contiguous() && w_q.scalar_type() == at::kFloat8_e4m3fn,
              "fp8_block_linear: w_q must be a contiguous float8_e4m3fn [N, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = w_q.size(0);
  TORCH_CHECK(w_q.size(1) == k && k > 0, "fp8_block_linear: K mismatch between x and w_q");
  const int64_t nkb = cdiv(k, kBlock);
  const bool mapped = scale_rows.has_value() && scale_rows->defined();
  TORCH_CHECK(w_scale_inv.scalar_type() == at::kFloat && w_scale_inv.is_contiguous() && w_scale_inv.dim() == 2 &&
                  (mapped || w_scale_inv.size(0) == cdiv(n, kBlock)) && w_scale_inv.size(1) == nkb,
              "fp8_block_linear: w_scale_inv must be contiguous float32 [ceil(N/128), ceil(K/128)]");
  if (mapped) {
    TORCH_CHECK(scale_rows->scalar_type() == at::kInt && scale_rows->is_contiguous() && scale_rows->dim() == 1 &&
                    scale_rows->size(0) == n,
                "fp8_block_linear: scale_rows must be a contiguous int32 [N] tensor");
    const int32_t* rows = scale_rows->data_ptr<int32_t>();  // a plain loop: tensor reductions cost more per call
    TORCH_CHECK(std::all_of(rows, rows + n, [&](int32_t r) { return r >= 0 && r < w_scale_inv.size(0); }),
                "fp8_block_linear: scale_rows must index rows of w_scale_inv");
  }
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "fp8_block_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{m, n, k, nkb, static_cast<const uint8_t*>(w_q.data_ptr()), w_scale_inv.data_ptr<float>(),
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                  mapped ? scale_rows->data_ptr<int32_t>() : nullptr, nt16 && k % 4 == 0};
  if (x.scalar_type() == at::kFloat) {
    linear_impl(p, x.data_ptr<float>(), ue8m0, y.data_ptr<float>(), batch_invariant, choice);
  } else {
    linear_impl(p, x.data_ptr<at::BFloat16>(), ue8m0, y.data_ptr<at::BFloat16>(), batch_invariant, choice);
  }
  return y;
}

// The instruction set of the GEMMs below AMX: "avx512bf16" (vdpbf16ps), or "scalar" on CPUs without it.
std::string fp8_linear_isa() {
#ifdef FP8E_BF16_KERNELS
  return "avx512bf16";
#elif defined(FP8E_AVX2_KERNELS)
  return "avx2";
#else
  return "scalar";
#endif
}

bool amx_usable_op() { return amx_allowed(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def(
      "fp8_block_linear(Tensor x, Tensor w_q, Tensor w_scale_inv, Tensor? bias, bool ue8m0, Tensor? scale_rows=None, "
      "bool batch_invariant=False, str gemm='auto', bool nt16=False) -> Tensor");
  m.def(
      "fp8_quantize_weight_(Tensor w, Tensor(a!) out_q, Tensor(b!) out_scale, bool ue8m0, bool scales_given=False) "
      "-> ()");
  m.def("fp8_block_scales_(Tensor w, Tensor(a!) out_scale, bool ue8m0) -> bool");
  m.def("fp8_linear_isa() -> str", TORCH_FN(fp8_linear_isa));
  m.def("amx_usable() -> bool", TORCH_FN(amx_usable_op));
  m.impl("fp8_block_linear", c10::DispatchKey::CPU, TORCH_FN(fp8_block_linear));
  m.impl("fp8_quantize_weight_", c10::DispatchKey::CPU, TORCH_FN(fp8_quantize_weight_));
  m.impl("fp8_block_scales_", c10::DispatchKey::CPU, TORCH_FN(fp8_block_scales_));
}
