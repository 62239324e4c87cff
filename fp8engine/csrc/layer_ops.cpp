// Fused element-wise layer ops for x86 CPUs with AVX-512 (or AVX2 + FMA, 8 lanes): RMSNorm with the residual add, rotary
// embedding in place, and SiLU-and-mul. Each one replaces a chain of torch ops (and their
// temporaries) while rounding exactly where the torch versions do, so their references are
// fp8engine/model_executor/kernels/layer_ops_ref.py:
//   rms_norm:      r = x + residual (in the model dtype); y = weight * (r * rsqrt(mean(r^2) + eps))
//                  with the statistics in fp32 and the normalised value rounded before the weight;
//   rotary:        q * cos + rotate_half(q) * sin, each product and the sum rounded;
//   silu_and_mul:  silu(gate) rounded, times up;
//   lora_add_:     y += (x A^T) B^T, the products in fp32 and y rounded once (lora_add_ref).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FP8E_LAYER_OPS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FP8E_LAYER_OPS_AVX2 1  // CPUs without AVX-512: the same ops on 8 lanes (LoRA stays with torch there)
#endif

#if defined(FP8E_LAYER_OPS_AVX512) || defined(FP8E_LAYER_OPS_AVX2)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "linear_common.h"  // hsum_fixed (AVX2)
#include "vec_math.h"

namespace {

using fp8engine_vec::dispatch_io;

constexpr int64_t kGrainElems = 1 << 15;  // below this much work per thread, threads cost more than they save

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

#ifdef FP8E_LAYER_OPS_AVX512

using fp8engine_vec::exp512;
using fp8engine_vec::load16;
using fp8engine_vec::store16;
using fp8engine_vec::tail_mask;

constexpr int64_t kLanes = 16;

// The LoRA kernels' vector API (lanes [0, n) of memory; none for n <= 0).
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float f) { return _mm512_set1_ps(f); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
template <typename T>
inline Vec vload(const T* p, int64_t n) { return n > 0 ? load16(p, tail_mask(n)) : vzero(); }
template <typename T>
inline void vstore(T* p, Vec x, int64_t n) { store16(p, x, tail_mask(n)); }

// Rounds 16 lanes to the storage type T (a no-op for fp32), as a torch op's output would be.
template <typename T>
inline __m512 round_to(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(fp8engine_vec::fp32_to_bf16(x)), 16));
  }
}

// silu(gate) rounded, times up, for one row g = [gate | up] of 2n values.
template <typename T>
void silu_row(const T* g, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 a = load16(g + i, m);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
    const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    store16(y + i, _mm512_mul_ps(round_to<T>(silu), load16(g + n + i, m)), m);
  }
}

// ---------------------------------------------------------------- RMSNorm

template <typename T>
void rms_norm_row(const T* x, const T* res, T* res_out, const T* w, T* out, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  const T* r = res ? res_out : x;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = load16(x + i, m);
    if (res) {
      v = round_to<T>(_mm512_add_ps(v, load16(res + i, m)));
      store16(res_out + i, v, m);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 y = round_to<T>(_mm512_mul_ps(load16(r + i, m), inv));
    store16(out + i, _mm512_mul_ps(load16(w + i, m), y), m);
  }
}

// In place on one head: x[:h] <- x[:h] c - x[h:] s, x[h:] <- x[h:] c + x[:h] s (cos/sin repeat per half).
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 a = load16(x + i, m), b = load16(x + half + i, m);
    const __m512 c0 = load16(cos + i, m), s0 = load16(sin + i, m);
    const __m512 c1 = load16(cos + half + i, m), s1 = load16(sin + half + i, m);
    // rotate_half negates before the multiply; -(b s) rounds like (-b) s.
    const __m512 neg_b = _mm512_sub_ps(_mm512_setzero_ps(), b);
    const __m512 lo = _mm512_add_ps(round_to<T>(_mm512_mul_ps(a, c0)), round_to<T>(_mm512_mul_ps(neg_b, s0)));
    const __m512 hi = _mm512_add_ps(round_to<T>(_mm512_mul_ps(b, c1)), round_to<T>(_mm512_mul_ps(a, s1)));
    store16(x + i, lo, m);
    store16(x + half + i, hi, m);
  }
}

