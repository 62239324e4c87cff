// Paged attention over a block-paged KV cache, and the cache write, for x86 CPUs with AVX-512.
//
// Cache (per layer): k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim] in bf16,
// fp32 or float8_e4m3fn (real value = stored * k_scale / v_scale; the scales only apply to FP8).
// Queries: a varlen batch q [T, num_heads, head_dim]. The exact definition reproduced here is
// fp8engine/model_executor/kernels/attention_ref.py.
//
// Work is split into tiles of (sequence, kv head, up to kTargetRows query rows), where a row is one
// (query token, query head of the GQA group) pair, so every K/V row is read and converted once per
// tile. Each tile makes two passes over its keys in 16-key chunks: scores (K), then e V (V) once the
// row maxima and sums are known; tiles with long contexts in small batches are further split over the
// keys and merged afterwards (split-KV).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

// The AVX-512 kernel needs AVX512-BF16 and VBMI too (its dot-product scores and FP8 P V): AVX-512 CPUs without them
// (Skylake-X, Cascade Lake, Ice Lake) failed to compile it, and so the whole extension; they take the AVX2 kernel
// below, as CPUs without AVX-512 do. Without AVX2 either the ops are not registered and the Python wrappers use
// the torch reference.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "e4m3.h"
#include "vec_math.h"

namespace {

using fp8engine_vec::dispatch_io;
using fp8engine_vec::Tag;
using fp8e::kFp8Max;

// The cache layout both kernels below read and write.
void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] with equal strides");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  const auto t = k_cache.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kFloat8_e4m3fn,
              "KV cache must be float32, bfloat16 or float8_e4m3fn, got ", t);
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3),
              "KV cache rows [num_kv_heads, head_dim] must be contiguous");
  TORCH_CHECK(k_cache.device().is_cpu(), "KV cache must be on the CPU");
}

// Calls f(Tag<T>{}) for the cache's element type T (check_cache has validated it).
template <typename F>
void dispatch_cache(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(Tag<float>{});
    case at::kBFloat16: return f(Tag<at::BFloat16>{});
    default: return f(Tag<at::Float8_e4m3fn>{});
  }
}

// paged_attention's arguments, checked, with the index tensors as contiguous int32 and q with contiguous rows.
struct AttentionArgs {
  at::Tensor q, block_tables, query_start_loc, seq_lens;
  int dim, kv_heads, group;
  bool fp8, full;
};

AttentionArgs check_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                              const at::Tensor& seq_lens, double q_scale, int64_t fixed_partition) {
  TORCH_CHECK(fixed_partition >= 0 && fixed_partition % 16 == 0,
              "fixed_partition must be 0 (adaptive) or a positive multiple of 16, got ", fixed_partition);
  check_cache(k_cache, v_cache);
  const int dim = static_cast<int>(k_cache.size(3)), kv_heads = static_cast<int>(k_cache.size(2));
  TORCH_CHECK(q_in.dim() == 3 && q_in.size(2) == dim && q_in.size(1) % kv_heads == 0,
              "q must be [num_tokens, num_heads, head_dim] with num_heads a multiple of num_kv_heads");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn, full = q_scale > 0;
  TORCH_CHECK(!full || fp8, "full-FP8 attention (q_scale > 0) needs an FP8 KV cache");
  AttentionArgs a{q_in.stride(2) == 1 && q_in.stride(1) == dim ? q_in : q_in.contiguous(),
                  block_tables.to(at::kInt).contiguous(),
                  query_start_loc.to(at::kInt).contiguous(),
                  seq_lens.to(at::kInt).contiguous(),
                  dim,
                  kv_heads,
                  static_cast<int>(q_in.size(1)) / kv_heads,
                  fp8,
                  full};
  TORCH_CHECK(a.seq_lens.dim() == 1 && a.query_start_loc.numel() == a.seq_lens.numel() + 1 &&
                  a.block_tables.dim() == 2 && a.block_tables.size(0) == a.seq_lens.numel(),
              "expected query_start_loc [S + 1], seq_lens [S] and block_tables [S, max_blocks]");
  return a;
}

// Sequence s's query range and blocks: in range of q's num_tokens and the cache's num_blocks.
void check_sequence(const AttentionArgs& a, int s, int64_t num_blocks, int block_size) {
  const int32_t* starts = a.query_start_loc.data_ptr<int32_t>();
  const int tok0 = starts[s], nq = starts[s + 1] - tok0, len = a.seq_lens.data_ptr<int32_t>()[s];
  TORCH_CHECK(tok0 >= 0 && nq >= 0 && starts[s + 1] <= a.q.size(0),
              "query_start_loc must be non-decreasing within [0, num_tokens]");
  TORCH_CHECK(len >= nq, "seq_lens[", s, "] = ", len, " is shorter than its ", nq, " query tokens");
  const int64_t nblocks = (len + block_size - 1) / block_size;
  TORCH_CHECK(nblocks <= a.block_tables.size(1), "block_tables has too few columns for seq_lens[", s, "]");
  const int32_t* ids = a.block_tables.data_ptr<int32_t>() + s * a.block_tables.size(1);
  for (int64_t i = 0; i < nblocks; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block_tables[", s, ", ", i, "] is out of range");
}

// write_kv_cache's arguments, checked: k and v with contiguous rows, the slots as int64 (-1 skips a token).
struct KvWrite {
  at::Tensor k, v, slots;
};

KvWrite check_kv_write(const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == k_in.size(0), "slot_mapping must hold one slot per token");
  const int64_t* slot_data = slots.data_ptr<int64_t>();  // a plain loop: a tensor reduction costs more per call
  TORCH_CHECK(std::all_of(slot_data, slot_data + slots.numel(), [&](int64_t s) { return s < capacity; }),
              "slot_mapping exceeds the cache");
  const auto prepare = [&](const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 3 && x.size(1) == k_cache.size(2) && x.size(2) == k_cache.size(3) &&
                    x.size(0) == slots.numel(),
                "k and v must be [num_tokens, num_kv_heads, head_dim] matching the cache");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "k and v must be float32 or bfloat16");
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  return KvWrite{prepare(k_in), prepare(v_in), slots};
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI__)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

