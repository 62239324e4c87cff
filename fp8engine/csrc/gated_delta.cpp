// The gated delta rule's recurrent form for Gated DeltaNet layers (Qwen3.5, Qwen3-Next), in place on the engine's
// state pool. Per value head h with state S [dk, dv] (float32), each token t of a sequence does
//
//   S = exp(g_t) * S;   m = S^T k_t;   u = beta_t * (v_t - m);   S = S + k_t u^T;   o_t = S^T q_t
//
// (q and k L2-normalised, q scaled by dk^-1/2, key head h / (Hv / Hk): prepared by the caller). Its reference is
// kernels/gated_delta_ref.py recurrent_gated_delta_ref; this is the same arithmetic in another order (sums over dk
// as fused multiply-adds in k order, 16 value columns a vector), so equal to it within float32 rounding.
//
// Bits: each (sequence, head) pair is computed by one thread, token after token, with the same instructions
// whatever the other sequences, the batch or how the tokens were split into calls: the state after position p has
// the same bits however positions <= p were stepped (what batch-invariant prefill and decode need). Two passes
// over a head's state per token (64 KiB at dk = dv = 128, cache-resident): decay and read, then write and output.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxDv = 512;

// One token of one head: s [dk, dv] row-major, updated in place; out [dv].
inline void step_head(float* __restrict s, const float* __restrict q, const float* __restrict k,
                      const float* __restrict v, float decay, float beta, float* __restrict out, int64_t dk,
                      int64_t dv) {
  alignas(64) float mem[kMaxDv];
  alignas(64) float u[kMaxDv];
#if defined(__AVX512F__)
  const int64_t vec_end = dv / 16 * 16;
#else
  const int64_t vec_end = 0;
#endif
  for (int64_t j = 0; j < dv; ++j) mem[j] = 0.f;
  // pass 1: decay, and m = S^T k
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i];
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(decay), vk = _mm512_set1_ps(ki);
    for (int64_t j = 0; j < vec_end; j += 16) {
      const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + j), vd);
      _mm512_storeu_ps(row + j, r);
      _mm512_store_ps(mem + j, _mm512_fmadd_ps(r, vk, _mm512_load_ps(mem + j)));
    }
#endif
    for (int64_t j = vec_end; j < dv; ++j) {
      row[j] = row[j] * decay;
      mem[j] = std::fma(row[j], ki, mem[j]);
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    u[j] = (v[j] - mem[j]) * beta;
    out[j] = 0.f;
  }
  // pass 2: S += k u^T, and o = S^T q
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
#if defined(__AVX512F__)
    const __m512 vk = _mm512_set1_ps(ki), vq = _mm512_set1_ps(qi);
    for (int64_t j = 0; j < vec_end; j += 16) {
      const __m512 r = _mm512_fmadd_ps(vk, _mm512_load_ps(u + j), _mm512_loadu_ps(row + j));
      _mm512_storeu_ps(row + j, r);
      _mm512_storeu_ps(out + j, _mm512_fmadd_ps(r, vq, _mm512_loadu_ps(out + j)));
    }
#endif
    for (int64_t j = vec_end; j < dv; ++j) {
      row[j] = std::fma(ki, u[j], row[j]);
      out[j] = std::fma(row[j], qi, out[j]);
    }
  }
}

// q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]: float32, contiguous. state [N, Hv, dk, dv] float32 contiguous
// rows; sequence b's tokens are query_start_loc[b] .. query_start_loc[b + 1] and its state is state[slots[b]].
// Returns o [T, Hv, dv] float32.
at::Tensor gdn_recurrent_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots_in,
                          const at::Tensor& starts_in) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, static_cast<const at::Tensor*>(&state)})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gdn_recurrent_: float32 contiguous inputs");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gdn_recurrent_: q, k [T, Hk, dk] and v [T, Hv, dv]");
  const int64_t tokens = q.size(0), hk = q.size(1), dk = q.size(2), hv = v.size(1), dv = v.size(2);
  TORCH_CHECK(hv % hk == 0, "gdn_recurrent_: Hv must be a multiple of Hk");
  TORCH_CHECK(dv <= kMaxDv, "gdn_recurrent_: head_v_dim up to ", kMaxDv);
  TORCH_CHECK(g.sizes() == at::IntArrayRef({tokens, hv}) && beta.sizes() == g.sizes(),
              "gdn_recurrent_: g and beta [T, Hv]");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == hv && state.size(2) == dk && state.size(3) == dv,
              "gdn_recurrent_: state [N, Hv, dk, dv]");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), starts = starts_in.to(at::kLong).contiguous();
  const int64_t seqs = slots.numel();
  TORCH_CHECK(starts.numel() == seqs + 1, "gdn_recurrent_: query_start_loc has one more entry than slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[seqs] == tokens, "gdn_recurrent_: query_start_loc must span the tokens");
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < state.size(0), "gdn_recurrent_: slot ", slot[b], " out of range");
    TORCH_CHECK(start[b] <= start[b + 1], "gdn_recurrent_: query_start_loc must not decrease");
  }
  at::Tensor out = at::empty({tokens, hv, dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rep = hv / hk;
  at::parallel_for(0, seqs * hv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv, kh = h / rep;
      float* s = sp + (slot[b] * hv + h) * dk * dv;
      for (int64_t t = start[b]; t < start[b + 1]; ++t) {
        step_head(s, qp + (t * hk + kh) * dk, kp + (t * hk + kh) * dk, vp + (t * hv + h) * dv,
                  std::exp(gp[t * hv + h]), bp[t * hv + h], op + (t * hv + h) * dv, dk, dv);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.def("gdn_recurrent_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots, "
        "Tensor query_start_loc) -> Tensor");
}

TORCH_LIBRARY_IMPL(fp8engine, CPU, m) { m.impl("gdn_recurrent_", &gdn_recurrent_); }
