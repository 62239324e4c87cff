// The decoder layers of a hybrid model (Qwen3.5 dense) in one call from Python, for a decode step: every sequence one
// new token, and a state snapshot, if any, of the state after it (fused_decoder.py HybridDecoder says when).
//
// As decoder.cpp does for the dense Llama family, this calls the ops the Python layers call (models/qwen3_5.py,
// layers/gated_delta.py, kernels/gated_delta_ref.py), with the same arguments and in the same order: the same
// aten ops for the zero-centred norms, partial RoPE, the output gate, the causal conv, the decay and beta, the
// L2 norms and the gated norm; the fp8engine ops for the projections, the KV write, paged attention, the gated delta
// rule and SiLU-and-mul. So a step's tokens, logprobs, KV cache and states are the Python path's bit for bit
// (tests/test_fused_decoder.py); what goes is the Python around the ops, which at batch 1 on a 2-vCPU VM was about
// a fifth of a Qwen3.5-2B-shaped FP8 decode step.
//
// A HybridPlan holds the layers' parameters (the modules' own tensors, which weight updates write in place); the KV
// caches, KV scales and state pools, which sleep, calibration and scratch forwards may swap, come with each call.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "decoder_ops.h"

namespace {

using namespace fp8e::plan;

// kernels/gated_delta_ref.py: sigmoid(x) = 1 / (1 + exp(-x)) (Tensor.__rtruediv__ is reciprocal() * 1, and the
// product by one changes no bit), silu(x) = x / (1 + exp(-x)), in x's dtype.
at::Tensor sigmoid_ref(const at::Tensor& x) { return at::reciprocal(at::add(at::exp(at::neg(x)), 1)); }
at::Tensor silu_ref(const at::Tensor& x) { return at::div(x, at::add(at::exp(at::neg(x)), 1)); }

// xf * rsqrt(mean(xf^2) + eps) over the last dim, float32: the normalisation both of Qwen3.5's norms start with.
at::Tensor rms_normed(const at::Tensor& xf, double eps) {
  return at::mul(xf, at::rsqrt(at::add(at::mean(at::pow(xf, 2), {-1}, true), eps)));
}

// ZeroCentredRMSNorm.forward_float32 rounded to x's dtype: norm(x) * (1 + w) in float32.
at::Tensor zc_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return at::mul(rms_normed(x.to(at::kFloat), eps), at::add(w.to(at::kFloat), 1.0)).to(x.scalar_type());
}

// softplus as gated_delta_ref.softplus computes it (torch's threshold 20, log1p from log).
at::Tensor softplus_ref(const at::Tensor& x) {
  const at::Tensor e = at::exp(at::clamp(x, std::nullopt, c10::optional<at::Scalar>(20)));
  const at::Tensor u = at::add(e, 1);
  const at::Tensor log1p = at::where(at::eq(u, 1), e, at::div(at::mul(at::log(u), e), at::sub(u, 1)));
  return at::where(at::gt(x, 20), x, log1p);
}

// gated_delta_ref.l2norm: x * rsqrt(sum(x * x) + 1e-6) over the last dim.
at::Tensor l2norm_ref(const at::Tensor& x) {
  return at::mul(x, at::rsqrt(at::add(at::sum(at::mul(x, x), {-1}, true), 1e-6)));
}

// Per layer, `tensors` holds kPerLayer entries (None where absent):
//   0 input_layernorm, 1 post_attention_layernorm;
//   GDN: 2, 9, 16, 23, 30: (weight, scale, bias, scale_rows, lora_a, lora_b, lora_segments) of in_proj_qkv,
//        in_proj_z, in_proj_a, in_proj_b, out_proj; 37 the conv weight [C, K], 38 A_log, 39 dt_bias, 40 the gated
//        norm's weight;
//   attention: 2, 9: qkv_proj, o_proj; 16 q_norm, 17 k_norm;
//   41, 48: gate_up_proj, down_proj.
// kinds: 0 a GDN layer, 1 gated attention. nt16: per layer its 7 projections' layout (Proj::nt16).
// dims: heads, kv heads, head_dim, rotary dims, attention partition, key heads, value heads, key head dim, value
// head dim, conv kernel.
constexpr int64_t kPerLayer = 55;
constexpr int64_t kProjSlots[7] = {2, 9, 16, 23, 30, 41, 48};

