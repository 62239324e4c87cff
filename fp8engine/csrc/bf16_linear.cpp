// BF16 linear layers for CPUs with AVX512-BF16: y = x @ w^T + bias, bf16 operands, float32 sums over
// the whole K and one rounding to bf16 at the end, like torch.nn.functional.linear (the reference;
// only the summation order differs).
//
// The weight is read in place from its [N, K] row-major tensor: weight updates write into it every
// RL step, so a packed copy would have to be rebuilt and would double the memory. Large M runs a GEMM:
// on AMX tiles where the CPU has them (weight rows loaded straight into tiles), else the FP8 kernel's
// AVX-512 GEMM (linear_common.h) with weight tiles copied to L1 instead of converted from E4M3; small M
// streams weight rows against a few activation rows. Without AVX512-BF16 but with AVX2 + FMA (AMD Zen 2-3,
// Intel before Cooper Lake) one kernel serves every M (linear_common.h: float32 sums of 128-wide K blocks,
// added block after block); without either the op is not registered and the Python wrapper uses torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "amx.h"
#include "layout.h"
#include "linear_common.h"
#include "next_weight.h"

#if defined(FP8E_BF16_KERNELS) || defined(FP8E_AVX2_KERNELS)

namespace {

// bf16_linear's operands, checked, for either kernel set: y [M, N] allocated (float32 or bf16), the bias in
// float32 (undefined without one).
struct Bf16Args {
  int64_t m, n, k;
  at::Tensor bias_f, y;
};

Bf16Args check_bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           bool float32_out) {
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
  return Bf16Args{m, n, k, bias_f,
                  at::empty({m, n}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16)
                                        .memory_format(at::MemoryFormat::Contiguous))};
}

}  // namespace

#endif

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
  int64_t terms = 1;  // AMX only: x holds `terms` groups of m rows (m a multiple of 16), y[i] = sum of their rows i
  bool nt16 = false;  // w in the nt16 layout (weights/layout.py): whole groups of 16 rows as lines of one pair each
  float bias_at(int64_t row) const { return bias ? bias[row] : 0.f; }
  // Whether the 16 rows from row0 (a multiple of 16) are an nt16 group: line q (64 bytes) of the group holds pair q
  // of its 16 rows, lane r row r, the vectors nt's chains take; rows past the last whole group are stored as rows.
  bool grouped(int64_t row0) const { return nt16 && row0 + 16 <= n; }
  const uint16_t* line(int64_t row0, int64_t q) const { return w + row0 * k + 32 * q; }
};

// ---- small M ---------------------------------------------------------------------------------------

// acc[i][j] += x row i . w row j over 32 k starting at k; masked-off k load as zeros. Each weight load
// prefetches the line `ahead` elements on (the next tile's row) into L1 and the line twice as far on into L2, as
// the FP8 kernel does. The second was missing here: the BF16 head (49152 x 576, from DRAM, 2 threads of a Zen 4,
// medians of 9 alternating rounds in one process, the same bits) 2.84 -> 2.11 ms at 1 row, 2.80 -> 1.79 at 2 (its
// floor ~1.75), the 30 BF16 layers 10.9 -> 8.6 ms at 1 row; 4 tiles on into L2 instead measured the same. (One row
// has since taken gemv_tile_1row.)
template <int MR, int NR>
void gemv_chunk(const uint16_t* const (&xr)[MR], const uint16_t* const (&wr)[NR], int64_t ahead, int64_t k,
                __mmask32 mask, __m512 (&acc)[MR][NR]) {
  __m512bh xv[MR];
  for (int i = 0; i < MR; ++i) xv[i] = as_bh(_mm512_maskz_loadu_epi16(mask, xr[i] + k));
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k + ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k + 2 * ahead), _MM_HINT_T2);
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

// gemv_tile at one activation row, walking the tile's weight rows one after the other, each along K (the same
// chains as gemv_tile's, so the same bits): the tile's reads are then one sequential stretch of memory, and each
// line prefetches the line kRowFarTiles tiles on into L2. Against gemv_tile's walk across the 8 rows per K chunk
// (2 threads of a Zen 4, from DRAM, medians of 15 alternating rounds, every output compared bit for bit): the
// BF16 head (49152 x 576) 2.32 -> 1.99 ms, the default model's 30 BF16 layers 9.82 -> 8.64 ms; a batch-1 decode
// step of full-fp8 with its BF16 head 6.97 -> 6.52 ms (12 alternating rounds in one process). The prefetch 3-8
// tiles on measured alike; with gemv_tile's L1 prefetch of the next tile as well, slower. At 2-4 rows, where
// each weight line feeds several chains, the gain was within noise: they keep gemv_tile.
constexpr int64_t kRowFarTiles = 4;

template <int NR>
void gemv_tile_1row(const Problem& p, int64_t m0, int64_t n0, float (&res)[kGemvAcc]) {
  const uint16_t* xr = p.x + m0 * p.ldx;
  const int64_t far = kRowFarTiles * NR * p.ldw;
  alignas(64) float tot[kGemvAcc][16] = {};
  for (int j = 0; j < NR; ++j) {
    const uint16_t* wr = p.w + std::min(n0 + j, p.n - 1) * p.ldw;  // clamped rows are dropped
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= p.k; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k + far), _MM_HINT_T2);
      acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(xr + k)), as_bh(_mm512_loadu_si512(wr + k)));
    }
    if (k < p.k) {
      const __mmask32 mask = tail_mask32(p.k - k);
      acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_maskz_loadu_epi16(mask, xr + k)),
                             as_bh(_mm512_maskz_loadu_epi16(mask, wr + k)));
    }
    _mm512_store_ps(tot[j], acc);
  }
  hsum8(tot, res);
  hsum8(tot + 8, res + 8);
}

template <int MR, typename OutT>
void gemv_rows(const Problem& p, int64_t m0, int64_t n0, OutT* y) {
  constexpr int NR = gemv_nr(MR);
  for (int64_t nj = n0; nj < std::min(p.n, n0 + kGemvRows); nj += NR) {
    float res[kGemvAcc];
    if constexpr (MR == 1) {
      gemv_tile_1row<NR>(p, m0, nj, res);
    } else {
      gemv_tile<MR, NR>(p, m0, nj, res);
    }
    for (int j = 0; j < NR && nj + j < p.n; ++j)
      for (int i = 0; i < MR; ++i) y[(m0 + i) * p.n + nj + j] = OutT(res[i * NR + j] + p.bias_at(nj + j));
  }
}