#else  // FP8E_LAYER_OPS_AVX2: 8 lanes, tails through a zero-padded copy

constexpr int64_t kLanes = 8;

inline __m256 load8(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  std::copy(p, p + n, t);
  return _mm256_load_ps(t);
}
inline __m256 load8(const at::BFloat16* p, int64_t n) {
  alignas(16) uint16_t t[8] = {};
  const auto* u = reinterpret_cast<const uint16_t*>(p);
  const __m128i h = n >= 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(u))
                           : (std::copy(u, u + n, t), _mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits in 16-bit lanes, as torch rounds (nearest even, denormals kept, NaN -> 0xFFFF).
inline __m128i fp32_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bias =
      _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline void store8(float* p, __m256 x, int64_t n) {
  if (n >= 8) return _mm256_storeu_ps(p, x);
  alignas(32) float t[8];
  _mm256_store_ps(t, x);
  std::copy(t, t + n, p);
}
inline void store8(at::BFloat16* p, __m256 x, int64_t n) {
  auto* u = reinterpret_cast<uint16_t*>(p);
  const __m128i h = fp32_to_bf16(x);
  if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(u), h);
  alignas(16) uint16_t t[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
  std::copy(t, t + n, u);
}

template <typename T>
inline __m256 round_to(__m256 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(fp32_to_bf16(x)), 16));
  }
}

using fp8engine_vec::exp256;
using fp8e::hsum_fixed;

using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float f) { return _mm256_set1_ps(f); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
template <typename T>
inline Vec vload(const T* p, int64_t n) { return n > 0 ? load8(p, n) : vzero(); }
template <typename T>
inline void vstore(T* p, Vec x, int64_t n) { store8(p, x, n); }
inline float vsum(Vec v) { return hsum_fixed(v); }

template <typename T>
void rms_norm_row(const T* x, const T* res, T* res_out, const T* w, T* out, int64_t n, float eps) {
  __m256 ss = _mm256_setzero_ps();
  const T* r = res ? res_out : x;
  for (int64_t i = 0; i < n; i += kLanes) {
    __m256 v = load8(x + i, n - i);
    if (res) {
      v = round_to<T>(_mm256_add_ps(v, load8(res + i, n - i)));
      store8(res_out + i, v, n - i);
    }
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum_fixed(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 y = round_to<T>(_mm256_mul_ps(load8(r + i, n - i), inv));
    store8(out + i, _mm256_mul_ps(load8(w + i, n - i), y), n - i);
  }
}

template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const int64_t m = half - i;
    const __m256 a = load8(x + i, m), b = load8(x + half + i, m);
    const __m256 c0 = load8(cos + i, m), s0 = load8(sin + i, m);
    const __m256 c1 = load8(cos + half + i, m), s1 = load8(sin + half + i, m);
    const __m256 neg_b = _mm256_sub_ps(_mm256_setzero_ps(), b);
    const __m256 lo = _mm256_add_ps(round_to<T>(_mm256_mul_ps(a, c0)), round_to<T>(_mm256_mul_ps(neg_b, s0)));
    const __m256 hi = _mm256_add_ps(round_to<T>(_mm256_mul_ps(b, c1)), round_to<T>(_mm256_mul_ps(a, s1)));
    store8(x + i, lo, m);
    store8(x + half + i, hi, m);
  }
}

template <typename T>
void silu_row(const T* g, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 a = load8(g + i, n - i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
    const __m256 silu = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    store8(y + i, _mm256_mul_ps(round_to<T>(silu), load8(g + n + i, n - i)), n - i);
  }
}

#endif  // FP8E_LAYER_OPS_AVX512 / AVX2

