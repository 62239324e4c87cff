// E4M3 -> bf16, shared by the FP8 linear and attention kernels. Every E4M3 value is exactly a bf16
// (and the top half of an fp32), so one table serves scalar code, and two 128-entry byte lookups on
// the 7 magnitude bits (vpermi2b) convert 64 codes at a time.

#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fp8e {

constexpr float kFp8Max = 448.f;  // the largest finite E4M3 value

// bf16 bit pattern of an E4M3 value (exact); the E4M3 NaN 0x7F maps to a bf16 NaN.
constexpr uint16_t e4m3_bf16_bits(int v) {
  const int sign = (v & 0x80) << 8;
  int e = (v >> 3) & 15, m = v & 7;
  if ((v & 0x7F) == 0x7F) return static_cast<uint16_t>(sign | 0x7FC0);
  if (e != 0) return static_cast<uint16_t>(sign | (e + 120) << 7 | m << 4);
  if (m == 0) return static_cast<uint16_t>(sign);
  int exp = -6;  // subnormal m/8 * 2^-6: normalise the mantissa
  while (m < 8) {
    m <<= 1;
    --exp;
  }
  return static_cast<uint16_t>(sign | (exp + 127) << 7 | (m & 7) << 4);
}

struct Bf16Tables {
  std::array<uint16_t, 256> full{};
  alignas(64) std::array<uint8_t, 128> hi{};  // high byte of the magnitude's bf16, by 7-bit magnitude
  alignas(64) std::array<uint8_t, 128> lo{};
  constexpr Bf16Tables() {
    for (int v = 0; v < 256; ++v) full[v] = e4m3_bf16_bits(v);
    for (int v = 0; v < 128; ++v) {
      hi[v] = static_cast<uint8_t>(full[v] >> 8);
      lo[v] = static_cast<uint8_t>(full[v] & 0xFF);
    }
  }
};
inline constexpr Bf16Tables kE4m3Bf16{};

// An E4M3 code's value as float32 (exact; 0x7F / 0xFF are NaN).
inline float e4m3_value(uint8_t v) {
  const uint32_t bits = static_cast<uint32_t>(kE4m3Bf16.full[v]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// c10's float -> float8_e4m3fn conversion (round to nearest even; >= 480 and NaN -> 0x7F), in scalar code.
inline uint8_t e4m3_from_f32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t r;
  if (bits >= (1087u << 20)) {
    r = 0x7F;
  } else if (bits < (121u << 23)) {
    const uint32_t magic = 141u << 23;
    float a, m;
    std::memcpy(&a, &bits, 4);
    std::memcpy(&m, &magic, 4);
    const float sum = a + m;
    uint32_t sb;
    std::memcpy(&sb, &sum, 4);
    r = static_cast<uint8_t>(sb - magic);
  } else {
    bits += 0xC407FFFFu + ((bits >> 20) & 1u);
    r = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

// E4M3(clamp(v, -448, 448)) as float32, as the reference's quantize_fp8 (a NaN stays NaN).
inline float e4m3_round(float v) {
  return e4m3_value(e4m3_from_f32(std::isnan(v) ? v : std::min(kFp8Max, std::max(-kFp8Max, v))));
}

#if defined(__AVX512F__)
// c (|c| <= 448) rounded to the nearest E4M3 value, as a float (round to nearest even, subnormal step
// 2^-9): adding and subtracting m = +-2^(e + 20), with 2^e the binade of c but at least 2^-6, makes the
// FPU round to 3 mantissa bits. A NaN passes through; the sign of a zero may differ from a conversion's.
inline __m512 e4m3_round_ps(__m512 c) {
  const __m512i bits = _mm512_castps_si512(c);
  const __m512i binade = _mm512_max_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000)),
                                          _mm512_set1_epi32(121 << 23));
  const __m512i e = _mm512_add_epi32(binade, _mm512_set1_epi32(20 << 23));
  const __m512 m = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(e, bits, _mm512_set1_epi32(int(0x80000000u)), 0xF8));
  return _mm512_sub_ps(_mm512_add_ps(c, m), m);
}
#endif

#if defined(__AVX2__)
// e4m3_round_ps on 8 lanes, for c >= 0 (|c| <= 448; a NaN passes through): the AVX2 kernels round magnitudes and
// put the sign back themselves.
inline __m256 e4m3_round_ps(__m256 c) {
  const __m256i binade = _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(c), _mm256_set1_epi32(0x7F800000)),
                                          _mm256_set1_epi32(121 << 23));
  const __m256 m = _mm256_castsi256_ps(_mm256_add_epi32(binade, _mm256_set1_epi32(20 << 23)));
  return _mm256_sub_ps(_mm256_add_ps(c, m), m);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
// E4M3 -> bf16 for 64 bytes: the high byte (sign bit copied in) and low byte of each code's bf16,
// which the callers interleave (bf16 pairs) or spread (fp32 lanes) as they need.
struct E4m3ToBf16 {
  __m512i hi0, hi1, lo0, lo1;
  E4m3ToBf16()
      : hi0(_mm512_load_si512(kE4m3Bf16.hi.data())),
        hi1(_mm512_load_si512(kE4m3Bf16.hi.data() + 64)),
        lo0(_mm512_load_si512(kE4m3Bf16.lo.data())),
        lo1(_mm512_load_si512(kE4m3Bf16.lo.data() + 64)) {}
  void bytes(__m512i b, __m512i& hi, __m512i& lo) const {
    hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, _mm512_set1_epi8(char(0x80)),
                                   0xF8);  // hi | (b & 0x80)
    lo = _mm512_permutex2var_epi8(lo0, b, lo1);
  }
  // bf16 values in "lane order": out0 holds codes 16L + 0..7 and out1 codes 16L + 8..15 of 128-bit
  // lane L (what interleaving bytes within lanes produces).
  void operator()(__m512i b, __m512i& out0, __m512i& out1) const {
    __m512i hi, lo;
    bytes(b, hi, lo);
    out0 = _mm512_unpacklo_epi8(lo, hi);
    out1 = _mm512_unpackhi_epi8(lo, hi);
  }
};
#endif

}  // namespace fp8e