namespace {

using fp8engine_vec::exp512;
using fp8engine_vec::load16;
using fp8engine_vec::store16;
using fp8engine_vec::tail_mask;

constexpr int kLanes = 16;          // fp32 lanes per vector; also the keys per softmax step
constexpr int kTargetRows = 16;     // query rows per tile: amortises the K/V conversion
constexpr int kMinPartition = 512;  // split-KV partitions hold at least this many keys
constexpr int kTargetWorks = 256;   // split long contexts until about this many work items exist
// Each chunk prefetches the next one into L1 and the one kFarChunks after that into L2 (attend): blocks are scattered,
// so the hardware prefetchers cannot run ahead, and a decode tile computes too little per chunk for one chunk's lead
// to cover DRAM's latency (keys from DRAM in scattered blocks, 9/3 heads, d = 64, a bf16 cache: 1 x 4096 keys
// 330 -> 235 us, 32 x 1024 2590-2680 -> 1680-1710; 1 chunk on gained less, 4 or 8 less again).
constexpr int kFarChunks = 2;

inline __m512 splat(float x) { return _mm512_set1_ps(x); }
inline __m512i splat_i(int32_t x) { return _mm512_set1_epi32(x); }
inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------- storage <-> fp32 conversions

// Byte values (one per 32-bit lane) holding E4M3 -> fp32, exactly.
inline __m512 e4m3_to_fp32(__m512i byte) {
  const __m512i mag = _mm512_and_si512(byte, splat_i(0x7F));
  // Rebias the exponent (7 -> 127); subnormals get one more exponent step and lose the implicit
  // 1 by subtracting 2^-6, which avoids fp32 denormal inputs (and so any DAZ setting).
  __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), splat_i(120 << 23));
  const __mmask16 subnormal = _mm512_testn_epi32_mask(mag, splat_i(0x78));
  bits = _mm512_mask_add_epi32(bits, subnormal, bits, splat_i(1 << 23));
  __m512 x = _mm512_castsi512_ps(bits);
  x = _mm512_mask_sub_ps(x, subnormal, x, splat(0x1p-6f));
  x = _mm512_mask_mov_ps(x, _mm512_cmpeq_epi32_mask(mag, splat_i(0x7F)), splat(NAN));  // E4M3 has no inf
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(byte, splat_i(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
}

// fp32 -> E4M3 byte per lane, saturating at +-448, bit-identical to
// x.clamp(-448, 448).to(torch.float8_e4m3fn) (c10's fp8e4m3fn_from_fp32_value, vectorised).
inline __m512i fp32_to_e4m3(__m512 x) {
  // Constants first: min/max return their second operand when one is NaN, so NaN survives.
  x = _mm512_max_ps(splat(-kFp8Max), _mm512_min_ps(splat(kFp8Max), x));
  __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(u, splat_i(INT32_MIN));
  u = _mm512_xor_si512(u, sign);
  // Normal range: round to nearest even on the top 3 mantissa bits while rebiasing the exponent.
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 20), splat_i(1));
  const __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, splat_i(static_cast<int32_t>((uint32_t(7 - 127) << 23) + 0x7FFFF))), odd),
      20);
  // Below 2^-6: adding 2^14 lets the fp32 adder round the value onto the subnormal grid.
  const __m512i magic = splat_i(141 << 23);
  const __m512i subnormal =
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), _mm512_castsi512_ps(magic))), magic);
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(u, splat_i(121 << 23)), normal, subnormal);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(u, splat_i(1087 << 20)), splat_i(0x7F));  // NaN
  return _mm512_or_si512(_mm512_and_si512(r, splat_i(0xFF)), _mm512_srli_epi32(sign, 24));
}

inline __m512 load16(const at::Float8_e4m3fn* p, __mmask16 m) {
  return e4m3_to_fp32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

inline void store16(at::Float8_e4m3fn* p, __m512 x, __mmask16 m) {
  _mm_mask_storeu_epi8(p, m, _mm512_cvtepi32_epi8(fp32_to_e4m3(x)));
}

// Converts `dim` elements to fp32 and zero-pads dst up to `padded` (a multiple of 16), so the
// compute loops below never need tail masks.
template <typename T>
inline void row_to_fp32(const T* src, int dim, int padded, float* dst) {
  for (int c = 0; c < padded; c += kLanes) _mm512_storeu_ps(dst + c, load16(src + c, tail_mask(dim - c)));
}

#if defined(__AVX512VBMI__)
// E4M3 -> fp32 for whole rows, 64 values per step: the bf16 bytes of each code are the top two bytes
// of its fp32 (the low two are always zero), and one byte permute per 16 values spreads them into place.
struct Fp32Spread {
  alignas(64) uint8_t idx[4][64];  // output dword j of step i: lo[16i + j] as byte 2, hi[16i + j] as byte 3
  constexpr Fp32Spread() : idx() {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 16; ++j) {
        idx[i][4 * j + 2] = static_cast<uint8_t>(16 * i + j);
        idx[i][4 * j + 3] = static_cast<uint8_t>(64 + 16 * i + j);
      }
  }
};
constexpr Fp32Spread kFp32Spread;

// 64 E4M3 codes -> four fp32 vectors (codes 16 i .. 16 i + 15 in v[i]), the tables held in registers.
struct E4m3ToFp32 {
  const fp8e::E4m3ToBf16 cvt;
  const __m512i idx[4] = {_mm512_load_si512(kFp32Spread.idx[0]), _mm512_load_si512(kFp32Spread.idx[1]),
                          _mm512_load_si512(kFp32Spread.idx[2]), _mm512_load_si512(kFp32Spread.idx[3])};
  void operator()(__m512i codes, __m512 (&v)[4]) const {
    __m512i hi, lo;
    cvt.bytes(codes, hi, lo);
    for (int i = 0; i < 4; ++i)
      v[i] = _mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(0xCCCCCCCCCCCCCCCCull, lo, idx[i], hi));
  }
};

inline void row_to_fp32(const at::Float8_e4m3fn* src, int dim, int padded, float* dst) {
  const E4m3ToFp32 spread;
  for (int c = 0; c < padded; c += 64) {
    const __mmask64 m = dim - c >= 64 ? ~__mmask64(0) : (__mmask64(1) << (dim - c)) - 1;
    __m512 v[4];
    spread(_mm512_maskz_loadu_epi8(m, src + c), v);
    for (int i = 0; i < 4 && c + i * kLanes < padded; ++i) _mm512_storeu_ps(dst + c + i * kLanes, v[i]);
  }
}
#endif

template <typename T>
inline void rows_to_fp32(const T* src, int64_t stride, int n, int dim, int padded, float* dst) {
  for (int t = 0; t < n; ++t) row_to_fp32(src + t * stride, dim, padded, dst + t * padded);
}