// out = weight * norm(x + residual) row by row, with res_out = x + residual (it may be residual itself: each
// element is read before it is written); x2, res2, out, res_out: [rows, n], contiguous.
void rms_norm_into(const at::Tensor& x2, const at::Tensor* res2, const at::Tensor& weight, double eps,
                   const at::Tensor& out, const at::Tensor* res_out) {
  const int64_t n = x2.size(1), rows = x2.size(0);
  dispatch_io(x2.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rms_norm_row(x2.data_ptr<T>() + i * n, res2 ? res2->data_ptr<T>() + i * n : nullptr,
                     res2 ? res_out->data_ptr<T>() + i * n : nullptr, weight.data_ptr<T>(),
                     out.data_ptr<T>() + i * n, n, static_cast<float>(eps));
    });
  });
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "weight must be a contiguous [", n, "] tensor of the input dtype");
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  check_norm_weight(x, weight);
  const int64_t n = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, n}).contiguous();
  at::Tensor res2, res_out;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x in shape and dtype");
    res2 = residual->reshape({-1, n}).contiguous();
    res_out = at::empty_like(x2);
  }
  at::Tensor out = at::empty_like(x2);
  rms_norm_into(x2, residual ? &res2 : nullptr, weight, eps, out, residual ? &res_out : nullptr);
  return {out.view(x.sizes()), residual ? res_out.view(x.sizes()) : at::Tensor()};
}

// rms_norm into caller-owned buffers (the decoder plan's, reused by every layer): out = the normalised rows;
// with a residual, residual_out = x + residual, which may be the residual tensor itself (updated in place).
void rms_norm_out(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                  double eps, at::Tensor& out, const c10::optional<at::Tensor>& residual_out) {
  check_norm_weight(x, weight);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm_out: x must be a contiguous [rows, n] tensor");
  auto same = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.is_contiguous(), "rms_norm_out: ",
                what, " must be a contiguous tensor of x's shape and dtype");
  };
  same(out, "out");
  TORCH_CHECK(residual.has_value() == residual_out.has_value(), "rms_norm_out: residual and residual_out go together");
  if (residual) same(*residual, "residual"), same(*residual_out, "residual_out");
  TORCH_CHECK(!out.is_same(x) && !(residual && (out.is_same(*residual) || out.is_same(*residual_out))),
              "rms_norm_out: out must not be x or a residual");
  rms_norm_into(x, residual ? &*residual : nullptr, weight, eps, out, residual ? &*residual_out : nullptr);
}

// ---------------------------------------------------------------- rotary embedding

void rotary_embedding_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& positions_in) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q and k must be [tokens, heads, head_dim] with equal tokens and head_dim");
  const int64_t dim = q.size(2);
  TORCH_CHECK(dim % 2 == 0 && q.stride(2) == 1 && k.stride(2) == 1, "head_dim must be even and contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "cos and sin must be contiguous [max_positions, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == cos.scalar_type() &&
                  cos.scalar_type() == sin.scalar_type(),
              "q, k, cos and sin must share a dtype");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(positions.numel() == q.size(0), "one position per token expected");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary table");
  dispatch_io(q.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t heads = q.size(1) + k.size(1);
    at::parallel_for(0, q.size(0), grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cos.data_ptr<T>() + pos[t] * dim;
        const T* s = sin.data_ptr<T>() + pos[t] * dim;
        for (const at::Tensor* x : {&q, &k})
          for (int64_t h = 0; h < x->size(1); ++h)
            rotate_head(x->data_ptr<T>() + t * x->stride(0) + h * x->stride(1), c, s, dim / 2);
      }
    });
  });
}

// ---------------------------------------------------------------- SiLU and mul

