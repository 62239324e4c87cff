// Establishes VDPBF16PS arithmetic on an AVX512-BF16 CPU: each lane's result is (C + odd product) + even product,
// each addition rounded (products of bf16 values are exact in float32), denormals flushed; 3.2 million lanes of
// adversarial inputs (exponent spreads of 4, 30 and 60 binades, C zero or not) against the other orders. So one
// vdpbf16ps adds two terms of a sequential float32 chain, the pair's odd element first: the AMX tiles' even chain
// (benchmarks/amx_order.cpp) over inputs whose odd elements are zero could be reproduced two products an
// instruction (issue 60's batch-invariant small-M kernels). Build and run:
// g++ -O2 -march=native -ffp-contract=off benchmarks/dpbf16_order.cpp -o /tmp/dpbf16_order && /tmp/dpbf16_order
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

static float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float flushed(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.f, f) : f; }

int main() {
  std::mt19937 gen(1);
  const char* names[4] = {"(C+odd)+even", "(C+even)+odd", "C+(even+odd)", "exact C+even+odd"};
  long mismatches[4] = {0}, lanes = 0;
  for (int trial = 0; trial < 200000; ++trial) {
    const int spread = trial % 3 == 0 ? 4 : trial % 3 == 1 ? 30 : 60;
    auto draw = [&]() {
      int e = 127 + int(gen() % (2 * spread + 1)) - spread;
      e = e < 1 ? 1 : e > 254 ? 254 : e;
      return uint16_t(((gen() & 1) << 15) | (e << 7) | (gen() & 0x7f));
    };
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float c[16], r[16];
    for (int i = 0; i < 32; ++i) a[i] = draw(), b[i] = draw();
    for (int i = 0; i < 16; ++i) c[i] = trial % 5 == 0 ? 0.f : bf16_value(draw());
    const __m512 acc = _mm512_dpbf16_ps(_mm512_load_ps(c), (__m512bh)_mm512_load_si512(a),
                                        (__m512bh)_mm512_load_si512(b));
    _mm512_store_ps(r, acc);
    for (int i = 0; i < 16; ++i) {
      const float even = bf16_value(a[2 * i]) * bf16_value(b[2 * i]);
      const float odd = bf16_value(a[2 * i + 1]) * bf16_value(b[2 * i + 1]);
      const float candidates[4] = {(c[i] + odd) + even, (c[i] + even) + odd, c[i] + (even + odd),
                                   float(double(c[i]) + double(even) + double(odd))};
      for (int q = 0; q < 4; ++q) mismatches[q] += bits(flushed(candidates[q])) != bits(r[i]);
      ++lanes;
    }
  }
  std::printf("lanes %ld\n", lanes);
  for (int q = 0; q < 4; ++q) std::printf("%-18s mismatches %ld\n", names[q], mismatches[q]);
}