// Rows of the cache into L1 (into L2 with kL2), for the chunks ahead of the one computing (kFarChunks).
template <bool kL2 = false, typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* src, int64_t stride, int n, int dim) {
  const int64_t bytes = int64_t(dim) * sizeof(T);
  for (int t = 0; t < n; ++t)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(src + t * stride) + b, kL2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

template <typename T>
inline void store_row(T* dst, const float* src, float mul, int dim) {
  for (int c = 0; c < dim; c += kLanes)
    store16(dst + c, _mm512_mul_ps(_mm512_loadu_ps(src + c), splat(mul)), tail_mask(dim - c));
}

// ---------------------------------------------------------------- vector math

// Lane t of the result = sum of the lanes of a[t]: 16 dot products finished with 15 adds instead of
// 16 horizontal reductions.
inline __m512 hsum16(const __m512 (&a)[kLanes]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Each 128-bit lane of c[i] now holds partial sums of a[4i..4i+3]; add the four lanes up.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// ---------------------------------------------------------------- attention

struct Problem {
  const void* q;
  void* out;
  at::ScalarType io_dtype;  // q and out
  const void* k;
  const void* v;
  const int32_t* block_tables;
  int heads, group, dim, padded, block_size;
  int64_t q_tok_stride, blk_stride, tok_stride, bt_stride;
  float score_scale;  // multiplies q.k
  float out_scale;    // multiplies sum(p v): v_scale, divided by 448 for FP8 probabilities
  float q_scale;      // > 0: full-FP8 emulation, q quantised to E4M3 with this scale
  bool bf16_queries;  // q is bf16 (or E4M3-quantised): exact in bf16, so scores can use bf16 dot products
  bool full_fp8() const { return q_scale > 0; }
};

struct Tile {
  int seq, kv_head;
  int tok0, nq;  // query tokens [tok0, tok0 + nq) of the flat batch
  int pos0;      // position of token tok0; token tok0 + i sees keys [0, pos0 + i]
  int nparts;    // split-KV partitions
  int64_t partials;  // offset of the partitions' (m, l, acc) in the scratch buffer when nparts > 1
  int keys() const { return pos0 + nq; }
  int rows(int group) const { return nq * group; }
};

struct Work {
  int tile, part, key_begin, key_end;
};

// Storage on 64-byte boundaries: the kernels read and write these buffers a 64-byte vector at a time, and with
// malloc's 16-byte alignment most of those accesses straddle two cache lines (a split access, which also cannot
// take a value straight from the store that wrote it).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using AlignedVec = std::vector<T, Aligned64<T>>;

// Per-thread state of one tile; row r is query token r / group, head r % group of the GQA group.
struct Buffers {
  Buffers(int rows, int padded)
      : q(rows * padded),
        acc(rows * padded),
        kv(kLanes * padded),
        s(rows * kLanes),
        m(rows),
        l(rows),
        out_mul(rows),
        qb(rows * padded),
        kb(kLanes * padded) {}
  AlignedVec<float> q, acc, kv, s, m, l, out_mul;  // out_mul: what store_output multiplies acc by
  AlignedVec<uint16_t> qb, kb;                      // bf16 queries and (converted FP8) keys for the dot-product scores
  AlignedVec<float> saved;                          // every chunk's scores (-inf where not visible), then exp(s - m)
  AlignedVec<float> lane_max;                       // per row, the lane-wise max of its scores
  int chunks = 0;                                   // chunks the scores pass saved
};

// A work item runs two passes over its keys with exp_scores between them: the final max is known
// before any exponential, so no per-chunk reductions or accumulator rescaling (an online softmax
// needs two horizontal reductions and a scalar exp per row and 16-key chunk).
enum class Pass {
  kScores,    // save the masked scores and their lane-wise max
  kProbs,     // accumulate e V with e = exp(s - m) from exp_scores
  kFp8Probs,  // full FP8: quantise P = e / sum, accumulate P V
};

// Scores of rows [r0, rows) against the kLanes keys in kv (rows past the chunk hold stale data and
// are masked by the caller).
template <int kD>
inline void chunk_scores(const Buffers& b, int r0, int rows, int padded, float scale, float* s) {
  const int d = kD ? kD : padded;
  for (int r = r0; r < rows; ++r) {
    __m512 a[kLanes];
    for (auto& x : a) x = _mm512_setzero_ps();
    for (int c = 0; c < d; c += kLanes) {
      const __m512 qv = _mm512_loadu_ps(b.q.data() + r * d + c);
      for (int t = 0; t < kLanes; ++t) a[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(b.kv.data() + t * d + c), a[t]);
    }
    _mm512_storeu_ps(s + r * kLanes, _mm512_mul_ps(hsum16(a), splat(scale)));
  }
}

// Dot-product scores: q and K are both exact in bf16 (E4M3 keys convert exactly), so vdpbf16ps
// forms every product exactly and only the fp32 summation order differs from chunk_scores. Keys
// past the chunk read its last key again and are masked by the caller.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
template <typename CT, int kD>
constexpr bool kDotScores = !std::is_same_v<CT, float> && kD % 64 == 0 && kD > 0;
template <typename CT, int kD>
constexpr bool kDotPv = std::is_same_v<CT, at::Float8_e4m3fn> && kD % 64 == 0 && kD > 0;
#else
template <typename CT, int kD>
constexpr bool kDotScores = false;
template <typename CT, int kD>
constexpr bool kDotPv = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// FP8 keys convert to bf16 in fp8e::E4m3ToBf16's lane order; queries are permuted the same way so the
// pairs line up.
struct LaneOrder {
  alignas(64) uint16_t idx[2][32];
  constexpr LaneOrder() : idx() {
    for (int e = 0; e < 32; ++e) {
      idx[0][e] = static_cast<uint16_t>(16 * (e / 8) + e % 8);
      idx[1][e] = static_cast<uint16_t>(16 * (e / 8) + 8 + e % 8);
    }
  }
};
constexpr LaneOrder kLaneOrder;

// One fp32 row (exact bf16 values) as bf16, in natural or lane order.
inline void pack_query_bf16(const float* q, int d, bool lane_order, uint16_t* dst) {
  for (int c = 0; c < d; c += 64) {
    __m512i v[2];
    for (int h = 0; h < 2; ++h)
      v[h] = reinterpret_cast<__m512i>(
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 32 * h + 16), _mm512_loadu_ps(q + c + 32 * h)));
    for (int h = 0; h < 2; ++h) {
      const __m512i out =
          lane_order ? _mm512_permutex2var_epi16(v[0], _mm512_load_si512(kLaneOrder.idx[h]), v[1]) : v[h];
      _mm512_storeu_si512(dst + c + 32 * h, out);
    }
  }
}

// E4M3 row -> bf16 in lane order (exact).
inline void e4m3_row_to_bf16(const at::Float8_e4m3fn* src, int d, uint16_t* dst) {
  const fp8e::E4m3ToBf16 cvt;
  for (int c = 0; c < d; c += 64) {
    __m512i out0, out1;
    cvt(_mm512_loadu_si512(src + c), out0, out1);
    _mm512_storeu_si512(dst + c, out0);
    _mm512_storeu_si512(dst + c + 32, out1);
  }
}

// Scores of rows [r0, rows) against the n keys at `keys` (bf16 rows `stride` apart).
template <int kD>
inline void chunk_scores_dp(const Buffers& b, const uint16_t* keys, int64_t stride, int n, int r0, int rows,
                            float scale, float* s) {
  constexpr int kV = kD / 32;
  for (int r = r0; r < rows; ++r) {
    __m512bh qv[kV];
    for (int c = 0; c < kV; ++c) qv[c] = as_bh(_mm512_loadu_si512(b.qb.data() + r * kD + 32 * c));
    __m512 a[kLanes];
    for (int t = 0; t < kLanes; ++t) {
      const uint16_t* k = keys + std::min(t, n - 1) * stride;
      a[t] = _mm512_setzero_ps();
      for (int c = 0; c < kV; ++c) a[t] = _mm512_dpbf16_ps(a[t], qv[c], as_bh(_mm512_loadu_si512(k + 32 * c)));
    }
    _mm512_storeu_ps(s + r * kLanes, _mm512_mul_ps(hsum16(a), splat(scale)));
  }
}

// Scores of one chunk of n keys starting at cache element `base`, by bf16 dot products.
template <typename CT, int kD>
inline void key_scores_dp(const Problem& p, const CT* kc, int64_t base, int n, int r0, int rows, Buffers& b) {
  if constexpr (std::is_same_v<CT, at::BFloat16>) {
    chunk_scores_dp<kD>(b, reinterpret_cast<const uint16_t*>(kc + base), p.tok_stride, n, r0, rows, p.score_scale,
                        b.s.data());
  } else {
    for (int t = 0; t < n; ++t) e4m3_row_to_bf16(kc + base + t * p.tok_stride, kD, b.kb.data() + t * kD);
    chunk_scores_dp<kD>(b, b.kb.data(), kD, n, r0, rows, p.score_scale, b.s.data());
  }
}

// Full FP8 P V by bf16 dot products: P and V hold E4M3 values, exact in bf16, so every product is
// exact and only the fp32 summation order differs from chunk_pv. A dot product sums a pair of keys,
// so V is laid out as pairs: for keys (2i, 2i + 1) and each 64 dims, four vectors whose 32-bit lanes
// hold (v[2i][d], v[2i + 1][d]); vector q, 128-bit lane L holds d = 16L + 4q + 0..3 (what unpacking
// bytes then words within lanes produces). The accumulators keep that order until unpermute_pv.
template <int kD>
inline void v_pairs_bf16(const at::Float8_e4m3fn* src, int64_t stride, int n, uint16_t* dst) {
  const fp8e::E4m3ToBf16 cvt;
  for (int t = 0; t < n; t += 2) {
    const at::Float8_e4m3fn* r0 = src + t * stride;
    const at::Float8_e4m3fn* r1 = src + std::min(t + 1, n - 1) * stride;  // an odd tail pairs with P = 0
    for (int c = 0; c < kD; c += 64) {
      __m512i hi0, lo0, hi1, lo1;
      cvt.bytes(_mm512_loadu_si512(r0 + c), hi0, lo0);
      cvt.bytes(_mm512_loadu_si512(r1 + c), hi1, lo1);
      const __m512i a0 = _mm512_unpacklo_epi8(lo0, hi0), a1 = _mm512_unpackhi_epi8(lo0, hi0);
      const __m512i b0 = _mm512_unpacklo_epi8(lo1, hi1), b1 = _mm512_unpackhi_epi8(lo1, hi1);
      uint16_t* out = dst + (t / 2) * 2 * kD + 2 * c;
      _mm512_storeu_si512(out, _mm512_unpacklo_epi16(a0, b0));
      _mm512_storeu_si512(out + 32, _mm512_unpackhi_epi16(a0, b0));
      _mm512_storeu_si512(out + 64, _mm512_unpacklo_epi16(a1, b1));
      _mm512_storeu_si512(out + 96, _mm512_unpackhi_epi16(a1, b1));
    }
  }
}