// out [rows, n] = silu(x[:, :n]) * x[:, n:] for contiguous x [rows, 2n].
void silu_and_mul_into(const at::Tensor& x, const at::Tensor& out) {
  const int64_t n = out.size(1);
  dispatch_io(x.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    at::parallel_for(0, x.size(0), grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_row(x.data_ptr<T>() + r * 2 * n, out.data_ptr<T>() + r * n, n);
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.size(-1) % 2 == 0, "silu_and_mul needs an even last dimension, got ", x_in.size(-1));
  const int64_t n = x_in.size(-1) / 2;
  const at::Tensor x = x_in.reshape({-1, 2 * n}).contiguous();
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  silu_and_mul_into(x, out);
  return out.view(shape);
}

// silu_and_mul into a caller-owned [rows, n] buffer (the decoder plan's).
void silu_and_mul_out(const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul_out: x must be a contiguous [rows, 2n] tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1) &&
                  out.scalar_type() == x.scalar_type() && out.is_contiguous(),
              "silu_and_mul_out: out must be a contiguous [rows, n] tensor of x's dtype");
  silu_and_mul_into(x, out);
}

// ---------------------------------------------------------------- LoRA

// A LoRA adapter's share, y += (x A^T) B, in segments: each (j0, j1, o0, o1) adds x A[j0:j1]^T B^T[j0:j1, o0:o1]
// to y[:, o0:o1] (a fused layer's shards: each shard's rank rows feed its own output columns only; an empty range
// adds nothing). Per row: t[j] = x . A[j] (an fp32 FMA chain over K, 16 lanes, then a fixed reduction); then per
// output lane one fp32 FMA chain over j in order, added to y in fp32 and rounded once. Rows, adapter rows and
// output vectors are blocked (4 x 4 accumulators) for the loads they share, rows or output blocks split over the
// threads, but every output's chain is the same whatever the blocks, the other rows or the thread count: batch
// invariant.
constexpr int kLoraBlock = 4;

struct LoraSegment {
  int64_t j0, j1, o0, o1;
};

template <typename T, int MB>
void lora_shrink(const T* x, const T* a, float* t, int64_t k, int64_t r, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += kLoraBlock) {
    const int64_t jb = std::min<int64_t>(kLoraBlock, j1 - j);
    Vec acc[MB][kLoraBlock];
    for (auto& row : acc)
      for (auto& v : row) v = vzero();
    for (int64_t i = 0; i < k; i += kLanes) {
      Vec av[kLoraBlock];
      for (int q = 0; q < kLoraBlock; ++q) av[q] = q < jb ? vload(a + (j + q) * k + i, k - i) : vzero();
      for (int b = 0; b < MB; ++b) {
        const Vec xv = vload(x + b * k + i, k - i);
        for (int q = 0; q < kLoraBlock; ++q) acc[b][q] = vfma(xv, av[q], acc[b][q]);
      }
    }
    for (int b = 0; b < MB; ++b)
      for (int q = 0; q < jb; ++q) t[b * r + j + q] = vsum(acc[b][q]);
  }
}

// Output columns [o, min(o + kLoraBlock * kLanes, o1)) of MB rows from their t.
template <typename T, int MB>
void lora_expand(const float* t, const T* bt, T* y, int64_t r, int64_t n, const LoraSegment& s, int64_t o) {
  int64_t mk[kLoraBlock];  // columns of each vector inside the segment (<= 0: none)
  for (int v = 0; v < kLoraBlock; ++v) mk[v] = s.o1 - o - v * kLanes;
  Vec acc[MB][kLoraBlock];
  for (auto& row : acc)
    for (auto& v : row) v = vzero();
  for (int64_t j = s.j0; j < s.j1; ++j) {
    Vec bv[kLoraBlock];
    for (int v = 0; v < kLoraBlock; ++v) bv[v] = vload(bt + j * n + o + v * kLanes, mk[v]);
    for (int b = 0; b < MB; ++b) {
      const Vec tj = vset1(t[b * r + j]);
      for (int v = 0; v < kLoraBlock; ++v) acc[b][v] = vfma(tj, bv[v], acc[b][v]);
    }
  }
  for (int b = 0; b < MB; ++b)
    for (int v = 0; v < kLoraBlock; ++v)
      if (mk[v] > 0) {
        T* out = y + b * n + o + v * kLanes;
        vstore(out, vadd(vload(out, mk[v]), acc[b][v]), mk[v]);
      }
}