template <typename OutT>
using GemvRowsFn = void (*)(const Problem&, int64_t, int64_t, OutT*);
template <typename OutT>
constexpr GemvRowsFn<OutT> kGemvRowsFn[kGemvMaxRows + 1] = {nullptr, gemv_rows<1, OutT>, gemv_rows<2, OutT>,
                                                            gemv_rows<3, OutT>, gemv_rows<4, OutT>};

template <typename OutT>
void linear_small_m(const Problem& p, OutT* y) {
  const int64_t groups = cdiv(p.n, kGemvRows);
  const int64_t rows_per_pass = cdiv(p.m, cdiv(p.m, kGemvMaxRows));  // balanced passes over the weights
  // Keep a task at >= ~64 KiB of weights so tiny layers are not split across threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (kGemvRows * p.k));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m0 = 0; m0 < p.m; m0 += rows_per_pass)
        kGemvRowsFn<OutT>[std::min(rows_per_pass, p.m - m0)](p, m0, g * kGemvRows, y);
  });
}

// ---- small M: weight rows across the lanes (linear_common.h) ----------------------------------------

constexpr int64_t kBlockK = 256;  // K per block, here and in the GEMM below: the chains must match

// A task's rows of K block k0 for nt_transpose: in place where the block is whole, else from pad (zero past N
// and K); and where nt_transpose prefetches as it goes, line for line as it reads the rows: into L1 the rows' next
// block (after the last, the next task's first), into L2 the next task's rows at this block (rows past N: the
// weight's first line). They replaced a burst of the next block's 256 lines into L1 here, which stalled on the
// core's miss buffers with the reads still waiting on DRAM: at M=1 from DRAM the default model's BF16 head
// (49152 x 576) 3.30 -> 2.19 ms (the gemv: 2.0), 40 x (1536 x 576) 4.46 -> 3.16 ms; at M=5 3.96 -> 2.74 and
// 5.53 -> 3.81 ms (medians of 9 alternating rounds in one process, 2 threads).
void nt_rows(const Problem& p, int64_t n0, int64_t k0, uint16_t* pad, const uint16_t* (&rows)[kNtRows],
             const char* (&l1)[kNtRows], const char* (&l2)[kNtRows]) {
  const bool whole = k0 + kBlockK <= p.k;
  const auto at = [&](int64_t row, int64_t k) {
    return reinterpret_cast<const char*>(p.w + (row < p.n ? row * p.ldw + k : 0));
  };
  for (int64_t r = 0; r < kNtRows; ++r) {
    const int64_t n = n0 + r;
    l1[r] = k0 + kBlockK < p.k ? at(n, k0 + kBlockK) : at(n + kNtRows, 0);
    l2[r] = at(n + kNtRows, k0);
    if (n < p.n && whole) {
      rows[r] = p.w + n * p.ldw + k0;
      continue;
    }
    uint16_t* dst = pad + r * kBlockK;
    for (int64_t c = 0; c < kBlockK; c += 32)
      _mm512_store_si512(dst + c, n < p.n ? _mm512_maskz_loadu_epi16(tail_mask32(p.k - k0 - c), p.w + n * p.ldw + k0 + c)
                                          : _mm512_setzero_si512());
    rows[r] = dst;
  }
}

// wt[(q * kNtVecs + v) * 16 + r] = pair q of row 16 v + r, from rows[r] (bf16, pairs in the order the chain takes
// them), for pair_chunks chunks of 16 pairs; line c (64 bytes) of each l1 and l2 row is prefetched into L1 and L2 as
// line c of the rows is read (nt_rows). Per 4 pairs of 16 rows, four vectors take rows 4 L .. 4 L + 3 in 128-bit lane
// L (loads into lanes) and two rounds of in-lane unpacks (32-bit, then 64-bit) leave one pair of the 16 rows in
// each, lane r row r: the loads do the cross-lane half of a 16 x 16 transpose, whose 64 shuffles per 16 vectors
// this halves (from DRAM, 2 threads, medians of 9 alternating rounds: the head (49152 x 576) at M=1 2.31 / 2.65 ->
// 2.02 / 2.51 ms, at 8 3.09 -> 2.89; 40 x (1536 x 576) at 1 3.46 -> 3.20, at 16 6.42 -> 6.24).
void nt_transpose(const uint16_t* const (&rows)[kNtRows], int64_t pair_chunks, float* wt,
                  const char* const (&l1)[kNtRows], const char* const (&l2)[kNtRows]) {
  for (int v = 0; v < kNtVecs; ++v)
    for (int64_t c = 0; c < pair_chunks; ++c) {
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(l1[16 * v + i] + 64 * c, _MM_HINT_T0);
        _mm_prefetch(l2[16 * v + i] + 64 * c, _MM_HINT_T2);
      }
      for (int64_t c4 = 4 * c; c4 < 4 * c + 4; ++c4) {  // pairs 4 c4 .. 4 c4 + 3
        __m512i l[4];
        for (int i = 0; i < 4; ++i) l[i] = lanes_of_rows(rows + 16 * v, i, 16 * c4);
        const __m512i p0 = _mm512_unpacklo_epi32(l[0], l[1]), p1 = _mm512_unpackhi_epi32(l[0], l[1]);
        const __m512i q0 = _mm512_unpacklo_epi32(l[2], l[3]), q1 = _mm512_unpackhi_epi32(l[2], l[3]);
        const __m512i out[4] = {_mm512_unpacklo_epi64(p0, q0), _mm512_unpackhi_epi64(p0, q0),
                                _mm512_unpacklo_epi64(p1, q1), _mm512_unpackhi_epi64(p1, q1)};
        for (int j = 0; j < 4; ++j) _mm512_store_si512(wt + ((4 * c4 + j) * kNtVecs + v) * 16, out[j]);
      }
    }
}

// Lines ahead that nt16_blocks prefetches into L1 in each stream (beside the next task's lines into L2). The
// default model's head (49152 x 576) at one row, three copies cycled from L3 (this Xeon's 260 MiB), 2 threads,
// against the gemv in the same process: next task into L2 alone 0.88-1.02x the gemv's time, with 8 lines into L1
// 0.83-0.93x, neither 1.31-1.65x.
constexpr int64_t kNt16L1Lines = 8;