// acc[r] += sum_t p[r][t] v[t] for rows [r0, rows) over n keys in pairs (see v_pairs_bf16).
template <int kD>
inline void chunk_pv_dp(Buffers& b, int r0, int rows, int n) {
  constexpr int kVecs = kD / kLanes;
  const int pairs = (n + 1) / 2;
  for (int r = r0; r < rows; ++r) {
    alignas(32) uint32_t pp[kLanes / 2];  // P as bf16 pairs (exact: E4M3 values)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp),
                       reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(b.s.data() + r * kLanes))));
    float* accp = b.acc.data() + r * kD;
    __m512 acc[kVecs];
    for (int c = 0; c < kVecs; ++c) acc[c] = _mm512_loadu_ps(accp + c * kLanes);
    for (int i = 0; i < pairs; ++i) {
      const __m512bh pv = as_bh(_mm512_set1_epi32(static_cast<int>(pp[i])));
      for (int c = 0; c < kVecs; ++c)
        acc[c] = _mm512_dpbf16_ps(acc[c], pv, as_bh(_mm512_loadu_si512(b.kb.data() + i * 2 * kD + 32 * c)));
    }
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(accp + c * kLanes, acc[c]);
  }
}

// Accumulators of chunk_pv_dp back to natural order: a 4 x 4 transpose of 128-bit lanes per 64 dims.
template <int kD>
inline void unpermute_pv(Buffers& b, int rows) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < kD; c += 64) {
      float* a = b.acc.data() + r * kD + c;
      __m512 v[4], t[4];
      for (int q = 0; q < 4; ++q) v[q] = _mm512_loadu_ps(a + 16 * q);
      t[0] = _mm512_shuffle_f32x4(v[0], v[1], 0x44);  // lanes 0, 1 of v0, then of v1
      t[1] = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);  // lanes 2, 3
      t[2] = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
      t[3] = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
      _mm512_storeu_ps(a, _mm512_shuffle_f32x4(t[0], t[2], 0x88));       // lane 0 of v0..v3
      _mm512_storeu_ps(a + 16, _mm512_shuffle_f32x4(t[0], t[2], 0xDD));  // lane 1
      _mm512_storeu_ps(a + 32, _mm512_shuffle_f32x4(t[1], t[3], 0x88));  // lane 2
      _mm512_storeu_ps(a + 48, _mm512_shuffle_f32x4(t[1], t[3], 0xDD));  // lane 3
    }
}
#endif

// Row r's chunk scores in place: the scores pass masks keys the row does not see (-inf) and keeps the
// lane-wise max; full FP8 turns e = exp(s - m) into quantised probabilities (kProbs uses e as it is).
inline void softmax_step(Pass pass, __mmask16 visible, int r, Buffers& b) {
  float* s = b.s.data() + r * kLanes;
  const __m512 x = _mm512_loadu_ps(s);
  if (pass == Pass::kFp8Probs) {
    // Same rounding steps as the reference: softmax = e * (1 / sum), then E4M3(P * 448). Keys the row
    // does not see hold e = 0.
    const __m512 p = _mm512_mul_ps(_mm512_mul_ps(x, splat(b.l[r])), splat(kFp8Max));
    _mm512_storeu_ps(s, fp8e::e4m3_round_ps(p));  // = e4m3_to_fp32(fp32_to_e4m3(p)) for p in [0, 448]
  } else if (pass == Pass::kScores) {
    const __m512 masked = _mm512_mask_mov_ps(splat(-INFINITY), visible, x);
    _mm512_storeu_ps(s, masked);
    float* mx = b.lane_max.data() + r * kLanes;
    _mm512_storeu_ps(mx, _mm512_max_ps(masked, _mm512_loadu_ps(mx)));
  }
}

// acc[r] += sum_t p[r][t] * v[t] for kRows rows from r, accumulators in registers so that each V
// vector is loaded once per kRows rows.
template <int kD, int kRows>
inline void pv_rows(Buffers& b, int r, int n) {
  constexpr int kVecs = kD / kLanes;
  __m512 acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < kVecs; ++c)
      acc[i][c] = _mm512_loadu_ps(b.acc.data() + (r + i) * kD + c * kLanes);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < kVecs; ++c) {
      const __m512 v = _mm512_loadu_ps(b.kv.data() + t * kD + c * kLanes);
      for (int i = 0; i < kRows; ++i) acc[i][c] = _mm512_fmadd_ps(splat(b.s[(r + i) * kLanes + t]), v, acc[i][c]);
    }
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(b.acc.data() + (r + i) * kD + c * kLanes, acc[i][c]);
}

// pv_rows for k <= kRows rows, with k known only at run time.
template <int kD, int kRows>
inline void pv_block(Buffers& b, int r, int k, int n) {
  if constexpr (kRows > 1) {
    if (k < kRows) return pv_block<kD, kRows - 1>(b, r, k, n);
  }
  pv_rows<kD, kRows>(b, r, n);
}

// The V rows of a chunk as fp32, 64 dims at a time, in registers: what rows_to_fp32 stores for pv_rows to read.
template <typename CT>
struct VRows;
template <>
struct VRows<at::Float8_e4m3fn> {
  const E4m3ToFp32 spread;
  void operator()(const at::Float8_e4m3fn* row, __m512 (&v)[4]) const { spread(_mm512_loadu_si512(row), v); }
};
template <typename T>
struct VRows {
  void operator()(const T* row, __m512 (&v)[4]) const {
    for (int i = 0; i < 4; ++i) v[i] = load16(row + i * kLanes, __mmask16(0xFFFF));
  }
};

// pv_rows straight from the cache for kRows <= 256 / kD rows (a decode tile's GQA group): each V row is converted
// in registers and used there, where the general path stores the chunk's rows as fp32 and reads every vector back
// once per row. The same products in the same order (the same bits).
template <typename CT, int kD, int kRows>
inline void pv_rows_direct(Buffers& b, int r, const CT* v, int64_t stride, int n) {
  constexpr int kVecs = kD / kLanes;
  const VRows<CT> rows_of;
  __m512 acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < kVecs; ++c) acc[i][c] = _mm512_load_ps(b.acc.data() + (r + i) * kD + c * kLanes);
  for (int t = 0; t < n; ++t)
    for (int c4 = 0; c4 < kVecs; c4 += 4) {
      __m512 x[4];
      rows_of(v + t * stride + c4 * kLanes, x);
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < kRows; ++i)
          acc[i][c4 + c] = _mm512_fmadd_ps(splat(b.s[(r + i) * kLanes + t]), x[c], acc[i][c4 + c]);
    }
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < kVecs; ++c) _mm512_store_ps(b.acc.data() + (r + i) * kD + c * kLanes, acc[i][c]);
}

template <typename CT, int kD, int kRows>
inline void pv_direct(Buffers& b, int r, int k, const CT* v, int64_t stride, int n) {
  if constexpr (kRows > 1) {
    if (k < kRows) return pv_direct<CT, kD, kRows - 1>(b, r, k, v, stride, n);
  }
  pv_rows_direct<CT, kD, kRows>(b, r, v, stride, n);
}

template <int kD>
inline void chunk_pv(Buffers& b, int r0, int rows, int n, int padded) {
  if constexpr (kD == 0) {  // generic head dim: accumulators stay in memory
    for (int r = r0; r < rows; ++r) {
      const float* p = b.s.data() + r * kLanes;
      float* acc = b.acc.data() + r * padded;
      for (int c = 0; c < padded; c += kLanes) {
        __m512 a = _mm512_loadu_ps(acc + c);
        for (int t = 0; t < n; ++t) a = _mm512_fmadd_ps(splat(p[t]), _mm512_loadu_ps(b.kv.data() + t * padded + c), a);
        _mm512_storeu_ps(acc + c, a);
      }
    }
  } else {
    constexpr int kBlock = 256 / kD;  // 16 accumulator registers per block of rows
    for (int r = r0; r < rows; r += kBlock) pv_block<kD, kBlock>(b, r, std::min(rows - r, kBlock), n);
  }
}

