// Fused sampling for rows without truncation (no top-k / top-p / min-p), for x86 CPUs with AVX-512 or AVX2.
//
// Per row of logits x [R, V] (bf16 or fp32), with temperature T (0 = greedy) and one uniform u:
//   raw logprob of the token       x[tok] - logsumexp(x)
//   processed logprob              x[tok] / T - logsumexp(x / T)   (0 for greedy)
//   token                          argmax (greedy, first of ties) or the inverse CDF of
//                                  softmax(x / T) at (1 - u): the first token whose running sum of
//                                  exp(x / T - max) reaches (1 - u) * total, as in
//                                  fp8engine/model_executor/layers/sampler.py (the reference).
// One pass finds the max, one sums exp in chunks (keeping each chunk's sum), and the draw rescans a
// single chunk, instead of materialising log-softmax, probabilities and a cumulative sum over V.
// With `forced` tokens (scoring a given sequence) the draw is skipped and the logprobs are those of the
// forced token, by the same arithmetic as a draw of it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "linear_common.h"  // hsum_fixed and Bf16Weights (AVX2)
#include "vec_math.h"

namespace {

using fp8engine_vec::dispatch_io;

constexpr int64_t kChunk = 512;  // elements per kept partial sum

inline float value(const float* p, int64_t i) { return p[i]; }
inline float value(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

// The vector steps of a row scan, per instruction set: `exp_at` gives exp(x * inv_t - shift) of the lanes
// [i, min(i + kLanes, end)) and 0 in lanes past end; `max_at` folds the same lanes into a running max.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

using fp8engine_vec::exp512;
using fp8engine_vec::load16;
using fp8engine_vec::tail_mask;

constexpr int64_t kLanes = 16;
using Vec = __m512;

inline Vec vfill(float f) { return _mm512_set1_ps(f); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vmax(Vec v) { return _mm512_reduce_max_ps(v); }

template <typename T>
Vec max_at(Vec m, const T* x, int64_t i, int64_t end) {
  const __mmask16 k = tail_mask(end - i);
  return _mm512_mask_max_ps(m, k, m, load16(x + i, k));
}

template <typename T>
Vec exp_at(const T* x, int64_t i, int64_t end, float inv_t, float shift) {
  const __mmask16 k = tail_mask(end - i);
  return _mm512_maskz_mov_ps(k, exp512(_mm512_fmsub_ps(load16(x + i, k), _mm512_set1_ps(inv_t),
                                                       _mm512_set1_ps(shift))));
}

#else  // AVX2 + FMA: 8 lanes, the row's last partial vector read through a copy padded with -inf

using fp8engine_vec::exp256;

constexpr int64_t kLanes = 8;
using Vec = __m256;

inline Vec vfill(float f) { return _mm256_set1_ps(f); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) { return fp8e::hsum_fixed(v); }
inline float vmax(Vec v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + kLanes);
}

inline Vec load8(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load8(const at::BFloat16* p) { return fp8e::Bf16Weights::load8(reinterpret_cast<const uint16_t*>(p)); }

// Lanes [i, end) of x (all 8 when they exist), the rest -inf: neither a max nor an exp sum sees them.
template <typename T>
Vec load8_at(const T* x, int64_t i, int64_t end) {
  if (end - i >= kLanes) return load8(x + i);
  alignas(32) float buf[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) buf[j] = i + j < end ? value(x, i + j) : -std::numeric_limits<float>::infinity();
  return _mm256_load_ps(buf);
}

template <typename T>
Vec max_at(Vec m, const T* x, int64_t i, int64_t end) {
  return _mm256_max_ps(m, load8_at(x, i, end));
}

// exp256 with exp(y) = 0 below -87.5 (exp256 clamps there, to about 2^-126) and NaN kept, as exp512 does.
template <typename T>
Vec exp_at(const T* x, int64_t i, int64_t end, float inv_t, float shift) {
  const Vec y = _mm256_fmsub_ps(load8_at(x, i, end), _mm256_set1_ps(inv_t), _mm256_set1_ps(shift));
  const Vec e = _mm256_and_ps(_mm256_cmp_ps(y, _mm256_set1_ps(-87.5f), _CMP_GE_OQ), exp256(y));
  return _mm256_or_ps(e, _mm256_and_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q), y));
}

#endif

template <typename T>
float row_max(const T* x, int64_t v) {
  Vec m = vfill(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < v; i += kLanes) m = max_at(m, x, i, v);
  return vmax(m);
}

// The greedy token: the first index whose value equals max (the first of ties), 0 when none does (all NaN).
// Only greedy rows look for it.
template <typename T>
int64_t first_index_of(const T* x, int64_t v, float max) {
  for (int64_t i = 0; i < v; ++i)
    if (value(x, i) == max) return i;
  return 0;
}

// Sum of exp(x * inv_t - shift), with the sum of every kChunk elements stored in `chunks` if given.
template <typename T>
float sum_exp(const T* x, int64_t v, float inv_t, float shift, float* chunks) {
  float total = 0.f;
  for (int64_t c0 = 0; c0 < v; c0 += kChunk) {
    Vec acc = vfill(0.f);
    const int64_t c1 = std::min(v, c0 + kChunk);
    for (int64_t i = c0; i < c1; i += kLanes) acc = vadd(acc, exp_at(x, i, c1, inv_t, shift));
    const float s = vsum(acc);
    if (chunks) chunks[c0 / kChunk] = s;
    total += s;
  }
  return total;
}

// First index whose running sum of exp(x * inv_t - shift) reaches target; target <= the chunk total.
template <typename T>
int64_t invert_cdf(const T* x, int64_t v, float inv_t, float shift, const float* chunks, float target) {
  const int64_t num_chunks = (v + kChunk - 1) / kChunk;
  float before = 0.f;
  int64_t c = 0;
  while (c + 1 < num_chunks && before + chunks[c] < target) before += chunks[c++];
  int64_t last_positive = -1;
  for (int64_t i = c * kChunk; i < std::min(v, (c + 1) * kChunk); ++i) {
    const float e = std::exp(value(x, i) * inv_t - shift);
    if (e <= 0.f) continue;
    last_positive = i;
    before += e;
    if (before >= target) return i;
  }
  return last_positive;  // rounding left the chunk just short of the target
}

template <typename T>
void sample_row(const T* x, int64_t v, float temperature, float uniform, bool need_raw, float* chunks,
                int64_t forced, int64_t& token, float& processed, float& raw) {
  const float max = row_max(x, v);
  const bool tempered = temperature > 0.f && temperature != 1.f;
  const float raw_lse = (need_raw || temperature == 1.f)
                            ? max + std::log(sum_exp(x, v, 1.f, max, tempered ? nullptr : chunks))
                            : 0.f;
  if (temperature == 0.f) {
    token = forced >= 0 ? forced : first_index_of(x, v, max);
    processed = 0.f;
  } else {
    // max(x / T) == max / T: division by T > 0 rounds monotonically.
    const float inv_t = tempered ? 1.f / temperature : 1.f, shift = tempered ? max / temperature : max;
    const float total = tempered ? sum_exp(x, v, inv_t, shift, chunks) : std::exp(raw_lse - max);
    token = forced >= 0 ? forced : invert_cdf(x, v, inv_t, shift, chunks, (1.f - uniform) * total);
    processed = tempered ? value(x, token) / temperature - shift - std::log(total) : value(x, token) - raw_lse;
  }
  raw = need_raw ? value(x, token) - raw_lse : 0.f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits_in,
                                                           const at::Tensor& temperature_in,
                                                           const at::Tensor& uniform_in, bool need_raw,
                                                           const std::optional<at::Tensor>& forced_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "logits must be [rows, vocab]");
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat || logits_in.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  const int64_t rows = logits_in.size(0), v = logits_in.size(1);
  const at::Tensor temperature = temperature_in.to(at::kFloat).contiguous();
  const at::Tensor uniform = uniform_in.to(at::kFloat).contiguous();
  TORCH_CHECK(temperature.numel() == rows && uniform.numel() == rows, "temperature and uniform need one value per row");
  const float* t = temperature.data_ptr<float>();  // a loop: tensor ops here cost more than a row's sampling
  TORCH_CHECK(std::all_of(t, t + rows, [](float x) { return x >= 0.f; }), "temperature must be >= 0");
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  at::Tensor forced;
  if (forced_in.has_value() && forced_in->defined()) {
    forced = forced_in->to(at::kLong).contiguous();
    TORCH_CHECK(forced.numel() == rows, "forced needs one token per row");
    const int64_t* ids = forced.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(ids, ids + rows, [v](int64_t id) { return id >= 0 && id < v; }),
                "forced tokens must lie in [0, vocab)");
  }
  const int64_t* f = forced.defined() ? forced.data_ptr<int64_t>() : nullptr;
  at::Tensor tokens = at::empty({rows}, at::kLong);
  at::Tensor processed = at::empty({rows}, at::kFloat), raw = at::empty({rows}, at::kFloat);
  const float* u = uniform.data_ptr<float>();
  dispatch_io(logits.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> chunks((v + kChunk - 1) / kChunk);
      for (int64_t r = begin; r < end; ++r)
        sample_row(logits.data_ptr<T>() + r * logits.stride(0), v, t[r], u[r], need_raw, chunks.data(),
                   f ? f[r] : -1, tokens.data_ptr<int64_t>()[r], processed.data_ptr<float>()[r],
                   raw.data_ptr<float>()[r]);
    });
  });
  return {tokens, processed, raw};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor temperature, Tensor uniform, bool need_raw, Tensor? forced=None) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) { m.impl("sample_rows", &sample_rows); }

#endif