// K block k0 of the task's rows n0.. into wt, pair_chunks chunks of 16 pairs (nt_rows, then nt_transpose); an
// nt16 group's pairs are its lines, copied (zero past K) instead.
void nt_block_pairs(const Problem& p, int64_t n0, int64_t k0, int64_t pair_chunks, uint16_t* pad, float* wt) {
  bool grouped[kNtVecs], all = true;
  for (int v = 0; v < kNtVecs; ++v) all = (grouped[v] = p.grouped(n0 + 16 * v)) && all;
  if (!all) {
    const uint16_t* rows[kNtRows];
    const char *l1[kNtRows], *l2[kNtRows];
    nt_rows(p, n0, k0, pad, rows, l1, l2);
    nt_transpose(rows, pair_chunks, wt, l1, l2);
  }
  const int64_t lines = std::min(16 * pair_chunks, (p.k - k0) / 2), ahead = kNtRows * p.k;
  for (int v = 0; v < kNtVecs; ++v)
    for (int64_t q = 0; grouped[v] && q < 16 * pair_chunks; ++q) {
      const uint16_t* src = p.line(n0 + 16 * v, k0 / 2 + q);
      if (q < lines) {  // prefetched as nt16_blocks does (below)
        _mm_prefetch(reinterpret_cast<const char*>(src + ahead), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(src + 32 * kNt16L1Lines), _MM_HINT_T0);
      }
      _mm512_store_si512(wt + (q * kNtVecs + v) * 16, q < lines ? _mm512_loadu_si512(src) : _mm512_setzero_si512());
    }
}

// nt_blocks on a task of two nt16 groups at a row or two, straight from the lines (no copy into wt): G blocks of K
// from k0, the last one possibly partial (its chain over its pairs, as nt_block's). Each block's chain in pair
// order, the blocks' sums added in block order: nt_blocks' bits. The next task's lines are prefetched into L2.
template <int G, int MR>
void nt16_blocks(const Problem& p, int64_t n0, int64_t k0, const uint16_t* xb, int64_t ldx, float* tot, bool first,
                 intptr_t ahead) {
  static_assert(kNtVecs == 2, "a task is two groups");
  const int64_t last_pairs = cdiv(std::min(kBlockK, p.k - (k0 + (G - 1) * kBlockK)), 2);
  __m512 acc[G][MR][kNtVecs];
  for (auto& block : acc)
    for (auto& row : block)
      for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t q = 0; q < kBlockK / 2; ++q)
    for (int g = 0; g < G; ++g) {
      if (g == G - 1 && q >= last_pairs) continue;
      const int64_t line = (k0 + g * kBlockK) / 2 + q;
      __m512bh wv[kNtVecs];
      for (int v = 0; v < kNtVecs; ++v) {
        const uint16_t* src = p.line(n0 + 16 * v, line);
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<intptr_t>(src) + ahead), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(src + 32 * kNt16L1Lines), _MM_HINT_T0);
        wv[v] = as_bh(_mm512_loadu_si512(src));
      }
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, xb + i * ldx + g * kBlockK + 2 * q, 4);
        const __m512bh xv = as_bh(_mm512_set1_epi32(pair));
        for (int v = 0; v < kNtVecs; ++v) acc[g][i][v] = _mm512_dpbf16_ps(acc[g][i][v], wv[v], xv);
      }
    }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kNtVecs; ++v) {
        float* t = tot + (i * kNtVecs + v) * 16;
        const __m512 prev = first && g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(t);
        _mm512_store_ps(t, _mm512_add_ps(acc[g][i][v], prev));
      }
}

using Nt16BlocksFn = void (*)(const Problem&, int64_t, int64_t, const uint16_t*, int64_t, float*, bool, intptr_t);
constexpr Nt16BlocksFn kNt16Blocks[4][kNtGroupMaxM + 1] = {{nullptr, nullptr, nullptr},
                                                          {nullptr, nt16_blocks<1, 1>, nt16_blocks<1, 2>},
                                                          {nullptr, nt16_blocks<2, 1>, nt16_blocks<2, 2>},
                                                          {nullptr, nt16_blocks<3, 1>, nt16_blocks<3, 2>}};
// Above two rows one block a call (the rows' chains are enough to overlap), up to a register tile of rows.
constexpr Nt16BlocksFn kNt16Block[kNtMaxRows + 1] = {
    nullptr, nt16_blocks<1, 1>, nt16_blocks<1, 2>, nt16_blocks<1, 3>, nt16_blocks<1, 4>,
    nt16_blocks<1, 5>, nt16_blocks<1, 6>, nt16_blocks<1, 7>, nt16_blocks<1, 8>};

constexpr int64_t kWtFloats = kBlockK / 2 * kNtRows;  // one block's transposed pairs (nt_transpose)
constexpr int kNtGroup = 2;                            // K blocks nt_blocks takes at once

template <typename OutT>
void linear_nt(const Problem& p, OutT* y) {
  const int64_t kpad = cdiv(p.k, kBlockK) * kBlockK;
  auto x = alloc_buffer<uint16_t>(p.m * kpad);  // zero past K, as the GEMM's packed activations
  for (int64_t m = 0; m < p.m; ++m) {
    std::memcpy(x.get() + m * kpad, p.x + m * p.ldx, sizeof(uint16_t) * p.k);
    std::memset(x.get() + m * kpad + p.k, 0, sizeof(uint16_t) * (kpad - p.k));
  }
  const int64_t per_pass = nt_rows_per_pass(p.m);
  const __m512 no_scales[kNtVecs] = {};
  const fp8e::NextWeight next = fp8e::take_next_weight();
  at::parallel_for(0, cdiv(p.n, kNtRows), 1, [&](int64_t begin, int64_t end) {
    auto pad = alloc_buffer<uint16_t>(kNtRows * kBlockK);
    auto wt = alloc_buffer<float>(kNtGroup * kWtFloats);
    auto tot = alloc_buffer<float>(p.m * kNtRows);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNtRows;
      int64_t k0 = 0;
      if (p.m <= kNtMaxRows && p.grouped(n0) && p.grouped(n0 + 16)) {
        // the next task's lines into L2, or in the thread's last its first share of the next weight (next_weight.h)
        const char* pf = t + 1 == end ? next.share(kNtRows) : nullptr;
        const intptr_t ahead = pf == nullptr ? kNtRows * p.k * 2
                                             : reinterpret_cast<intptr_t>(pf) -
                                                   reinterpret_cast<intptr_t>(p.line(n0, 0));
        // at a row or two two blocks a call (three for the last rather than leave one alone), above one at a time
        const int64_t blocks = cdiv(p.k, kBlockK);
        for (int64_t b = 0; b < blocks;) {
          const int64_t g = p.m > kNtGroupMaxM ? 1 : blocks - b == 3 ? 3 : std::min<int64_t>(2, blocks - b);
          (p.m > kNtGroupMaxM ? kNt16Block[p.m] : kNt16Blocks[g][p.m])(p, n0, b * kBlockK, x.get() + b * kBlockK,
                                                                       kpad, tot.get(), b == 0, ahead);
          b += g;
        }
        nt_write(p.m, p.n, n0, p.bias, tot.get(), y);
        continue;
      }
      if (p.m <= kNtGroupMaxM)  // whole blocks kNtGroup at a time (nt_blocks)
        for (; k0 + kNtGroup * kBlockK <= p.k; k0 += kNtGroup * kBlockK) {
          for (int g = 0; g < kNtGroup; ++g)
            nt_block_pairs(p, n0, k0 + g * kBlockK, kBlockK / 32, pad.get(), wt.get() + g * kWtFloats);
          kNtBlocks<kBlockK, kNtGroup, false>[p.m](
              wt.get(), kWtFloats, x.get() + k0, kpad, nullptr, 0, nullptr, tot.get(), k0 == 0);
        }
      for (; k0 < p.k; k0 += kBlockK) {
        const int64_t pairs = cdiv(std::min(kBlockK, p.k - k0), 2);  // as the GEMM's
        nt_block_pairs(p, n0, k0, cdiv(pairs, 16), pad.get(), wt.get());
        for (int64_t m0 = 0; m0 < p.m; m0 += per_pass)
          kNtBlock<false>[std::min(per_pass, p.m - m0)](wt.get(), x.get() + m0 * kpad + k0, kpad, pairs, nullptr, 0,
                                                        no_scales, tot.get() + m0 * kNtRows, k0 == 0);
      }
      nt_write(p.m, p.n, n0, p.bias, tot.get(), y);
    }
  });
}