// Scores of rows [r0, rows) against the n keys at cache element `base`, into b.s.
template <typename CT, int kD>
void key_scores(const Problem& p, const CT* kc, int64_t base, int n, int r0, int rows, Buffers& b) {
  if constexpr (kDotScores<CT, kD>) {
    if (p.bf16_queries) return key_scores_dp<CT, kD>(p, kc, base, n, r0, rows, b);
  }
  rows_to_fp32(kc + base, p.tok_stride, n, kD ? kD : p.dim, kD ? kD : p.padded, b.kv.data());
  chunk_scores<kD>(b, r0, rows, kD ? kD : p.padded, p.score_scale, b.s.data());
}

// The rows of keys [j, j + 16) (to the end of j's block) that a pass reads, K for the scores and V for the
// products, prefetched into L1 (into L2 with kL2); nothing from ke on. Always inlined: GCC takes a function that only
// prefetches for one without effects and deletes the calls to it (it did so to this one, not inlined into attend).
template <bool kL2, typename CT>
__attribute__((always_inline)) inline void prefetch_keys(const Problem& p, const CT* kc, const CT* vc,
                                                        const int32_t* blocks, int64_t head, int dim, Pass pass, int j,
                                                        int ke) {
  if (j >= ke) return;
  const int off = j % p.block_size, n = std::min({kLanes, p.block_size - off, ke - j});
  const int64_t at = blocks[j / p.block_size] * p.blk_stride + off * p.tok_stride + head;
  if (pass != Pass::kFp8Probs) prefetch_rows<kL2>(kc + at, p.tok_stride, n, dim);
  if (pass != Pass::kScores) prefetch_rows<kL2>(vc + at, p.tok_stride, n, dim);
}

// One pass of tile t over keys [kb, ke), reading the paged cache in place: the scores pass reads K,
// the probabilities pass V and what exp_scores made of the first's scores (b.saved, sized by the
// caller).
template <typename CT, int kD>
void attend(const Problem& p, const Tile& t, int kb, int ke, Pass pass, Buffers& b) {
  const int d = kD ? kD : p.padded, dim = kD ? kD : p.dim;  // constants let the masks fold away
  const int rows = t.rows(p.group);
  const auto* kc = static_cast<const CT*>(p.k);
  const auto* vc = static_cast<const CT*>(p.v);
  const int32_t* blocks = p.block_tables + t.seq * p.bt_stride;
  const int64_t head = int64_t(t.kv_head) * dim;
  for (int c = 0; c <= kFarChunks; ++c) prefetch_keys<true>(p, kc, vc, blocks, head, dim, pass, kb + c * kLanes, ke);
  int chunk = 0;
  for (int j0 = kb; j0 < ke;) {
    const int off = j0 % p.block_size;
    const int n = std::min({kLanes, p.block_size - off, ke - j0});
    const int64_t base = blocks[j0 / p.block_size] * p.blk_stride + off * p.tok_stride + head;
    prefetch_keys<false>(p, kc, vc, blocks, head, dim, pass, j0 + n, ke);
    prefetch_keys<true>(p, kc, vc, blocks, head, dim, pass, j0 + n + kFarChunks * kLanes, ke);
    // Rows are token-major, so the rows that can see key j0 (and maybe later ones) are a suffix.
    const int r0 = std::max(0, j0 - t.pos0) * p.group;
    const int64_t saved = int64_t(chunk++) * rows * kLanes;  // this chunk's scores in b.saved
    if (pass != Pass::kScores) {
      std::copy_n(b.saved.data() + saved, rows * kLanes, b.s.data());  // exp_scores's exp(s - m)
    } else {
      key_scores<CT, kD>(p, kc, base, n, r0, rows, b);
    }
    if (pass != Pass::kProbs)
      for (int r = r0; r < rows; ++r) softmax_step(pass, tail_mask(std::min(n, t.pos0 + r / p.group - j0 + 1)), r, b);
    if (pass == Pass::kScores) {
      std::fill_n(b.s.data(), r0 * kLanes, -INFINITY);  // rows that see no key of this chunk
      std::copy_n(b.s.data(), rows * kLanes, b.saved.data() + saved);
    } else {
      if constexpr (kDotPv<CT, kD>) {
        if (pass == Pass::kFp8Probs) {
          v_pairs_bf16<kD>(vc + base, p.tok_stride, n, b.kb.data());
          chunk_pv_dp<kD>(b, r0, rows, n);
          j0 += n;
          continue;
        }
      }
      if constexpr (kD % 64 == 0 && kD > 0) {
        if (rows - r0 <= 256 / kD) {
          pv_direct<CT, kD, 256 / kD>(b, r0, rows - r0, vc + base, p.tok_stride, n);
          j0 += n;
          continue;
        }
      }
      rows_to_fp32(vc + base, p.tok_stride, n, dim, d, b.kv.data());
      chunk_pv<kD>(b, r0, rows, n, d);
    }
    j0 += n;
  }
  b.chunks = chunk;
}

// Between the passes: per row m = max of the saved scores, the saved scores become e = exp(s - m) (0
// where not visible) and l = sum(e). Lane-wise maxima and sums leave one reduction per row for the
// whole work item. A row that sees no key (of a split-KV partition) keeps m = -inf and l = 0.
void exp_scores(int rows, Buffers& b) {
  for (int r = 0; r < rows; ++r) b.m[r] = _mm512_reduce_max_ps(_mm512_loadu_ps(b.lane_max.data() + r * kLanes));
  float* sums = b.lane_max.data();  // the maxima are reduced: their buffer holds the lane-wise sums now
  std::fill_n(sums, rows * kLanes, 0.f);
  for (int c = 0; c < b.chunks; ++c)
    for (int r = 0; r < rows; ++r) {
      float* s = b.saved.data() + (int64_t(c) * rows + r) * kLanes;
      const __m512 x = _mm512_loadu_ps(s);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, splat(-INFINITY), _CMP_NEQ_UQ),
                                           exp512(_mm512_sub_ps(x, splat(b.m[r]))));
      _mm512_storeu_ps(s, e);
      _mm512_storeu_ps(sums + r * kLanes, _mm512_add_ps(_mm512_loadu_ps(sums + r * kLanes), e));
    }
  for (int r = 0; r < rows; ++r) b.l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + r * kLanes));
}

// The real head dims get fully unrolled loops; anything else runs the padded generic path (0).
template <typename F>
void dispatch_dim(int dim, F&& f) {
  if (dim == 64) {
    f(std::integral_constant<int, 64>{});
  } else if (dim == 128) {
    f(std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, 0>{});
  }
}

template <typename T>
void load_queries(const Problem& p, const Tile& t, Buffers& b) {
  const int d = p.padded;
  for (int r = 0; r < t.rows(p.group); ++r) {
    const auto* src = static_cast<const T*>(p.q) + (t.tok0 + r / p.group) * p.q_tok_stride +
                      (int64_t(t.kv_head) * p.group + r % p.group) * p.dim;
    float* dst = b.q.data() + r * d;
    row_to_fp32(src, p.dim, d, dst);
    if (!p.full_fp8()) continue;
    for (int c = 0; c < d; c += kLanes) {  // E4M3(clamp(q / q_scale)), as in the reference
      const __m512 x = _mm512_div_ps(_mm512_loadu_ps(dst + c), splat(p.q_scale));
      _mm512_storeu_ps(dst + c, e4m3_to_fp32(fp32_to_e4m3(x)));
    }
  }
}

