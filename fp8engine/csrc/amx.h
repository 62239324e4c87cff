// AMX tiles (Sapphire Rapids and later): whether this process may use them, and one tile layout.
//
// A build has the tile instructions where -march=native gives __AMX_TILE__ and __AMX_BF16__; a run uses
// them only where CPUID reports them and the OS lets this process keep tile data in its thread state
// (Linux asks once per process, ARCH_REQ_XCOMP_PERM; oneDNN may have asked already, which is fine).

#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FP8E_AMX 1

#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdint>

namespace fp8e {

inline bool amx_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
#if defined(__linux__)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return true;
#endif
  }();
  return usable;
}

// Palette 1 with all eight tiles at 16 rows x 64 bytes: C tiles of 16 x 16 float32, A tiles of 16 rows
// x 32 bf16 and B tiles of 16 rows of 16 bf16 pairs.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Tile state is per thread and other code (oneDNN) configures its own: configure at the start of each
// parallel task range, release at its end.
struct TileScope {
  TileScope() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// The GEMMs' 2 x 2 group with activations as A and weights as B (fp8_linear.cpp, bf16_linear.cpp): tiles 0-3 C, C
// tile 2 j + v for activation vector j and weight vector v; 4-5 A, 6-7 B. `two`: a second activation vector.
inline void amx_zero_group() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// One 32-k step: A rows a (lda bytes apart, the second vector 16 rows on), B tiles b0 and b1 (ldb bytes apart).
inline void amx_group_step(const void* a, int64_t lda, const void* b0, const void* b1, int64_t ldb, bool two) {
  _tile_loadd(6, b0, ldb);
  _tile_loadd(7, b1, ldb);
  _tile_loadd(4, a, lda);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    _tile_loadd(5, static_cast<const char*>(a) + 16 * lda, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

inline void amx_store_group(float (*c)[256], bool two) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (two) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

}  // namespace fp8e

#endif  // __AMX_TILE__ && __AMX_BF16__

namespace fp8e {

inline bool amx_allowed() {
#ifdef FP8E_AMX
  return amx_usable();
#else
  return false;
#endif
}

// Which kernel a linear runs, by the caller's choice `gemm`: "auto" (AMX tiles where the build, the CPU and the OS
// allow them), "avx512" or "amx", the kernel then picked by M; or one AVX-512 kernel forced whatever M is, for the
// benchmarks and tests that compare them at one M: "avx512-gemv" (K in the lanes), "avx512-nt" (weight rows in the
// lanes) or "avx512-gemm" (activation rows in the lanes). The engine makes the choice once, when it starts
// (fp8engine/model_executor/kernel_set.py); `op` names the kernel in errors.
enum class Avx512Kernel { kByM, kGemv, kNt, kGemm };

struct GemmChoice {
  bool amx;
  Avx512Kernel kernel;

  // The AVX-512 kernel for m rows: the forced one, else the gemv up to gemv_max rows (never batch invariant: it
  // sums in another order), nt up to nt_max, the GEMM above (nt and the GEMM give the same bits).
  Avx512Kernel avx512_kernel(int64_t m, bool batch_invariant, int64_t gemv_max, int64_t nt_max) const {
    if (kernel != Avx512Kernel::kByM) return kernel;
    return !batch_invariant && m <= gemv_max ? Avx512Kernel::kGemv
           : m <= nt_max                     ? Avx512Kernel::kNt
                                             : Avx512Kernel::kGemm;
  }
};

inline GemmChoice choose_gemm(const std::string& gemm, const char* op) {
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)) && defined(__AVX2__)
  if (gemm == "avx2") return {false, Avx512Kernel::kByM};  // the AVX2 kernels (linear_common.h): one for every M
#endif
  if (gemm == "avx512-gemv") return {false, Avx512Kernel::kGemv};
  if (gemm == "avx512-nt") return {false, Avx512Kernel::kNt};
  if (gemm == "avx512-gemm") return {false, Avx512Kernel::kGemm};
  TORCH_CHECK(gemm == "auto" || gemm == "avx512" || gemm == "amx", op,
              ": gemm must be 'auto', 'avx512', 'amx', 'avx512-gemv', 'avx512-nt' or 'avx512-gemm', got '", gemm, "'");
  TORCH_CHECK(gemm != "amx" || amx_allowed(), op,
              ": gemm='amx', but this build, CPU or OS does not allow AMX tiles (amx_bf16, amx_tile)");
  return {gemm == "auto" ? amx_allowed() : gemm == "amx", Avx512Kernel::kByM};
}

}  // namespace fp8e