// A state snapshot a decode step writes: the state after this step of the sequence in `row` (whose own slot is
// `source`) copied into `slot`.
struct Snapshot {
  int64_t row, slot, source;
};

struct HybridLayer {
  bool linear;
  at::Tensor input_norm, post_norm;
  Proj p0, p1, p2, p3, p4;  // GDN: qkv, z, a, b, out; attention: qkv, o
  OptTensor conv_weight, a_log, dt_bias, gdn_norm, q_norm, k_norm;
  Proj gate_up, down;
};

class HybridPlan : public torch::CustomClassHolder {
 public:
  HybridPlan(std::vector<OptTensor> tensors, std::vector<int64_t> kinds, std::vector<int64_t> nt16, at::Tensor cos,
             at::Tensor sin, std::vector<int64_t> dims, double eps, double attn_scale, bool ue8m0,
             bool batch_invariant, std::vector<std::string> gemms, bool prefetch_next, std::string tp_group,
             int64_t tp_size, bool tp_fixed_order)
      : cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), attn_scale_(attn_scale),
        batch_invariant_(batch_invariant), prefetch_next_(prefetch_next),
        reduce_(std::move(tp_group), tp_size, tp_fixed_order) {
    TORCH_CHECK(gemms.size() == 2, "HybridPlan: gemms [fp8, bf16] expected");
    fp8_gemm_ = gemms[0], bf16_gemm_ = gemms[1];
    const int64_t n = static_cast<int64_t>(kinds.size());
    TORCH_CHECK(n > 0 && static_cast<int64_t>(tensors.size()) == n * kPerLayer, "HybridPlan: ", kPerLayer,
                " tensors per layer expected, got ", tensors.size(), " for ", n, " layers");
    TORCH_CHECK(static_cast<int64_t>(nt16.size()) == 7 * n, "HybridPlan: 7 layout flags per layer expected");
    TORCH_CHECK(dims.size() == 10, "HybridPlan: 10 dims expected");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2], rotary_dim_ = dims[3], partition_ = dims[4];
    k_heads_ = dims[5], v_heads_ = dims[6], dk_ = dims[7], dv_ = dims[8], conv_k_ = dims[9];
    for (int64_t i = 0; i < n; ++i) {
      auto at_ = [&](int64_t j) { return tensors[i * kPerLayer + j]; };
      auto need = [&](int64_t j, const char* what) {
        TORCH_CHECK(at_(j).has_value(), "HybridPlan: layer ", i, " has no ", what);
        return *at_(j);
      };
      auto proj = [&](int p) {
        const int64_t j = kProjSlots[p];
        const bool lora = at_(j + 4).has_value();
        TORCH_CHECK(at_(j + 5).has_value() == lora && at_(j + 6).has_value() == lora,
                    "HybridPlan: a LoRA adapter's tensors come together");
        Proj out{need(j, "projection weight"), at_(j + 1), at_(j + 2), at_(j + 3), at_(j + 4), at_(j + 5),
                 at_(j + 6), ue8m0};
        out.nt16 = static_cast<int>(nt16[7 * i + p]);
        return out;
      };
      TORCH_CHECK(kinds[i] == 0 || kinds[i] == 1, "HybridPlan: layer kind 0 (GDN) or 1 (attention) expected");
      const bool linear = kinds[i] == 0;
      HybridLayer l{linear, need(0, "input norm"), need(1, "post-attention norm"), proj(0), proj(1)};
      if (linear) {
        l.p2 = proj(2), l.p3 = proj(3), l.p4 = proj(4);
        l.conv_weight = need(37, "conv weight"), l.a_log = need(38, "A_log"), l.dt_bias = need(39, "dt_bias");
        l.gdn_norm = need(40, "gated norm weight");
      } else {
        l.q_norm = need(16, "q_norm"), l.k_norm = need(17, "k_norm");
      }
      l.gate_up = proj(5), l.down = proj(6);
      num_linear_ += linear;
      layers_.push_back(std::move(l));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, hidden] (the embeddings) of T sequences, one new token each -> (output of the last layer, its residual).
  // kv_caches: k and v cache of each attention layer; scales: its k, v and q scale (q 0: not full FP8);
  // conv_states, rec_states: each GDN layer's pools, indexed by state_slots [T]; snapshot_rows / snapshot_slots: the
  // sequence (row) whose state after this step each snapshot slot takes; bf16_kernel: the BF16 projections whose
  // weights are rows take the C++ kernel at T rows (else torch's linear); lora: an adapter is loaded.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& positions,
                                             std::vector<at::Tensor> kv_caches, std::vector<double> scales,
                                             std::vector<at::Tensor> conv_states, std::vector<at::Tensor> rec_states,
                                             const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                             const at::Tensor& state_slots, std::vector<int64_t> snapshot_rows,
                                             std::vector<int64_t> snapshot_slots, bool bf16_kernel, bool lora) const {
    const int64_t attn_layers = num_layers() - num_linear_;
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == 2 * attn_layers &&
                    static_cast<int64_t>(scales.size()) == 3 * attn_layers,
                "HybridPlan.forward: ", 2 * attn_layers, " caches and ", 3 * attn_layers, " scales expected");
    TORCH_CHECK(static_cast<int64_t>(conv_states.size()) == num_linear_ &&
                    static_cast<int64_t>(rec_states.size()) == num_linear_,
                "HybridPlan.forward: ", num_linear_, " conv and recurrent state pools expected");
    const int64_t t = x.size(0);
    TORCH_CHECK(query_start_loc.numel() == t + 1 && state_slots.numel() == t,
                "HybridPlan.forward: a decode step (one new token a sequence, a state slot each) expected");
    TORCH_CHECK(snapshot_rows.size() == snapshot_slots.size(), "HybridPlan.forward: a slot for each snapshot row");
    std::vector<Snapshot> snapshots;
    for (size_t s = 0; s < snapshot_rows.size(); ++s) {
      TORCH_CHECK(snapshot_rows[s] >= 0 && snapshot_rows[s] < t, "HybridPlan.forward: snapshot row out of range");
      snapshots.push_back({snapshot_rows[s], snapshot_slots[s], state_slots[snapshot_rows[s]].item<int64_t>()});
    }
    const Ops& ops = get_ops();
    const ProjPath path{batch_invariant_, false, fp8_gemm_, bf16_gemm_, bf16_kernel, prefetch_next_};
    // PartialRotary's rows for the step (the Python layers gather the same rows in each attention layer)
    const at::Tensor cos = cos_.index({positions}).unsqueeze(1), sin = sin_.index({positions}).unsqueeze(1);
    at::Tensor residual;
    int64_t a = 0, g = 0;  // attention and GDN layers so far
    for (int64_t i = 0; i < num_layers(); ++i) {
      const HybridLayer& l = layers_[i];
      const Proj* next_qkv = i + 1 < num_layers() ? &layers_[i + 1].p0 : nullptr;
      if (residual.defined()) x = at::add(x, residual);
      residual = x;
      const at::Tensor h = zc_norm(x, l.input_norm, eps_);
      at::Tensor mixed;  // the token mixer's output
      if (l.linear) {
        mixed = gdn(ops, l, h, path, lora, conv_states[g], rec_states[g], state_slots, query_start_loc, snapshots);
        ++g;
      } else {
        mixed = attention(ops, l, h, path, lora, cos, sin, kv_caches[2 * a], kv_caches[2 * a + 1], &scales[3 * a],
                          slot_mapping, query_start_loc, seq_lens, block_tables);
        ++a;
      }
      residual = at::add(mixed, residual);
      const at::Tensor h2 = zc_norm(residual, l.post_norm, eps_);
      const at::Tensor gate_up = l.gate_up(ops, h2, path, lora, &l.down);
      at::Tensor act = at::empty({t, gate_up.size(1) / 2}, gate_up.options());
      ops.silu_and_mul_out.call(gate_up, act);
      x = reduce_(l.down(ops, act, path, lora, next_qkv));
    }
    return {x, residual};
  }

  // Seconds spent adding partial sums over the tensor-parallel ranks since the plan was built.
  double collective_seconds() const { return reduce_.seconds(); }

 private:
  // GatedAttention.forward: qkv_proj gives per head [q | gate], then k, v; per-head zero-centred q/k norms, partial
  // RoPE, the KV write and paged attention, o_proj(attn * sigmoid(gate)).
  at::Tensor attention(const Ops& ops, const HybridLayer& l, const at::Tensor& x, const ProjPath& path, bool lora,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                       const double* scales, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, const at::Tensor& block_tables) const {
    const int64_t t = x.size(0), d = head_dim_, q_size = heads_ * d, kv_size = kv_heads_ * d;
    const at::Tensor qkv = l.p0(ops, x, path, lora, &l.p1);
    const at::Tensor qg = qkv.narrow(-1, 0, 2 * q_size).reshape({t, heads_, 2 * d});
    const at::Tensor gate = qg.narrow(-1, d, d).reshape({t, q_size});
    at::Tensor q = zc_norm(qg.narrow(-1, 0, d), *l.q_norm, eps_);
    at::Tensor k = zc_norm(qkv.narrow(-1, 2 * q_size, kv_size).reshape({t, kv_heads_, d}), *l.k_norm, eps_);
    q = rotate(q, cos, sin), k = rotate(k, cos, sin);
    const at::Tensor v = qkv.narrow(-1, 2 * q_size + kv_size, kv_size).reshape({t, kv_heads_, d}).contiguous();
    q = q.contiguous(), k = k.contiguous();
    const double k_scale = scales[0], v_scale = scales[1], q_scale = scales[2];
    TORCH_CHECK(q_scale == 0 || (k_cache.scalar_type() == at::kFloat8_e4m3fn && q_scale > 0),
                "full-FP8 attention needs an FP8 KV cache and a positive fp8_q_scale");
    ops.write_kv.call(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
    const at::Tensor out = ops.attention.call(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                              attn_scale_, k_scale, v_scale, q_scale, partition_)
                               .reshape({t, -1});
    return reduce_(
        l.p1(ops, at::mul(out, sigmoid_ref(gate.to(at::kFloat)).to(out.scalar_type())), path, lora, &l.gate_up));
  }

  // PartialRotary.rotate: x * cos + rotate_half(x) * sin on the first rotary_dim features, the rest as they are.
  at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t r = rotary_dim_, half = r / 2;
    const at::Tensor rot = x.narrow(-1, 0, r);
    const at::Tensor rotated = at::cat({at::neg(rot.narrow(-1, half, r - half)), rot.narrow(-1, 0, half)}, -1);
    return at::cat({at::add(at::mul(rot, cos), at::mul(rotated, sin)), x.narrow(-1, r, x.size(-1) - r)}, -1);
  }

  // GatedDeltaNet.forward on a decode step: in_proj_qkv -> causal conv + SiLU (causal_conv1d_batch), z, decay and
  // beta (decay_and_beta), the delta rule on the prepared inputs (kernel_inputs, gdn_recurrent_), the new conv
  // inputs written back, the snapshots taken, the gated norm (gated_rms_norm_ref), out_proj.
  at::Tensor gdn(const Ops& ops, const HybridLayer& l, const at::Tensor& x, const ProjPath& path, bool lora,
                 at::Tensor& conv_pool, at::Tensor& rec_pool, const at::Tensor& slots,
                 const at::Tensor& query_start_loc, const std::vector<Snapshot>& snapshots) const {
    const int64_t t = x.size(0), key_dim = k_heads_ * dk_, value_dim = v_heads_ * dv_;
    const at::Tensor mixed = l.p0(ops, x, path, lora, &l.p1);
    const at::Tensor z = l.p1(ops, x, path, lora, &l.p2).view({t, v_heads_, dv_});
    const at::Tensor a_proj = l.p2(ops, x, path, lora, &l.p3), b_proj = l.p3(ops, x, path, lora, &l.p4);
    const at::Tensor g = at::mul(at::neg(at::exp(l.a_log->to(at::kFloat))),
                                 softplus_ref(at::add(a_proj.to(at::kFloat), *l.dt_bias)));
    const at::Tensor beta = sigmoid_ref(b_proj);
    // causal_conv1d_batch: the K taps summed in tap order in float32, rounded once, SiLU in the model dtype
    const at::Tensor conv_states = conv_pool.index({slots});
    const at::Tensor xs = at::cat({conv_states.to(mixed.scalar_type()), mixed.unsqueeze(2)}, 2);
    const at::Tensor wf = l.conv_weight->to(at::kFloat);
    at::Tensor acc = at::mul(xs.select(2, 0).to(at::kFloat), wf.select(1, 0));
    for (int64_t j = 1; j < conv_k_; ++j) acc = at::add(acc, at::mul(xs.select(2, j).to(at::kFloat), wf.select(1, j)));
    const at::Tensor conv_out = silu_ref(acc.to(mixed.scalar_type()));
    const at::Tensor new_conv = xs.narrow(2, 1, conv_k_ - 1).to(conv_states.scalar_type());
    // kernel_inputs: q, k L2-normalised in float32, q scaled by dk^-1/2, everything float32 and contiguous
    const at::Tensor q = l2norm_ref(conv_out.narrow(-1, 0, key_dim).reshape({t, k_heads_, dk_}).to(at::kFloat));
    const at::Tensor k = l2norm_ref(conv_out.narrow(-1, key_dim, key_dim).reshape({t, k_heads_, dk_}).to(at::kFloat));
    const at::Tensor v = conv_out.narrow(-1, 2 * key_dim, value_dim).reshape({t, v_heads_, dv_});
    auto prepared = [](const at::Tensor& y) { return y.to(at::kFloat).contiguous(); };
    const at::Tensor core = ops_gdn().call(prepared(at::mul(q, std::pow(static_cast<double>(dk_), -0.5))),
                                           prepared(k), prepared(v), prepared(g), prepared(beta), rec_pool, slots,
                                           query_start_loc);
    conv_pool.index_put_({slots}, new_conv);
    for (const Snapshot& s : snapshots) {
      conv_pool.select(0, s.slot).copy_(new_conv.select(0, s.row));
      rec_pool.select(0, s.slot).copy_(rec_pool.select(0, s.source));
    }
    // gated_rms_norm_ref: the norm in float32 rounded to the model dtype, times w, times silu(z) in float32
    const at::Tensor normed = rms_normed(core.to(x.scalar_type()).to(at::kFloat), eps_).to(x.scalar_type());
    const at::Tensor gated = at::mul(at::mul(*l.gdn_norm, normed), silu_ref(z.to(at::kFloat))).to(x.scalar_type());
    return reduce_(l.p4(ops, gated.flatten(1), path, lora, &l.gate_up));
  }

  using GdnOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&, at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&)>;
  static const GdnOp& ops_gdn() {
    static const GdnOp op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                                               const at::Tensor&)>("fp8engine::gdn_recurrent_");
    return op;
  }

  std::vector<HybridLayer> layers_;
  at::Tensor cos_, sin_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, rotary_dim_ = 0, partition_ = 0;
  int64_t k_heads_ = 0, v_heads_ = 0, dk_ = 0, dv_ = 0, conv_k_ = 0, num_linear_ = 0;
  double eps_ = 0, attn_scale_ = 0;
  bool batch_invariant_ = false;
  bool prefetch_next_ = true;
  std::string fp8_gemm_, bf16_gemm_;
  Reduce reduce_;  // tensor parallelism: out_proj's, o_proj's and down_proj's partial sums over the ranks
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.class_<HybridPlan>("HybridPlan")
      .def(torch::init<std::vector<OptTensor>, std::vector<int64_t>, std::vector<int64_t>, at::Tensor, at::Tensor,
                       std::vector<int64_t>, double, double, bool, bool, std::vector<std::string>, bool, std::string,
                       int64_t, bool>())
      .def("num_layers", &HybridPlan::num_layers)
      .def("collective_seconds", &HybridPlan::collective_seconds)
      .def("forward", &HybridPlan::forward);
}