// out[row] = acc[row] * mul[row] in the output dtype.
void store_output(const Problem& p, const Tile& t, const float* acc, const float* mul) {
  dispatch_io(p.io_dtype, [&](auto io) {
    using T = typename decltype(io)::type;
    for (int r = 0; r < t.rows(p.group); ++r) {
      T* dst = static_cast<T*>(p.out) + (int64_t(t.tok0) + r / p.group) * p.heads * p.dim +
               (int64_t(t.kv_head) * p.group + r % p.group) * p.dim;
      store_row(dst, acc + r * p.padded, mul[r], p.dim);
    }
  });
}

// Split-KV partials of one partition: m[rows], l[rows], acc[rows][padded].
inline float* partial(const Problem& p, const Tile& t, int part, float* scratch) {
  return scratch + t.partials + int64_t(part) * t.rows(p.group) * (p.padded + 2);
}

template <typename CT, int kD>
void run_work(const Problem& p, const Tile& t, const Work& w, float* scratch, Buffers& b) {
  const int rows = t.rows(p.group);
  dispatch_io(p.io_dtype, [&](auto io) { load_queries<typename decltype(io)::type>(p, t, b); });
  if constexpr (kDotScores<CT, kD>) {
    if (p.bf16_queries)
      for (int r = 0; r < rows; ++r)
        pack_query_bf16(b.q.data() + r * kD, kD, !std::is_same_v<CT, at::BFloat16>, b.qb.data() + r * kD);
  }
  std::fill_n(b.acc.begin(), rows * p.padded, 0.f);
  // A chunk ends after 16 keys, at a block boundary or at the last key.
  const size_t keys = w.key_end - w.key_begin, chunks = keys / kLanes + keys / p.block_size + 2;
  if (b.saved.size() < chunks * rows * kLanes) b.saved.resize(chunks * rows * kLanes);
  if (b.lane_max.size() < size_t(rows) * kLanes) b.lane_max.resize(size_t(rows) * kLanes);
  std::fill_n(b.lane_max.begin(), rows * kLanes, -INFINITY);
  attend<CT, kD>(p, t, w.key_begin, w.key_end, Pass::kScores, b);
  exp_scores(rows, b);
  if (p.full_fp8()) {
    // Quantising P needs the final sum too (full-FP8 tiles are never split, so the passes see every key).
    for (int r = 0; r < rows; ++r) b.l[r] = 1.f / b.l[r];
    attend<CT, kD>(p, t, w.key_begin, w.key_end, Pass::kFp8Probs, b);
    if constexpr (kDotPv<CT, kD>) unpermute_pv<kD>(b, rows);
    std::fill_n(b.out_mul.begin(), rows, p.out_scale);
    store_output(p, t, b.acc.data(), b.out_mul.data());
    return;
  }
  attend<CT, kD>(p, t, w.key_begin, w.key_end, Pass::kProbs, b);
  if (t.nparts == 1) {
    for (int r = 0; r < rows; ++r) b.out_mul[r] = p.out_scale / b.l[r];
    store_output(p, t, b.acc.data(), b.out_mul.data());
    return;
  }
  float* dst = partial(p, t, w.part, scratch);
  std::copy_n(b.m.begin(), rows, dst);
  std::copy_n(b.l.begin(), rows, dst + rows);
  std::copy_n(b.acc.begin(), rows * p.padded, dst + 2 * rows);
}

// Combines a split tile's partitions (rows that saw no key of a partition have m = -inf there).
void merge_partials(const Problem& p, const Tile& t, float* scratch, Buffers& b) {
  const int rows = t.rows(p.group), d = p.padded;
  for (int r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < t.nparts; ++k) m = std::max(m, partial(p, t, k, scratch)[r]);
    float l = 0.f;
    float* acc = b.acc.data() + r * d;
    std::fill_n(acc, d, 0.f);
    for (int k = 0; k < t.nparts; ++k) {
      const float* src = partial(p, t, k, scratch);
      const float w = std::exp(src[r] - m);
      l += w * src[rows + r];
      for (int c = 0; c < d; c += kLanes)
        _mm512_storeu_ps(acc + c, _mm512_fmadd_ps(splat(w), _mm512_loadu_ps(src + 2 * rows + r * d + c),
                                                  _mm512_loadu_ps(acc + c)));
    }
    b.out_mul[r] = p.out_scale / l;
  }
  store_output(p, t, b.acc.data(), b.out_mul.data());
}

// Runs f(i, buffers) for i in [0, n) on torch's intra-op threads, handing out items one at a time
// because their costs differ by orders of magnitude (decode vs. long prefill tiles).
template <typename F>
void parallel_dynamic(size_t n, int rows, int padded, F&& f) {
  std::atomic<size_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(n));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Buffers b(rows, padded);
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i, b);
  });
}

std::vector<Tile> plan_tiles(const AttentionArgs& a, int64_t num_blocks, int block_size) {
  const int32_t* starts = a.query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = a.seq_lens.data_ptr<int32_t>();
  const int per_tile = std::max(1, kTargetRows / a.group);
  std::vector<Tile> tiles;
  for (int s = 0; s < a.seq_lens.size(0); ++s) {
    check_sequence(a, s, num_blocks, block_size);
    const int tok0 = starts[s], nq = starts[s + 1] - tok0, len = lens[s];
    for (int g = 0; g < a.kv_heads; ++g)
      for (int i = 0; i < nq; i += per_tile)
        tiles.push_back(Tile{s, g, tok0 + i, std::min(per_tile, nq - i), len - nq + i, 1, -1});
  }
  return tiles;
}

// Splits the keys of every tile longer than max(kMinPartition, total keys / kTargetWorks) into
// partitions of that length, so a few long sequences still keep every thread busy (and the split
// never depends on the thread count), and returns the work items largest first.
//
// fixed_partition > 0 (batch invariance) splits at that many keys whatever the batch. A query row's
// result then depends only on its own keys: its chunks start at the same keys in a prefill tile and
// alone, keys it does not see add exact zeros (e = 0, p = 0), and a partition past its last key merges
// with weight exp(-inf) = 0 while a lone partition merges with weight exp(0) = 1.
std::vector<Work> plan_works(std::vector<Tile>& tiles, const Problem& p, int64_t fixed_partition,
                             int64_t& scratch_size) {
  int64_t part = std::numeric_limits<int>::max();
  if (!p.full_fp8() && fixed_partition > 0) {
    part = fixed_partition;
  } else if (!p.full_fp8()) {
    int64_t keys = 0;
    for (const Tile& t : tiles) keys += t.keys();
    part = std::max<int64_t>(kMinPartition, (keys + kTargetWorks * kLanes - 1) / (kTargetWorks * kLanes) * kLanes);
  }
  std::vector<Work> works;
  scratch_size = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    Tile& t = tiles[i];
    t.nparts = static_cast<int>((t.keys() + part - 1) / part);
    if (t.nparts > 1) {
      t.partials = scratch_size;
      scratch_size += int64_t(t.nparts) * t.rows(p.group) * (p.padded + 2);
    }
    for (int k = 0; k < t.nparts; ++k)
      works.push_back(Work{static_cast<int>(i), k, static_cast<int>(k * part),
                           static_cast<int>(std::min<int64_t>(t.keys(), (k + 1) * part))});
  }
  const auto cost = [&](const Work& w) { return int64_t(w.key_end - w.key_begin) * tiles[w.tile].rows(p.group); };
  std::stable_sort(works.begin(), works.end(), [&](const Work& a, const Work& b) { return cost(a) > cost(b); });
  return works;
}


