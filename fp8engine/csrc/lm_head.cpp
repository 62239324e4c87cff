// Float32 LM head over model-dtype weights, for x86 CPUs with AVX-512: y[m, n] = sum_k x[m, k] w[n, k]
// with x float32, w bfloat16 or float32 (bf16 widens to fp32 exactly) and every product and sum in fp32.
// Reference: torch.nn.functional.linear(x.float(), w.float()) (fp8engine/model_executor/layers/embedding.py).
//
// Each output sums its products in one fixed order (16 lanes over k, then a fixed lane reduction) however
// the rows and columns are tiled, so a row's logits never depend on the other rows: batch invariant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace {

using fp8engine_vec::dispatch_io;
using fp8engine_vec::load16;
using fp8engine_vec::tail_mask;

constexpr int64_t kMr = 4;        // rows per register tile
constexpr int64_t kNr = 4;        // weight rows per register tile
constexpr int64_t kNBlock = 64;   // weight rows per task: 64 x K stays in L2 while every row of x passes

template <int MR, int NR, typename WT>
void tile(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 m = tail_mask(k - c);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load16(w + j * ldw + c, m);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + c);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MR, typename WT>
void tile_cols(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t k, int64_t cols, float* y,
               int64_t ldy) {
  int64_t j = 0;
  for (; j + kNr <= cols; j += kNr) tile<MR, kNr>(x, ldx, w + j * ldw, ldw, k, y + j, ldy);
  for (; j < cols; ++j) tile<MR, 1>(x, ldx, w + j * ldw, ldw, k, y + j, ldy);
}

template <typename WT>
void head(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const float* xp = x.data_ptr<float>();
  const WT* wp = w.data_ptr<WT>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + kNBlock - 1) / kNBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kNBlock, cols = std::min(kNBlock, n - n0);
      int64_t i = 0;
      for (; i + kMr <= m; i += kMr)
        tile_cols<kMr>(xp + i * k, k, wp + n0 * k, k, k, cols, yp + i * n + n0, n);
      for (; i < m; ++i) tile_cols<1>(xp + i * k, k, wp + n0 * k, k, k, cols, yp + i * n + n0, n);
    }
  });
}

at::Tensor lm_head_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "lm_head_f32: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "lm_head_f32: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "lm_head_f32: w must be a contiguous [N, K] tensor with x's K");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (y.numel() == 0) return y;
  dispatch_io(w.scalar_type(), [&](auto wt) { head<typename decltype(wt)::type>(x, w, y); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) { m.def("lm_head_f32(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) { m.impl("lm_head_f32", &lm_head_f32); }

#endif
