// BF16 linear layers for CPUs with AVX512-BF16: y = x @ w^T + bias, bf16 operands, float32 sums over
// the whole K and one rounding to bf16 at the end, like torch.nn.functional.linear (the reference;
// only the summation order differs).
//
// The weight is read in place from its [N, K] row-major tensor: weight updates write into it every
// RL step, so a packed copy would have to be rebuilt and would double the memory. Large M reuses the
// FP8 kernel's GEMM (linear_common.h) with weight tiles copied to L1 instead of converted from E4M3;
// small M streams weight rows against a few activation rows. Without AVX512-BF16 the op is not
// registered and the Python wrapper uses torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_common.h"

#ifdef FP8E_BF16_KERNELS

namespace {

using namespace fp8e;

struct Problem {
  int64_t m, n, k;
  const uint16_t* x;  // [M, K] bf16, rows ldx apart
  int64_t ldx;
  const uint16_t* w;  // [N, K] bf16, rows ldw apart
  int64_t ldw;
  const float* bias;  // [N] or nullptr
  float bias_at(int64_t row) const { return bias ? bias[row] : 0.f; }
};

// ---- small M ---------------------------------------------------------------------------------------

// acc[i][j] += x row i . w row j over 32 k starting at k; masked-off k load as zeros. Each weight load
// prefetches the line `ahead` elements on (the next tile's row), as the FP8 kernel does.
template <int MR, int NR>
void gemv_chunk(const uint16_t* const (&xr)[MR], const uint16_t* const (&wr)[NR], int64_t ahead, int64_t k,
                __mmask32 mask, __m512 (&acc)[MR][NR]) {
  __m512bh xv[MR];
  for (int i = 0; i < MR; ++i) xv[i] = as_bh(_mm512_maskz_loadu_epi16(mask, xr[i] + k));
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k + ahead), _MM_HINT_T0);
    const __m512bh wv = as_bh(_mm512_maskz_loadu_epi16(mask, wr[j] + k));
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
  }
}

// res[i * NR + j] = y[m0 + i, n0 + j] before bias.
template <int MR, int NR>
void gemv_tile(const Problem& p, int64_t m0, int64_t n0, float (&res)[kGemvAcc]) {
  const uint16_t* xr[MR];
  const uint16_t* wr[NR];
  for (int i = 0; i < MR; ++i) xr[i] = p.x + (m0 + i) * p.ldx;
  for (int j = 0; j < NR; ++j) wr[j] = p.w + std::min(n0 + j, p.n - 1) * p.ldw;  // clamped rows are dropped
  __m512 acc[MR][NR];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  int64_t k = 0;
  const int64_t ahead = NR * p.ldw;
  for (; k + 32 <= p.k; k += 32) gemv_chunk(xr, wr, ahead, k, ~__mmask32(0), acc);
  if (k < p.k) gemv_chunk(xr, wr, ahead, k, tail_mask32(p.k - k), acc);
  alignas(64) float tot[kGemvAcc][16] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_store_ps(tot[i * NR + j], acc[i][j]);
  hsum8(tot, res);
  hsum8(tot + 8, res + 8);
}

template <int MR>
void gemv_rows(const Problem& p, int64_t m0, int64_t n0, at::BFloat16* y) {
  constexpr int NR = gemv_nr(MR);
  for (int64_t nj = n0; nj < std::min(p.n, n0 + kGemvRows); nj += NR) {
    float res[kGemvAcc];
    gemv_tile<MR, NR>(p, m0, nj, res);
    for (int j = 0; j < NR && nj + j < p.n; ++j)
      for (int i = 0; i < MR; ++i) y[(m0 + i) * p.n + nj + j] = at::BFloat16(res[i * NR + j] + p.bias_at(nj + j));
  }
}

using GemvRowsFn = void (*)(const Problem&, int64_t, int64_t, at::BFloat16*);
constexpr GemvRowsFn kGemvRowsFn[kGemvMaxRows + 1] = {nullptr, gemv_rows<1>, gemv_rows<2>, gemv_rows<3>,
                                                      gemv_rows<4>};

void linear_small_m(const Problem& p, at::BFloat16* y) {
  const int64_t groups = cdiv(p.n, kGemvRows);
  const int64_t rows_per_pass = cdiv(p.m, cdiv(p.m, kGemvMaxRows));  // balanced passes over the weights
  // Keep a task at >= ~64 KiB of weights so tiny layers are not split across threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (kGemvRows * p.k));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m0 = 0; m0 < p.m; m0 += rows_per_pass)
        kGemvRowsFn[std::min(rows_per_pass, p.m - m0)](p, m0, g * kGemvRows, y);
  });
}

// ---- large M ---------------------------------------------------------------------------------------
//
// A task owns kTileN weight rows and a range of 16-row activation vectors. Per kBlockK columns it
// copies its weight rows into an L1 tile (zero padded, so tails need no masks in the micro kernel)
// and accumulates the micro kernel's block results in a float32 tile.

constexpr int64_t kTileN = 48;
constexpr int64_t kBlockK = 256;