at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& query_start_loc_in,
                           const at::Tensor& seq_lens_in, double scale, double k_scale, double v_scale,
                           double q_scale, int64_t fixed_partition) {
  const AttentionArgs a = check_attention(q_in, k_cache, v_cache, block_tables_in, query_start_loc_in, seq_lens_in,
                                          q_scale, fixed_partition);
  const at::Tensor& q = a.q;
  const int dim = a.dim, group = a.group;
  // Tokens outside every sequence's query range stay zero.
  at::Tensor out = at::zeros({q.size(0), q.size(1), dim}, q.options());

  const bool full = a.full;
  const double ks = a.fp8 ? k_scale : 1.0, vs = a.fp8 ? v_scale : 1.0;
  const Problem p{q.data_ptr(), out.data_ptr(), q.scalar_type(), k_cache.data_ptr(), v_cache.data_ptr(),
                  a.block_tables.data_ptr<int32_t>(), static_cast<int>(q.size(1)), group, dim, round_up(dim, kLanes),
                  static_cast<int>(k_cache.size(1)), q.stride(0), k_cache.stride(0), k_cache.stride(1),
                  a.block_tables.size(1), static_cast<float>(full ? q_scale * ks * scale : ks * scale),
                  static_cast<float>(full ? vs / kFp8Max : vs), static_cast<float>(full ? q_scale : 0.0),
                  full || q.scalar_type() == at::kBFloat16};

  std::vector<Tile> tiles = plan_tiles(a, k_cache.size(0), p.block_size);
  int64_t scratch_size = 0;
  const std::vector<Work> works = plan_works(tiles, p, fixed_partition, scratch_size);
  std::vector<float> scratch(scratch_size);
  const int max_rows = std::max(1, kTargetRows / group) * group;
  dispatch_cache(k_cache.scalar_type(), [&](auto ct) {
    dispatch_dim(dim, [&](auto kd) {
      using CT = typename decltype(ct)::type;
      parallel_dynamic(works.size(), max_rows, p.padded, [&](size_t i, Buffers& b) {
        run_work<CT, decltype(kd)::value>(p, tiles[works[i].tile], works[i], scratch.data(), b);
      });
    });
  });
  std::vector<int> split;
  for (size_t i = 0; i < tiles.size(); ++i)
    if (tiles[i].nparts > 1) split.push_back(static_cast<int>(i));
  parallel_dynamic(split.size(), max_rows, p.padded,
                   [&](size_t i, Buffers& b) { merge_partials(p, tiles[split[i]], scratch.data(), b); });
  return out;
}

// ---------------------------------------------------------------- cache write

template <typename ST, typename CT>
void write_rows(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots, float scale) {
  const int64_t width = src.size(1) * src.size(2), block_size = cache.size(1);
  const ST* s = src.data_ptr<ST>();
  CT* c = cache.data_ptr<CT>();
  at::parallel_for(0, src.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token
      CT* dst = c + slots[t] / block_size * cache.stride(0) + slots[t] % block_size * cache.stride(1);
      for (int64_t i = 0; i < width; i += kLanes) {
        const __mmask16 m = tail_mask(static_cast<int>(width - i));
        __m512 x = load16(s + t * src.stride(0) + i, m);
        if constexpr (std::is_same_v<CT, at::Float8_e4m3fn>) x = _mm512_div_ps(x, splat(scale));
        store16(dst + i, x, m);
      }
    }
  });
}

}  // namespace

#define FP8E_ATTENTION_KERNELS

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2 + FMA (CPUs without AVX-512: AMD Zen 2-3, Intel before Skylake-X). Each query row makes one pass over
// its own keys, whatever else is in the batch and however the context could be split: batch invariant for
// every fixed_partition (which is validated and has nothing to split). A work item is one (query token, kv
// head): its GQA group's query heads share each K and V row, converted to float32 kChunkKeys rows at a time.
// Scores: 8 lanes along head_dim reduced in one fixed tree, times the score scale; the softmax with its final
// max known (the scores are saved, then exponentiated on 8 lanes); P V accumulated key after key in registers,
// then scaled once. The cache write rounds element by element as the reference does.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear_common.h"

namespace {

// dim values of a cache or query row as float32, zero up to `padded` (a multiple of 8).
inline void row_f32(const float* src, int dim, int padded, float* dst) {
  std::copy(src, src + dim, dst);
  std::fill(dst + dim, dst + padded, 0.f);
}
inline void row_f32(const at::BFloat16* src, int dim, int padded, float* dst) {
  const auto* u = reinterpret_cast<const uint16_t*>(src);
  int d = 0;
  for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(dst + d, fp8e::Bf16Weights::load8(u + d));
  for (; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
  std::fill(dst + dim, dst + padded, 0.f);
}
// E4M3 codes through half precision as the linears convert them (linear_common.h), but the NaN codes 0x7F / 0xFF
// (a cache may hold what a NaN wrote) made half NaNs first.
inline __m256 e4m3x8_to_f32_nan(const uint8_t* p) {
  const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h = _mm_and_si128(_mm_slli_epi16(v, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7E00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
inline void row_f32(const at::Float8_e4m3fn* src, int dim, int padded, float* dst) {
  const auto* u = reinterpret_cast<const uint8_t*>(src);
  int d = 0;
  for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(dst + d, e4m3x8_to_f32_nan(u + d));
  for (; d < dim; ++d) dst[d] = fp8e::e4m3_value(u[d]);
  std::fill(dst + dim, dst + padded, 0.f);
}

inline float dot_fixed(const float* a, const float* b, int padded) {
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < padded; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return fp8e::hsum_fixed(acc);
}

// s[j] = exp(s[j] - mx) for j < n, 8 at a time (vec_math.h's exp256; a NaN stays NaN, which exp256's clamp
// alone would not keep).
inline void exp_shifted(float* s, int n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), m);
    _mm256_storeu_ps(s + j, _mm256_blendv_ps(fp8engine_vec::exp256(x), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  if (j < n) {
    alignas(32) float t[8] = {};
    std::copy(s + j, s + n, t);
    exp_shifted(t, 8, mx);
    std::copy(t, t + (n - j), s + j);
  }
}

using fp8e::e4m3_round;

struct Problem {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int32_t* block_tables;
  int heads, group, dim, padded, block_size;
  int64_t blk_stride, tok_stride, bt_stride;
  float score_scale;  // multiplies q.k
  float out_scale;    // multiplies sum(p v): v_scale, divided by 448 for FP8 probabilities
  float q_scale;      // > 0: full-FP8 emulation, q quantised to E4M3 with this scale
};

struct Item {
  int seq, token, pos, kv_head;  // the query token (flat index) at position pos of sequence seq
};

constexpr int kChunkKeys = 64;  // K or V rows converted to float32 at a time: 16 KB at head_dim 64, in L1

// Scores of query row qr against n converted key rows kb (pd apart): each a dot_fixed (one accumulator along
// head_dim, the same order), four keys at a time so that four chains overlap.
inline void chunk_scores(const float* qr, const float* kb, int n, int pd, float scale, float* out) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k0 = kb + j * pd;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < pd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(qr + d);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + pd + d), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * pd + d), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * pd + d), a3);
    }
    _mm_storeu_ps(out + j, _mm_mul_ps(fp8e::hsum4_fixed(a0, a1, a2, a3), _mm_set1_ps(scale)));
  }
  for (; j < n; ++j) out[j] = dot_fixed(qr, kb + j * pd, pd) * scale;
}

// acc[0, 8 NV) += w[j] * vb[j] for j < n in key order, the NV vectors held in registers.
template <int NV>
inline void pv_columns(const float* w, const float* vb, int n, int pd, float* acc) {
  __m256 a[NV];
  for (int v = 0; v < NV; ++v) a[v] = _mm256_loadu_ps(acc + 8 * v);
  for (int j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vb + j * pd + 8 * v), a[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + 8 * v, a[v]);
}

// acc[0, pd) += w[j] * vb[j] for j < n in key order (per element the same FMAs as one key at a time): 64 columns
// at a time, then 8.
inline void chunk_pv(const float* w, const float* vb, int n, int pd, float* acc) {
  int d = 0;
  for (; d + 64 <= pd; d += 64) pv_columns<8>(w, vb + d, n, pd, acc + d);
  for (; d < pd; d += 8) pv_columns<1>(w, vb + d, n, pd, acc + d);
}