// ---- small M in the AMX tiles' order (linear_common.h) ---------------------------------------------

// One K block from k0 of a task of two nt16 groups in the tiles' order: the BF16 tiles keep one running C per output
// over all of K, so tot carries it from block to block (`first`: C starts at zero), and each 32-k step adds its even
// and odd chains (products and sums flushed as the tiles flush them: the caller holds TileDenormals). S steps' chains
// run at once (8 chains at a row and S = 2, where one step's 4 wait on the adds' latency), folded in step order. A
// ragged K's last step stops at K: the tiles' zero padding adds +0 to chains that are never -0.
template <int MR, int S>
void nt16_tiles_block(const Problem& p, int64_t n0, int64_t k0, const uint16_t* xb, int64_t ldx, float* tot,
                      bool first) {
  const int64_t pairs = std::min(kBlockK, p.k - k0) / 2, ahead = kNtRows * p.k;
  __m512 c[MR][kNtVecs];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kNtVecs; ++v) c[i][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(tot + (i * kNtVecs + v) * 16);
  for (int64_t s0 = 0; s0 * 16 < pairs; s0 += S) {
    __m512 even[S][MR][kNtVecs], odd[S][MR][kNtVecs];
    for (int h = 0; h < S; ++h)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < kNtVecs; ++v) even[h][i][v] = odd[h][i][v] = _mm512_setzero_ps();
    for (int64_t q = 0; q < 16; ++q)
      for (int h = 0; h < S; ++h) {
        const int64_t pair = (s0 + h) * 16 + q;
        if (pair >= pairs) continue;
        __m512i wv[kNtVecs];
        for (int v = 0; v < kNtVecs; ++v) {
          const uint16_t* src = p.line(n0 + 16 * v, k0 / 2 + pair);
          _mm_prefetch(reinterpret_cast<const char*>(src + ahead), _MM_HINT_T2);
          _mm_prefetch(reinterpret_cast<const char*>(src + 32 * kNt16L1Lines), _MM_HINT_T0);
          wv[v] = _mm512_loadu_si512(src);
        }
        for (int i = 0; i < MR; ++i) {
          int32_t xp;
          std::memcpy(&xp, xb + i * ldx + 2 * pair, 4);
          const __m512 xe = _mm512_set1_ps(pair_even(xp)), xo = _mm512_set1_ps(pair_odd(xp));
          for (int v = 0; v < kNtVecs; ++v) {  // mul, then add: a product below float32's normals is flushed first
            even[h][i][v] = _mm512_add_ps(even[h][i][v], _mm512_mul_ps(pairs_even(wv[v]), xe));
            odd[h][i][v] = _mm512_add_ps(odd[h][i][v], _mm512_mul_ps(pairs_odd(wv[v]), xo));
          }
        }
      }
    for (int h = 0; h < S && (s0 + h) * 16 < pairs; ++h)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < kNtVecs; ++v) c[i][v] = _mm512_add_ps(c[i][v], _mm512_add_ps(even[h][i][v], odd[h][i][v]));
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kNtVecs; ++v) _mm512_store_ps(tot + (i * kNtVecs + v) * 16, c[i][v]);
}

// The most rows linear_amx hands to nt16 in the tiles' order: the default model's 30 BF16 layers and its head from
// DRAM on a 2-vCPU Xeon with AMX (benchmarks/linear_stream.py --kernels bf16-bi,head-bi): the layers at 1 row 8.6 ms
// against the tiles' 10.4 and the gemv's 9.1, at 4 9.3 against the tiles' 10.8; the head at 1 row 1.88 against 2.25
// and 1.87; from 5 rows the tiles reading the groups (linear_amx_nt16) take over (9.8 ms at 5).
constexpr int64_t kTilesNtMaxM = 4;
using Nt16TilesBlockFn = void (*)(const Problem&, int64_t, int64_t, const uint16_t*, int64_t, float*, bool);
constexpr Nt16TilesBlockFn kNt16TilesBlock[kTilesNtMaxM + 1] = {
    nullptr, nt16_tiles_block<1, 2>, nt16_tiles_block<2, 2>, nt16_tiles_block<3, 1>, nt16_tiles_block<4, 1>};

// linear_amx's bits at up to kTilesNtMaxM rows from nt16 weights whose every task is two groups, without the tiles.
bool tiles_nt_takes(const Problem& p) { return p.m <= kTilesNtMaxM && p.nt16 && p.n % kNtRows == 0; }

template <typename OutT>
void linear_tiles_nt(const Problem& p, OutT* y) {
  at::parallel_for(0, p.n / kNtRows, 1, [&](int64_t begin, int64_t end) {
    auto tot = alloc_buffer<float>(p.m * kNtRows);
    for (int64_t t = begin; t < end; ++t) {
      {
        const TileDenormals flush;
        for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK)
          kNt16TilesBlock[p.m](p, t * kNtRows, k0, p.x + k0, p.ldx, tot.get(), k0 == 0);
      }
      nt_write(p.m, p.n, t * kNtRows, p.bias, tot.get(), y);
    }
  });
}

// ---- large M ---------------------------------------------------------------------------------------
//
// A task owns kTileN weight rows and a range of 16-row activation vectors. Per kBlockK columns it
// copies its weight rows into an L1 tile (zero padded, so tails need no masks in the micro kernel)
// and accumulates the micro kernel's block results in a float32 tile.

