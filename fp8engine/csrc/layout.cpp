// The nt16 layout's permutation (fp8engine/weights/layout.py), in place: whole groups of 16 rows of a [N, K]
// weight from rows into the layout or back. Each thread moves a group through a buffer of the group's own size,
// so a write into a weight in the layout allocates nothing the size of the weight (the torch version, layout.py's
// fallback, clones every span it moves). No ISA dependence: the moves are plain 16- and 32-bit copies.
//   E4M3 (1-byte elements, K % 4 == 0): byte 16 L + 8 h + 2 i + b of line c is row 4 L + i, column 4 c + 2 h + b,
//   so the bytes move in pairs b: 16-bit element 8 L + 4 h + i of line c <- row 4 L + i, pair 2 c + h.
//   bf16 (2-byte elements, K even): 32-bit element r of line q <- row r, pair q.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;

// One group of E4M3 codes (16 rows of `pairs` 16-bit pairs): rows -> lines, or back.
void permute_e4m3_group(uint16_t* g, uint16_t* buf, int64_t pairs, bool to_nt16) {
  const int64_t n = kGroup * pairs;
  std::memcpy(buf, g, sizeof(uint16_t) * n);
  for (int64_t c = 0; c < pairs / 2; ++c)
    for (int64_t l = 0; l < 4; ++l)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t line = c * 32 + 8 * l + 4 * h + i, row = (4 * l + i) * pairs + 2 * c + h;
          if (to_nt16)
            g[line] = buf[row];
          else
            g[row] = buf[line];
        }
}

// One group of bf16 values (16 rows of `pairs` 32-bit pairs): rows -> lines, or back.
void permute_bf16_group(uint32_t* g, uint32_t* buf, int64_t pairs, bool to_nt16) {
  std::memcpy(buf, g, sizeof(uint32_t) * kGroup * pairs);
  for (int64_t q = 0; q < pairs; ++q)
    for (int64_t r = 0; r < kGroup; ++r) {
      if (to_nt16)
        g[q * kGroup + r] = buf[r * pairs + q];
      else
        g[r * pairs + q] = buf[q * kGroup + r];
    }
}

void nt16_permute_(at::Tensor& matrix, int64_t g0, int64_t g1, bool to_nt16) {
  TORCH_CHECK(matrix.dim() == 2 && matrix.is_contiguous() && matrix.device().is_cpu(),
              "nt16_permute_: a contiguous 2-D CPU matrix expected, got ", matrix.sizes());
  const int64_t esize = matrix.element_size(), k = matrix.size(1);
  TORCH_CHECK(esize == 1 || esize == 2, "nt16_permute_: 1- or 2-byte elements expected, got ", matrix.scalar_type());
  TORCH_CHECK(k % (esize == 1 ? 4 : 2) == 0, "nt16_permute_: K = ", k, " is not a multiple of ", esize == 1 ? 4 : 2);
  TORCH_CHECK(0 <= g0 && g0 <= g1 && g1 * kGroup <= matrix.size(0), "nt16_permute_: groups ", g0, "..", g1,
              " outside a matrix of ", matrix.size(0), " rows");
  const int64_t group_bytes = kGroup * k * esize;
  uint8_t* base = static_cast<uint8_t*>(matrix.data_ptr()) + g0 * group_bytes;
  at::parallel_for(0, g1 - g0, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> buf((group_bytes + 3) / 4);
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* p = base + g * group_bytes;
      if (esize == 1)
        permute_e4m3_group(reinterpret_cast<uint16_t*>(p), reinterpret_cast<uint16_t*>(buf.data()), k / 2, to_nt16);
      else
        permute_bf16_group(reinterpret_cast<uint32_t*>(p), buf.data(), k / 2, to_nt16);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("nt16_permute_(Tensor(a!) matrix, int g0, int g1, bool to_nt16) -> ()");
}

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) { m.impl("nt16_permute_", &nt16_permute_); }
