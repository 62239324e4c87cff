// The nt16 layout's permutation as an op (fp8engine/weights/layout.py calls it): whole groups of 16 rows of a
// [N, K] weight from rows into the layout or back, in place (layout.h). Each thread moves a group through a buffer
// of the group's own size, so a write into a weight in the layout allocates nothing the size of the weight (the
// torch version, layout.py's fallback, clones every span it moves).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "layout.h"

namespace {

using fp8e_layout::kGroup;

void nt16_permute_(at::Tensor& matrix, int64_t g0, int64_t g1, bool to_nt16) {
  TORCH_CHECK(matrix.dim() == 2 && matrix.is_contiguous() && matrix.device().is_cpu(),
              "nt16_permute_: a contiguous 2-D CPU matrix expected, got ", matrix.sizes());
  const int64_t esize = matrix.element_size(), k = matrix.size(1);
  TORCH_CHECK(esize == 1 || esize == 2, "nt16_permute_: 1- or 2-byte elements expected, got ", matrix.scalar_type());
  TORCH_CHECK(k % (esize == 1 ? 4 : 2) == 0, "nt16_permute_: K = ", k, " is not a multiple of ", esize == 1 ? 4 : 2);
  TORCH_CHECK(0 <= g0 && g0 <= g1 && g1 * kGroup <= matrix.size(0), "nt16_permute_: groups ", g0, "..", g1,
              " outside a matrix of ", matrix.size(0), " rows");
  const int64_t group_bytes = kGroup * k * esize;
  fp8e_layout::permute_groups(static_cast<uint8_t*>(matrix.data_ptr()) + g0 * group_bytes, g1 - g0, k, esize,
                              to_nt16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("nt16_permute_(Tensor(a!) matrix, int g0, int g1, bool to_nt16) -> ()");
}

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) { m.impl("nt16_permute_", &nt16_permute_); }