constexpr int64_t kTileN = 48;

// Activations packed as bf16 pairs, one 32-bit lane per row, zero past M and K: the pairs of 16-row vector
// mv and 32-k chunk c, 16 pairs ld() floats apart, from at(c, mv). The AVX-512 GEMM reads the pairs of all
// rows side by side; AMX (`tiles`) reads each chunk of a vector as one B tile, a vector's chunks in a row.
struct PackedX {
  int64_t mpad = 0, kchunks = 0;
  bool tiles = false;
  Buffer<float> xp;
  int64_t ld() const { return tiles ? 16 : mpad; }
  float* at(int64_t c, int64_t mv) const {
    return xp.get() + (tiles ? (mv * kchunks + c) * 256 : c * 16 * mpad + mv * 16);
  }
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

PackedX pack_activations(const Problem& p, bool tiles) {
  const int64_t rows = p.m * p.terms;
  PackedX out{cdiv(rows, 16) * 16, cdiv(p.k, 32), tiles, nullptr};
  const int64_t mvecs = out.mpad / 16;
  out.xp = alloc_buffer<float>(out.kchunks * 16 * out.mpad);
  at::parallel_for(0, mvecs * out.kchunks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mv = t / out.kchunks, c = t % out.kchunks;
      pack_tile(p.x + mv * 16 * p.ldx + c * 32, p.ldx, std::min<int64_t>(16, rows - mv * 16), p.k - c * 32,
                out.at(c, mv), out.ld());
    }
  });
  return out;
}

// wb[r][c] = w[n0 + r, k0 + c], zero past K; rows past N keep the zeros the caller wrote.
void copy_weight_block(const Problem& p, int64_t n0, int64_t k0, uint16_t* wb) {
  const int64_t rows = std::min(kTileN, p.n - n0);
  int64_t r = 0;
  for (; r + 16 <= rows && p.grouped(n0 + r); r += 16)  // an nt16 group: 16 lines of 16 pairs, transposed
    for (int64_t j0 = 0; j0 < kBlockK / 2; j0 += 16) {
      __m512 t[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t q = k0 / 2 + j0 + j;
        t[j] = 2 * q < p.k ? _mm512_castsi512_ps(_mm512_loadu_si512(p.line(n0 + r, q))) : _mm512_setzero_ps();
      }
      transpose16x16(t);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(wb + (r + i) * kBlockK + 2 * j0), t[i]);
    }
  for (; r < rows; ++r) {
    const uint16_t* src = p.w + (n0 + r) * p.ldw + k0;
    for (int64_t c = 0; c < kBlockK; c += 32)
      _mm512_store_si512(wb + r * kBlockK + c, _mm512_maskz_loadu_epi16(tail_mask32(p.k - k0 - c), src + c));
  }
}

template <typename OutT>
void gemm_task(const Problem& p, const PackedX& x, const GemmTask& t, uint16_t* wb, float* ct, OutT* y) {
  const int64_t ldc = (t.mv1 - t.mv0) * 16;
  if (p.n - t.n0 < kTileN) std::memset(wb, 0, sizeof(uint16_t) * kTileN * kBlockK);
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    copy_weight_block(p, t.n0, k0, wb);
    const int64_t pairs = cdiv(std::min(kBlockK, p.k - k0), 2);
    for (int64_t mv = t.mv0; mv < t.mv1; mv += kMaxMv) {
      const int mvs = static_cast<int>(std::min<int64_t>(kMaxMv, t.mv1 - mv));
      const float* xp = x.at(k0 / 32, mv);
      const int nr = micro_nr(mvs);
      for (int64_t j0 = 0; j0 < kTileN; j0 += nr)
        kMicro<false>[mvs](wb + j0 * kBlockK, kBlockK, xp, x.ld(), pairs, nullptr, nullptr,
                           ct + j0 * ldc + (mv - t.mv0) * 16, ldc, k0 == 0);
    }
  }
  write_tile(p.m, p.n, kTileN, p.bias, t, ct, ldc, y);
}

template <typename OutT>
void linear_large_m(const Problem& p, OutT* y) {
  const PackedX x = pack_activations(p, false);
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

#ifdef FP8E_AMX

// ---- AMX -------------------------------------------------------------------------------------------
//
// Weight rows are A tiles read in place (16 rows x 32 k, rows ldw apart); the packed activations are B
// tiles (16 pairs x 16 activation rows). A task owns kAmxTileN weight rows and a range of activation
// vectors, and goes over them in groups of 2 x 2 C tiles (32 weight rows x 32 activation rows), each
// group's C tiles summing all of K, 32 k after 32 k, before one rounding to bf16. An output's arithmetic
// depends only on its weight row, its activation row and K, never on M or the row's place: batch
// invariant by construction. Tile loads must not read past K or N, so a ragged K's last chunk, and a task
// of fewer than kAmxTileN rows, come from zero-padded copies.

constexpr int64_t kAmxTileN = 32;

// A task's A operand: chunks [0, steps) from a (rows lda apart), then, where K is ragged, the last chunk
// from tail ([kAmxTileN][32]).
struct AmxWeights {
  const uint16_t* a;
  int64_t lda, steps;
  const uint16_t* tail;
};

// pad: kAmxTileN x 32 * kchunks bf16 of scratch for the copies.
AmxWeights amx_weights(const Problem& p, int64_t n0, int64_t kchunks, uint16_t* pad) {
  const int64_t rows = std::min(kAmxTileN, p.n - n0);
  const uint16_t* w = p.w + n0 * p.ldw;
  if (rows == kAmxTileN && p.k % 32 == 0) return {w, p.ldw, kchunks, nullptr};
  const int64_t steps = rows == kAmxTileN ? p.k / 32 : kchunks;
  const int64_t ld = rows == kAmxTileN ? 32 : 32 * kchunks, c0 = rows == kAmxTileN ? steps : 0;
  for (int64_t r = 0; r < kAmxTileN; ++r)
    for (int64_t c = c0; c < kchunks; ++c)
      _mm512_storeu_si512(pad + r * ld + 32 * (c - c0),
                          r < rows ? _mm512_maskz_loadu_epi16(tail_mask32(p.k - 32 * c), w + r * p.ldw + 32 * c)
                                   : _mm512_setzero_si512());
  return rows == kAmxTileN ? AmxWeights{w, p.ldw, steps, pad} : AmxWeights{pad, ld, steps, nullptr};
}

// Prefetches a B tile (16 lines) to L1.
void prefetch_tile(const float* b) {
  for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(b + 16 * line), _MM_HINT_T0);
}