template <typename T, int MB>
void lora_rows(const T* x, const T* a, const T* bt, T* y, float* t, int64_t k, int64_t r, int64_t n,
               const std::vector<LoraSegment>& segs) {
  for (const LoraSegment& s : segs) lora_shrink<T, MB>(x, a, t, k, r, s.j0, s.j1);
  for (const LoraSegment& s : segs)
    if (s.j1 > s.j0)
      for (int64_t o = s.o0; o < s.o1; o += kLoraBlock * kLanes) lora_expand<T, MB>(t, bt, y, r, n, s, o);
}

// y [M, N] += (x [M, K] A [R, K]^T) B, B given transposed (bt [R, N]), by segments [S, 4] (j0, j1, o0, o1).
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& segments) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 2 && bt.dim() == 2, "lora_add_: 2-d tensors expected");
  const int64_t rows = x.size(0), k = x.size(1), r = a.size(0), n = bt.size(1);
  TORCH_CHECK(a.size(1) == k && bt.size(0) == r && y.size(0) == rows && y.size(1) == n, "lora_add_: y ", y.sizes(),
              ", x ", x.sizes(), ", A ", a.sizes(), ", B^T ", bt.sizes(), " do not fit y += (x A^T) B");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  bt.scalar_type() == y.scalar_type(), "lora_add_: y, x, A and B must have one dtype");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && bt.is_contiguous(),
              "lora_add_: contiguous tensors expected");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4,
              "lora_add_: segments must be int64 [S, 4]");
  std::vector<LoraSegment> segs;
  const at::Tensor sc = segments.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < sc.size(0); ++i) {
    const LoraSegment s{sp[4 * i], sp[4 * i + 1], sp[4 * i + 2], sp[4 * i + 3]};
    TORCH_CHECK(0 <= s.j0 && s.j0 <= s.j1 && s.j1 <= r && 0 <= s.o0 && s.o0 <= s.o1 && s.o1 <= n,
                "lora_add_: segment ", i, " is out of range");
    segs.push_back(s);
  }
  dispatch_io(y.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *xp = x.data_ptr<T>(), *ap = a.data_ptr<T>(), *bp = bt.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    if (rows >= kLoraBlock * at::get_num_threads()) {  // rows over the threads
      at::parallel_for(0, rows, kLoraBlock, [&](int64_t begin, int64_t end) {
        std::vector<float> t(kLoraBlock * r);
        int64_t i = begin;
        for (; i + kLoraBlock <= end; i += kLoraBlock)
          lora_rows<T, kLoraBlock>(xp + i * k, ap, bp, yp + i * n, t.data(), k, r, n, segs);
        for (; i < end; ++i) lora_rows<T, 1>(xp + i * k, ap, bp, yp + i * n, t.data(), k, r, n, segs);
      });
      return;
    }
    // a few rows: each row's t here, then the output blocks over the threads
    std::vector<float> t(rows * r);
    for (int64_t i = 0; i < rows; ++i)
      for (const LoraSegment& s : segs) lora_shrink<T, 1>(xp + i * k, ap, t.data() + i * r, k, r, s.j0, s.j1);
    std::vector<std::pair<int64_t, int64_t>> blocks;  // (segment, first output column)
    for (size_t si = 0; si < segs.size(); ++si)
      if (segs[si].j1 > segs[si].j0)
        for (int64_t o = segs[si].o0; o < segs[si].o1; o += kLoraBlock * kLanes) blocks.emplace_back(si, o);
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t bi = begin; bi < end; ++bi)
        for (int64_t i = 0; i < rows; ++i)
          lora_expand<T, 1>(t.data() + i * r, bp, yp + i * n, r, n, segs[blocks[bi].first], blocks[bi].second);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm_out(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor(a!) out, "
        "Tensor(b!)? residual_out) -> ()");
  m.def("silu_and_mul_out(Tensor x, Tensor(a!) out) -> ()");
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor segments) -> ()");
}

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm_out", &rms_norm_out);
  m.impl("silu_and_mul_out", &silu_and_mul_out);
  m.impl("lora_add_", &lora_add_);
}

#endif
