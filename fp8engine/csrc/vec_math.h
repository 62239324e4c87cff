// Vector math shared by the kernels: Tag and dispatch_io for every build, then AVX-512 and AVX2 helpers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fp8engine_vec {

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<float>{}) or f(Tag<at::BFloat16>{}) for a float32 or bfloat16 tensor dtype.
template <typename F>
void dispatch_io(at::ScalarType t, F&& f) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "expected float32 or bfloat16, got ", t);
  if (t == at::kFloat) {
    f(Tag<float>{});
  } else {
    f(Tag<at::BFloat16>{});
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

// Lanes [0, n) of a 16-lane vector (all of them for n >= 16).
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// 16 values as fp32 (masked lanes read as 0).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// fp32 -> bf16 (16-bit lanes), bit-identical to torch's vectorised x.to(torch.bfloat16): round to
// nearest even, denormals kept, NaN -> 0xFFFF. (vcvtneps2bf16 would flush denormals.)
inline __m256i fp32_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}

inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store16(at::BFloat16* p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, fp32_to_bf16(x)); }

// Cephes expf: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2]; about 1 ulp. exp(-inf) = 0.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // exp underflows to 0 below this; NaN passes through
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

#endif  // AVX-512

#if defined(__AVX2__) && defined(__FMA__)

// exp512 on 8 lanes (the same polynomial), its 2^n built in the exponent bits: x is clamped to
// [-87, 88], where 2^n stays a normal float (exp512 gives 0 and inf further out; silu's a / (1 + e) rounds
// the same to bf16 for |a| >= 87 either way, float32 may differ in the last bits there).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(_mm256_set1_ps(-87.f), x), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif  // AVX2

}  // namespace fp8engine_vec