// One 32-k step of a group of NA x NB C tiles; tiles 0-3 C, 4-5 A, 6-7 B. The activations stream from L2, once
// per task, and the tile loads wait on them: the next step's B tiles (past the last step, the next vector's
// first) are prefetched, which takes 10-15% off from M = 16 to 512 (1 core of an Emerald Rapids Xeon).
// With `terms` > 1 each activation row is the sum of that many bf16 rows packed tstride floats apart (the
// float32 head's exact split): the A tiles, loaded once, multiply each term's B tiles into the same C tiles.
template <int NA, int NB>
void amx_step(const uint16_t* a, int64_t lda, const float* x0, const float* x1, int terms, int64_t tstride) {
  _tile_loadd(4, a, lda * 2);
  if constexpr (NA == 2) _tile_loadd(5, a + 16 * lda, lda * 2);
  for (int t = 0; t < terms; ++t, x0 += tstride, x1 += tstride) {
    prefetch_tile(x0 + 256);
    if constexpr (NB == 2) prefetch_tile(x1 + 256);
    _tile_loadd(6, x0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, x1, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NA == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NA == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
  }
}

// C tile i * NB + j (weight rows 16 i, activation vector j) over all of K, stored to c.
template <int NA, int NB>
void amx_group(const AmxWeights& wt, const float* x0, const float* x1, int terms, int64_t tstride, float (*c)[256]) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  int64_t s = 0;
  for (; s < wt.steps; ++s) amx_step<NA, NB>(wt.a + 32 * s, wt.lda, x0 + 256 * s, x1 + 256 * s, terms, tstride);
  if (wt.tail != nullptr) amx_step<NA, NB>(wt.tail, 32, x0 + 256 * s, x1 + 256 * s, terms, tstride);
  _tile_stored(0, c[0], 64);
  if constexpr (NB == 2) _tile_stored(1, c[1], 64);
  if constexpr (NA == 2) _tile_stored(2, c[NB], 64);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, c[NB + 1], 64);
}

// y[m, n0 + n] = bf16(c tiles + bias) for activation vectors mv, mv + 1 (nb of them) and na x 16 weight rows:
// C rows are weight rows, so each 16 x 16 tile is transposed; an output row's 32 values go out in one store.
template <typename OutT>
void amx_write(const Problem& p, int64_t n0, int64_t mv, int na, int nb, const float (*c)[256], OutT* y) {
  const __mmask16 mask_lo = tail_mask16(p.n - n0), mask_hi = tail_mask16(p.n - n0 - 16);
  const __m512 bias_lo = p.bias ? _mm512_maskz_loadu_ps(mask_lo, p.bias + n0) : _mm512_setzero_ps();
  const __m512 bias_hi = p.bias && na == 2 ? _mm512_maskz_loadu_ps(mask_hi, p.bias + n0 + 16) : _mm512_setzero_ps();
  for (int j = 0; j < nb; ++j) {
    __m512 lo[16], hi[16];
    for (int k = 0; k < 16; ++k) lo[k] = _mm512_load_ps(c[j] + 16 * k);
    transpose16x16(lo);
    if (na == 2) {
      for (int k = 0; k < 16; ++k) hi[k] = _mm512_load_ps(c[nb + j] + 16 * k);
      transpose16x16(hi);
    }
    const int64_t m = (mv + j) * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, p.m - m));
    for (int k = 0; k < rows; ++k) {
      OutT* out = y + (m + k) * p.n + n0;
      if (na == 2) {
        store_rows(out, _mm512_add_ps(lo[k], bias_lo), _mm512_add_ps(hi[k], bias_hi), mask_hi);
      } else {
        store_row(out, _mm512_add_ps(lo[k], bias_lo), mask_lo);
      }
    }
  }
}

template <typename OutT>
void amx_task(const Problem& p, const PackedX& x, const GemmTask& t, uint16_t* pad, OutT* y) {
  const AmxWeights wt = amx_weights(p, t.n0, x.kchunks, pad);
  const int na = p.n - t.n0 > 16 ? 2 : 1;
  const int terms = static_cast<int>(p.terms);
  const int64_t tstride = p.m / 16 * x.kchunks * 256;  // term t's vector mv is term 0's vector mv + t * m / 16
  alignas(64) float c[4][256];
  for (int64_t mv = t.mv0; mv < t.mv1; mv += 2) {
    const int nb = mv + 1 < t.mv1 ? 2 : 1;
    const float* x0 = x.at(0, mv);
    const float* x1 = x.at(0, mv + nb - 1);
    if (na == 2) {
      nb == 2 ? amx_group<2, 2>(wt, x0, x1, terms, tstride, c) : amx_group<2, 1>(wt, x0, x1, terms, tstride, c);
    } else {
      nb == 2 ? amx_group<1, 2>(wt, x0, x1, terms, tstride, c) : amx_group<1, 1>(wt, x0, x1, terms, tstride, c);
    }
    amx_write(p, t.n0, mv, na, nb, c, y);
  }
}

template <typename OutT>
void linear_amx(const Problem& p, OutT* y) {
  const PackedX x = pack_activations(p, true);
  const int64_t mvecs = x.mpad / 16 / p.terms, n_tiles = cdiv(p.n, kAmxTileN);
  const int64_t chunks = l2_chunks(n_tiles, mvecs, at::get_num_threads(), x.kchunks * 1024 * p.terms, 2);
  at::parallel_for(0, n_tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles;
    auto pad = alloc_buffer<uint16_t>(kAmxTileN * 32 * x.kchunks);
    for (int64_t i = begin; i < end; ++i)
      amx_task(p, x, chunk_major_task(i, n_tiles, kAmxTileN, mvecs, chunks), pad.get(), y);
  });
}

// nt16 weights as B tiles: line q of a group (pair q of its 16 rows, row r in lane r) is row q of a B tile as it
// lies in memory, so the tiles read a group's 16 lines of a 32-k step in place, with no copy or transposition, and
// the activations are the A tiles (16 rows x 32 k, rows padded to whole steps and vectors). C rows are then
// activation rows, written as they are. An output's sum is the same as with weights as A (each product is the same
// two bf16 values, the steps' chains the same k): linear_amx's bits (tests/test_bf16_linear.py).
struct RowsX {
  int64_t ld, mpad;
  Buffer<uint16_t> x;  // [mpad, ld] bf16, zero past M and K
};