template <typename CT, typename IO>
void attend(const Problem& p, const Item& it, std::vector<float>& buf) {
  const int keys = it.pos + 1, g = p.group, pd = p.padded;
  buf.resize(static_cast<size_t>(g) * (keys + 2 * pd) + static_cast<size_t>(kChunkKeys) * pd);
  float* q = buf.data();        // [g][pd]
  float* acc = q + g * pd;      // [g][pd]
  float* kv = acc + g * pd;     // [kChunkKeys][pd]: converted K or V rows
  float* sc = kv + kChunkKeys * pd;  // [g][keys]: scores, then exp(s - max) or the FP8 probabilities
  const IO* qrow = static_cast<const IO*>(p.q) + (static_cast<int64_t>(it.token) * p.heads + it.kv_head * g) * p.dim;
  for (int r = 0; r < g; ++r) {
    row_f32(qrow + r * p.dim, p.dim, pd, q + r * pd);
    if (p.q_scale > 0)
      for (int d = 0; d < p.dim; ++d) q[r * pd + d] = e4m3_round(q[r * pd + d] / p.q_scale);
  }
  const int32_t* ids = p.block_tables + it.seq * p.bt_stride;
  auto row = [&](const void* cache, int j) {
    return static_cast<const CT*>(cache) + ids[j / p.block_size] * p.blk_stride + (j % p.block_size) * p.tok_stride +
           static_cast<int64_t>(it.kv_head) * p.dim;
  };
  const int row_bytes = p.dim * static_cast<int>(sizeof(CT));
  auto convert = [&](const void* cache, int j0, int n) {
    for (int j = 0; j < n; ++j)  // every row's lines in flight at once: the rows are scattered over blocks
      for (int b = 0; b < row_bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row(cache, j0 + j)) + b, _MM_HINT_T0);
    for (int j = 0; j < n; ++j) row_f32(row(cache, j0 + j), p.dim, pd, kv + j * pd);
  };
  for (int j0 = 0; j0 < keys; j0 += kChunkKeys) {
    const int n = std::min(kChunkKeys, keys - j0);
    convert(p.k, j0, n);
    for (int r = 0; r < g; ++r) chunk_scores(q + r * pd, kv, n, pd, p.score_scale, sc + r * keys + j0);
  }
  std::vector<float> mul(g);
  for (int r = 0; r < g; ++r) {
    float* s = sc + r * keys;
    const float mx = *std::max_element(s, s + keys);
    exp_shifted(s, keys, mx);
    float l = 0.f;
    for (int j = 0; j < keys; ++j) l += s[j];
    if (p.q_scale > 0) {
      for (int j = 0; j < keys; ++j) s[j] = e4m3_round(s[j] / l * kFp8Max);
      mul[r] = p.out_scale;
    } else {
      mul[r] = p.out_scale / l;
    }
  }
  std::fill(acc, acc + g * pd, 0.f);
  for (int j0 = 0; j0 < keys; j0 += kChunkKeys) {
    const int n = std::min(kChunkKeys, keys - j0);
    convert(p.v, j0, n);
    for (int r = 0; r < g; ++r) chunk_pv(sc + r * keys + j0, kv, n, pd, acc + r * pd);
  }
  IO* orow = static_cast<IO*>(p.out) + (static_cast<int64_t>(it.token) * p.heads + it.kv_head * g) * p.dim;
  for (int r = 0; r < g; ++r)
    for (int d = 0; d < p.dim; ++d) orow[r * p.dim + d] = static_cast<IO>(acc[r * pd + d] * mul[r]);
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& query_start_loc_in,
                           const at::Tensor& seq_lens_in, double scale, double k_scale, double v_scale,
                           double q_scale, int64_t fixed_partition) {
  const AttentionArgs a = check_attention(q_in, k_cache, v_cache, block_tables_in, query_start_loc_in, seq_lens_in,
                                          q_scale, fixed_partition);
  const at::Tensor q = a.q.contiguous();
  const int dim = a.dim, block_size = static_cast<int>(k_cache.size(1));
  const bool fp8 = a.fp8, full = a.full;
  at::Tensor out = at::zeros({q.size(0), q.size(1), dim}, q.options());  // tokens outside every sequence stay 0
  const int32_t* starts = a.query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = a.seq_lens.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int s = 0; s < a.seq_lens.size(0); ++s) {
    check_sequence(a, s, k_cache.size(0), block_size);
    const int tok0 = starts[s], nq = starts[s + 1] - tok0, len = lens[s];
    for (int i = 0; i < nq; ++i)
      for (int g = 0; g < a.kv_heads; ++g) items.push_back(Item{s, tok0 + i, len - nq + i, g});
  }
  const double ks = fp8 ? k_scale : 1.0, vs = fp8 ? v_scale : 1.0;
  const Problem p{q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                  a.block_tables.data_ptr<int32_t>(), static_cast<int>(q.size(1)), a.group, dim, (dim + 7) / 8 * 8,
                  block_size, k_cache.stride(0), k_cache.stride(1), a.block_tables.size(1),
                  static_cast<float>(full ? q_scale * ks * scale : ks * scale),
                  static_cast<float>(full ? vs / kFp8Max : vs), static_cast<float>(full ? q_scale : 0.0)};
  dispatch_cache(k_cache.scalar_type(), [&](auto ct) {
    dispatch_io(q.scalar_type(), [&](auto io) {
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf;
        for (int64_t i = begin; i < end; ++i)
          attend<typename decltype(ct)::type, typename decltype(io)::type>(p, items[i], buf);
      });
    });
  });
  return out;
}

// The cache write, element by element as the reference rounds: float32 copied, bf16 rounded to nearest even,
// FP8 as E4M3(clamp(x / scale)) with the scale in float32; slot -1 skips a token.
template <typename ST, typename CT>
void write_rows(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots, float scale) {
  const int64_t width = src.size(1) * src.size(2), block_size = cache.size(1);
  const ST* s = src.data_ptr<ST>();
  CT* c = cache.data_ptr<CT>();
  at::parallel_for(0, src.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      CT* dst = c + slots[t] / block_size * cache.stride(0) + slots[t] % block_size * cache.stride(1);
      const ST* row = s + t * src.stride(0);
      for (int64_t i = 0; i < width; ++i) {
        const float x = static_cast<float>(row[i]);
        if constexpr (std::is_same_v<CT, at::Float8_e4m3fn>) {
          reinterpret_cast<uint8_t*>(dst)[i] =
              fp8e::e4m3_from_f32(std::isnan(x / scale) ? x / scale : std::min(kFp8Max, std::max(-kFp8Max, x / scale)));
        } else {
          dst[i] = static_cast<CT>(x);
        }
      }
    }
  });
}

}  // namespace

#define FP8E_ATTENTION_KERNELS

#endif

#if defined(FP8E_ATTENTION_KERNELS)

namespace {

// The cache write of either kernel set: its write_rows per source and cache dtype, k then v.
void write_kv_cache(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const KvWrite w = check_kv_write(k_in, v_in, k_cache, v_cache, slot_mapping);
  const int64_t* slot_data = w.slots.data_ptr<int64_t>();
  const auto write = [&](const at::Tensor& src, const at::Tensor& cache, double scale) {
    dispatch_io(src.scalar_type(), [&](auto st) {
      dispatch_cache(cache.scalar_type(), [&](auto ct) {
        write_rows<typename decltype(st)::type, typename decltype(ct)::type>(src, cache, slot_data,
                                                                             static_cast<float>(scale));
      });
    });
  };
  write(w.k, k_cache, k_scale);
  write(w.v, v_cache, v_scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, float scale, float k_scale, float v_scale, float q_scale, int fixed_partition=0) -> Tensor");
  m.def(
      "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}

#endif