// xp[pair][m] holds the bf16 pair (x[m, 2 pair], x[m, 2 pair + 1]) per 32-bit lane; zero past M and K.
struct PackedX {
  int64_t mpad = 0;
  Buffer<float> xp;
};

// One 16-row x 32-k tile: each row's 16 pairs are one vector, so a 32-bit transpose packs them.
void pack_tile(const uint16_t* src, int64_t ldx, int64_t rows, int64_t cols, float* dst, int64_t ld_dst) {
  const __mmask32 mask = tail_mask32(cols);
  __m512 r[16];
  for (int i = 0; i < 16; ++i)
    r[i] = i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, src + i * ldx)) : _mm512_setzero_ps();
  transpose16x16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld_dst, r[i]);
}

PackedX pack_activations(const Problem& p) {
  PackedX out{cdiv(p.m, 16) * 16, nullptr};
  const int64_t mvecs = out.mpad / 16, kchunks = cdiv(p.k, 32);
  out.xp = alloc_buffer<float>(kchunks * 16 * out.mpad);
  at::parallel_for(0, mvecs * kchunks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mv = t / kchunks, c = t % kchunks;
      pack_tile(p.x + mv * 16 * p.ldx + c * 32, p.ldx, std::min<int64_t>(16, p.m - mv * 16), p.k - c * 32,
                out.xp.get() + c * 16 * out.mpad + mv * 16, out.mpad);
    }
  });
  return out;
}

// wb[r][c] = w[n0 + r, k0 + c], zero past K; rows past N keep the zeros the caller wrote.
void copy_weight_block(const Problem& p, int64_t n0, int64_t k0, uint16_t* wb) {
  const int64_t rows = std::min(kTileN, p.n - n0);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = p.w + (n0 + r) * p.ldw + k0;
    for (int64_t c = 0; c < kBlockK; c += 32)
      _mm512_store_si512(wb + r * kBlockK + c, _mm512_maskz_loadu_epi16(tail_mask32(p.k - k0 - c), src + c));
  }
}

void gemm_task(const Problem& p, const PackedX& x, const GemmTask& t, uint16_t* wb, float* ct, at::BFloat16* y) {
  const int64_t ldc = (t.mv1 - t.mv0) * 16;
  if (p.n - t.n0 < kTileN) std::memset(wb, 0, sizeof(uint16_t) * kTileN * kBlockK);
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    copy_weight_block(p, t.n0, k0, wb);
    const int64_t pairs = cdiv(std::min(kBlockK, p.k - k0), 2);
    for (int64_t mv = t.mv0; mv < t.mv1; mv += kMaxMv) {
      const int mvs = static_cast<int>(std::min<int64_t>(kMaxMv, t.mv1 - mv));
      const float* xp = x.xp.get() + k0 / 2 * x.mpad + mv * 16;
      const int nr = micro_nr(mvs);
      for (int64_t j0 = 0; j0 < kTileN; j0 += nr)
        kMicro<false>[mvs](wb + j0 * kBlockK, kBlockK, xp, x.mpad, pairs, nullptr, nullptr,
                           ct + j0 * ldc + (mv - t.mv0) * 16, ldc, k0 == 0);
    }
  }
  write_tile(p.m, p.n, kTileN, p.bias, t, ct, ldc, y);
}

void linear_large_m(const Problem& p, at::BFloat16* y) {
  const PackedX x = pack_activations(p);
  const int64_t mvecs = x.mpad / 16, n_tiles = cdiv(p.n, kTileN);
  const int64_t chunks = m_chunks(n_tiles, mvecs, at::get_num_threads());
  at::parallel_for(0, n_tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    auto wb = alloc_buffer<uint16_t>(kTileN * kBlockK);
    auto ct = alloc_buffer<float>(kTileN * cdiv(mvecs, chunks) * 16);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % chunks;
      const GemmTask t{i / chunks * kTileN, c * mvecs / chunks, (c + 1) * mvecs / chunks};
      gemm_task(p, x, t, wb.get(), ct.get(), y);
    }
  });
}

constexpr int64_t kSmallM = 7;  // up to here streaming the weights per 4 rows beats padding M to 16

// batch_invariant: always the large-M path, whose per-row arithmetic does not depend on M or on the row's
// place in the batch (the small-M path sums in another order; see fp8_linear.cpp).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       bool batch_invariant) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16_linear: x and w must be bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "bf16_linear: x must be [M, K] with unit inner stride");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "bf16_linear: w must be [N, K] with unit inner stride");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && k > 0, "bf16_linear: x has K=", k, " but w is ", w.sizes());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bf16_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return y;
  const Problem p{m, n, k, static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                  static_cast<const uint16_t*>(w.data_ptr()), w.stride(0),
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr};
  auto* out = y.data_ptr<at::BFloat16>();
  if (m <= kSmallM && !batch_invariant) {
    linear_small_m(p, out);
  } else {
    linear_large_m(p, out);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias, bool batch_invariant=False) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
}

#endif  // FP8E_BF16_KERNELS