RowsX pad_rows(const Problem& p) {
  RowsX out{cdiv(p.k, 32) * 32, cdiv(p.m, 16) * 16, nullptr};
  out.x = alloc_buffer<uint16_t>(out.mpad * out.ld);
  for (int64_t m = 0; m < out.mpad; ++m) {
    uint16_t* row = out.x.get() + m * out.ld;
    const int64_t cols = m < p.m ? p.k : 0;
    std::memcpy(row, p.x + m * p.ldx, sizeof(uint16_t) * cols);
    std::memset(row + cols, 0, sizeof(uint16_t) * (out.ld - cols));
  }
  return out;
}

// A task's B operand, 16 lines (one 32-k step) of 16 weight rows at a time: a group's whole steps in place, its
// ragged last step (the lines after a group's last are the next group's) and 16 rows past the groups (stored as
// rows; zero past N) from buf.
struct BTiles {
  const uint16_t* base[2];
  int64_t whole[2];
  uint16_t* buf[2];
  const uint16_t* at(int v, int64_t s) const { return s < whole[v] ? base[v] + 512 * s : buf[v] + 512 * (s - whole[v]); }
};

BTiles b_tiles(const Problem& p, int64_t n0, int64_t steps, uint16_t* buf) {
  const int64_t pairs = p.k / 2;
  BTiles b{};
  for (int v = 0; v < 2; ++v) {
    const int64_t row0 = n0 + 16 * v;
    b.buf[v] = buf + v * steps * 512;
    const bool grouped = p.grouped(row0);
    b.base[v] = grouped ? p.line(row0, 0) : nullptr;
    b.whole[v] = grouped ? pairs / 16 : 0;
    auto* dst = reinterpret_cast<uint32_t*>(b.buf[v]);
    for (int64_t q = 16 * b.whole[v]; q < 16 * steps; ++q)
      for (int64_t r = 0; r < 16; ++r) {
        uint32_t pair = 0;
        if (q < pairs && row0 + r < p.n)
          std::memcpy(&pair, grouped ? p.line(row0, q) + 2 * r : p.w + (row0 + r) * p.ldw + 2 * q, 4);
        dst[(q - 16 * b.whole[v]) * 16 + r] = pair;
      }
  }
  return b;
}

// A task's 32 weight rows over activation vectors [mv0, mv1), two at a time: 2 x 2 C tiles over all of K (tiles
// 0-3 C, 4-5 A, 6-7 B).
template <typename OutT>
void amx_nt16_task(const Problem& p, const RowsX& x, const GemmTask& t, uint16_t* buf, OutT* y) {
  const int64_t steps = x.ld / 32;
  const BTiles b = b_tiles(p, t.n0, steps, buf);
  alignas(64) float c[4][256];
  for (int64_t mv = t.mv0; mv < t.mv1; mv += 2) {
    const int nb = mv + 1 < t.mv1 ? 2 : 1;
    amx_zero_group();
    const uint16_t* a = x.x.get() + mv * 16 * x.ld;
    for (int64_t s = 0; s < steps; ++s) amx_group_step(a + 32 * s, x.ld * 2, b.at(0, s), b.at(1, s), 64, nb == 2);
    amx_store_group(c, nb == 2);
    for (int v = 0; v < 2 && t.n0 + 16 * v < p.n; ++v) {
      const int64_t n = t.n0 + 16 * v;
      const __mmask16 mask = tail_mask16(p.n - n);
      const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n) : _mm512_setzero_ps();
      for (int j = 0; j < nb; ++j)
        for (int64_t r = 0; r < 16 && (mv + j) * 16 + r < p.m; ++r)
          store_row(y + ((mv + j) * 16 + r) * p.n + n, _mm512_add_ps(_mm512_load_ps(c[2 * j + v] + 16 * r), bias), mask);
    }
  }
}

template <typename OutT>
void linear_amx_nt16(const Problem& p, OutT* y) {
  const RowsX x = pad_rows(p);
  const int64_t mvecs = x.mpad / 16, n_tiles = cdiv(p.n, kAmxTileN);
  const int64_t chunks = l2_chunks(n_tiles, mvecs, at::get_num_threads(), x.ld * 32, 2);
  at::parallel_for(0, n_tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles;
    auto buf = alloc_buffer<uint16_t>(2 * x.ld / 32 * 512);
    for (int64_t i = begin; i < end; ++i)
      amx_nt16_task(p, x, chunk_major_task(i, n_tiles, kAmxTileN, mvecs, chunks), buf.get(), y);
  });
}

#endif  // FP8E_AMX

// Which AVX-512 kernel M picks, measured with every layer's weights from DRAM (benchmarks/linear_stream.py, 2
// threads of a 2-core Zen 5, ms per forward of the default model's 30 layers; docs/cpu-peers.txt): the gemv up to
// 8 rows (10.2 against nt's 13.2 at 8), nt to 64 (at 16 16.7 vs the GEMM's 31.8, at 64 35.1 vs 40.2), the GEMM
// above. Without batch_invariant the wrapper gives torch's GEMM the calls above 32 rows
// (bf16_linear_cpu.kernel_takes). On AMX machines the gemv beats the tiles at 1 row (default model shapes, 1
// core of an Emerald Rapids Xeon: 0.8-0.97x the tiles' time at M = 1, 1.0-1.2x at M = 2). Since nt prefetches
// as it reads and halved its transposes' shuffles (nt_rows, nt_transpose) the gemv keeps 4 rows (2 threads of a
// 2-core Zen 4, best of 9 rounds: the layers at 4 9.91 vs nt's 10.57, at 5 11.75 vs 11.07; the head (49152 x 576)
// at 4 1.87 vs 2.20, at 5 2.45 vs 2.26).
constexpr int64_t kGemvMaxM = 4;
constexpr int64_t kNtMaxM = 64;
constexpr int64_t kSmallMAmx = 1;

template <typename OutT>
void linear_impl(const Problem& p, OutT* out, bool batch_invariant, GemmChoice g) {
  if (g.kernel == Avx512Kernel::kByM && g.amx) {
#ifdef FP8E_AMX
    if (tiles_nt_takes(p)) return linear_tiles_nt(p, out);
    if (p.nt16) return linear_amx_nt16(p, out);
    if (batch_invariant || p.m > kSmallMAmx) return linear_amx(p, out);
#endif
    return linear_small_m(p, out);
  }
  // nt16 weights never take the gemv (it reads rows): nt
  const Avx512Kernel kernel = g.avx512_kernel(p.m, batch_invariant || p.nt16, kGemvMaxM, kNtMaxM);
  if (kernel == Avx512Kernel::kGemv) {
    TORCH_CHECK(!p.nt16, "bf16_linear: the gemv reads weight rows, not nt16 groups");
    return linear_small_m(p, out);
  }
  if (kernel == Avx512Kernel::kNt) return linear_nt(p, out);
  linear_large_m(p, out);
}

// The gemv sums a row's products in another order than the nt kernel and the GEMMs, which give every row the
// same arithmetic whatever M is and wherever the row sits (nt and the AVX-512 GEMM the same bits, see
// linear_common.h): batch_invariant takes nt then the AVX-512 GEMM by M, or AMX tiles for every M (chosen by
// `gemm`, never by M). float32_out: y in float32, the sums not rounded to bf16.
// Rows from which a plain (not batch-invariant) call on an nt16 weight goes to torch's GEMM (oneDNN) with the
// weight taken back to rows into a temporary: with the AVX-512 GEMM a prefill of 128 x 32 tokens took 1.16x as
// long as with oneDNN (the default model in BF16, 2 threads of a Xeon without AMX; 1.05-1.09x with the copies), a
// decode step of 128 rows as long, where the copies (212 MB for the model's BF16 layers) would cost more than
// oneDNN saves.
constexpr int64_t kNt16TorchMinM = 512;

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       bool batch_invariant, bool float32_out, const std::string& gemm, bool nt16) {
  const GemmChoice choice = choose_gemm(gemm, "bf16_linear");
  const Bf16Args a = check_bf16_linear(x, w, bias, float32_out);
  const int64_t m = a.m, k = a.k, n = a.n;
  at::Tensor y = a.y;
  if (m == 0 || n == 0) return y;
  TORCH_CHECK(!nt16 || w.is_contiguous(), "bf16_linear: nt16 weights must be contiguous");
  if (nt16 && !batch_invariant && !float32_out && m >= kNt16TorchMinM && k % 2 == 0 &&
      (!bias || bias->scalar_type() == x.scalar_type())) {
    const int64_t grouped = n / fp8e_layout::kGroup * fp8e_layout::kGroup;  // rows past the groups are rows
    at::Tensor rows = at::empty_like(w);
    fp8e_layout::bf16_groups_to_rows(static_cast<const uint16_t*>(w.data_ptr()),
                                     static_cast<uint16_t*>(rows.data_ptr()), grouped / fp8e_layout::kGroup, k);
    rows.narrow(0, grouped, n - grouped).copy_(w.narrow(0, grouped, n - grouped));
    return at::linear(x, rows, bias);
  }
  const Problem p{m, n, k, static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                  static_cast<const uint16_t*>(w.data_ptr()), w.stride(0),
                  a.bias_f.defined() ? a.bias_f.data_ptr<float>() : nullptr, 1, nt16 && k % 2 == 0};
  if (float32_out) {
    linear_impl(p, y.data_ptr<float>(), batch_invariant, choice);
  } else {
    linear_impl(p, y.data_ptr<at::BFloat16>(), batch_invariant, choice);
  }
  return y;
}

// y [m, N] float32 = sum over t < terms of x[t * m + i] . w: x [terms * m, K] bf16 holds the terms of each
// row in `terms` groups of m rows, m a multiple of 16 (the float32 LM head's exact three-way bf16 split). AMX
// tiles only: per 32-k step the terms' products go into one running float32 sum, in a fixed order that
// depends only on the row (batch invariant).
at::Tensor bf16_linear_terms_f32(const at::Tensor& x, const at::Tensor& w, int64_t terms) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "bf16_linear_terms_f32: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16_linear_terms_f32: x and w must be bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.stride(1) == 1,
              "bf16_linear_terms_f32: x [rows, K] and w [N, K] need unit inner strides");
  TORCH_CHECK(terms >= 1 && x.size(0) % (16 * terms) == 0, "bf16_linear_terms_f32: x's ", x.size(0),
              " rows are not ", terms, " groups of a multiple of 16 rows");
  const int64_t m = x.size(0) / terms, k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && k > 0, "bf16_linear_terms_f32: x has K=", k, " but w is ", w.sizes());
  TORCH_CHECK(amx_allowed(), "bf16_linear_terms_f32 needs AMX tiles (amx_usable())");
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
#ifdef FP8E_AMX
  const Problem p{m, n, k, static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                  static_cast<const uint16_t*>(w.data_ptr()), w.stride(0), nullptr, terms};
  linear_amx(p, y.data_ptr<float>());
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("bf16_linear_terms_f32(Tensor x, Tensor w, int terms) -> Tensor");
  m.impl("bf16_linear_terms_f32", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_terms_f32));
}

#elif defined(FP8E_AVX2_KERNELS)

namespace {

using namespace fp8e;

// The AVX2 kernel for every M (batch_invariant as it stands; `gemm` is validated, there is nothing to choose).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       bool /*batch_invariant*/, bool float32_out, const std::string& gemm, bool nt16) {
  choose_gemm(gemm, "bf16_linear");
  TORCH_CHECK(!nt16, "bf16_linear: nt16 weights need the AVX-512 BF16 kernels");
  const Bf16Args a = check_bf16_linear(x, w, bias, float32_out);
  const int64_t m = a.m, k = a.k, n = a.n;
  at::Tensor y = a.y;
  if (m == 0 || n == 0) return y;
  const int64_t kp = cdiv(k, kAvx2Block) * kAvx2Block;
  auto xf = alloc_buffer<float>(m * kp);  // x in float32, zero past K
  const auto* xb = static_cast<const uint16_t*>(x.data_ptr());
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* dst = xf.get() + r * kp;
      int64_t c = 0;
      for (; c + 8 <= k; c += 8) _mm256_storeu_ps(dst + c, Bf16Weights::load8(xb + r * ldx + c));
      for (; c < k; ++c) dst[c] = static_cast<float>(c10::BFloat16(xb[r * ldx + c], c10::BFloat16::from_bits()));
      std::fill(dst + k, dst + kp, 0.f);
    }
  });
  const auto* wb = static_cast<const uint16_t*>(w.data_ptr());
  const Avx2Operands op{m, n, k, xf.get(), kp, nullptr, 0, a.bias_f.defined() ? a.bias_f.data_ptr<float>() : nullptr};
  auto no_scale = [](int64_t, int64_t) { return 1.f; };
  if (float32_out) {
    avx2_linear<Bf16Weights>(op, wb, w.stride(0), y.data_ptr<float>(), no_scale);
  } else {
    avx2_linear<Bf16Weights>(op, wb, w.stride(0), y.data_ptr<at::BFloat16>(), no_scale);
  }
  return y;
}

}  // namespace

#endif  // FP8E_BF16_KERNELS / FP8E_AVX2_KERNELS

#if defined(FP8E_BF16_KERNELS) || defined(FP8E_AVX2_KERNELS)
TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias, bool batch_invariant=False, bool float32_out=False, "
        "str gemm='auto', bool nt16=False) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
}
#endif
