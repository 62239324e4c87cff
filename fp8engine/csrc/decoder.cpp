// The decoder layers of a dense Llama-family model (Llama, Qwen2, Qwen3) in one call from Python.
//
// A layer is the same chain of fp8engine ops that fp8engine/model_executor/models/llama.py calls: RMSNorm
// with the residual, the fused QKV projection, the optional per-head q/k RMSNorm, RoPE in place, the
// KV-cache write, paged attention, o_proj, RMSNorm, gate/up, SiLU-and-mul, down. Each op is called through
// the dispatcher with the arguments the Python layer passes, in the same order (the norms and SiLU-and-mul as
// their _out variants: the same row kernels into reused buffers), so the result is the Python path's bit for
// bit (tests/test_fused_decoder.py); what goes is the Python around them: at batch 1 on a 2-vCPU VM about two
// fifths of a decode step was module calls, attribute lookups and op-call overhead, during which the other
// thread waited.
//
// Under tensor parallelism (model_executor/tensor_parallel.py) each rank's plan holds its shard, and o_proj's and
// down_proj's partial sums are added over the ranks inside the call, as the Python layers' `reduce` adds them: through
// torch's functional collectives on the ranks' gloo group, by its name (_c10d_functional::all_reduce in float32, the
// library's order; or all_gather_into_tensor and a float32 sum in rank order, the batch-invariant one), so the bits
// are the Python path's there too.
//
// A DecoderPlan holds the layers' parameters (the module's own tensors: weight updates write into them in
// place, so the plan sees every update) and the dimensions; the KV caches and scales, which calibration
// and scratch forwards swap, come with each call, and so do the embedding and final norm's tensors for
// forward_tokens (which Python holds the same way).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "decoder_ops.h"

namespace {

using namespace fp8e::plan;

struct Layer {
  at::Tensor input_norm, post_norm;
  OptTensor q_norm, k_norm;
  Proj qkv, o, gate_up, down;
};

// Per layer, `tensors` holds 32 entries: input_layernorm, post_attention_layernorm, q_norm, k_norm weights,
// then (weight, scale, bias, scale_rows, lora_a, lora_b, lora_segments) of qkv_proj, o_proj, gate_up_proj and
// down_proj; None where absent (a BF16 projection has no scale, an engine without LoRA buffers no LoRA tensors).
// dims: heads, kv heads, head_dim, fixed attention partition (0: adaptive).
// gemms: the GEMM of the FP8 and of the BF16 projections ("avx512" | "amx"), as the engine chose them.
// tp: the tensor-parallel group's name, its size (1: no tensor parallelism) and whether partial sums are added in
// rank order (tensor_parallel.fixed_order_sum) or by the library's all-reduce (library_sum).
constexpr int64_t kPerLayer = 32;

class DecoderPlan : public torch::CustomClassHolder {
 public:
  DecoderPlan(std::vector<OptTensor> tensors, at::Tensor cos, at::Tensor sin, std::vector<int64_t> dims, double eps,
              double attn_scale, bool ue8m0, bool batch_invariant, bool nt16, std::vector<std::string> gemms,
              bool prefetch_next, std::string tp_group, int64_t tp_size, bool tp_fixed_order)
      : cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), attn_scale_(attn_scale),
        batch_invariant_(batch_invariant), nt16_(nt16), prefetch_next_(prefetch_next),
        reduce_(std::move(tp_group), tp_size, tp_fixed_order) {
    TORCH_CHECK(gemms.size() == 2, "DecoderPlan: gemms [fp8, bf16] expected");
    fp8_gemm_ = gemms[0], bf16_gemm_ = gemms[1];
    TORCH_CHECK(tensors.size() % kPerLayer == 0 && !tensors.empty(), "DecoderPlan: ", kPerLayer,
                " tensors per layer expected, got ", tensors.size());
    TORCH_CHECK(dims.size() == 4, "DecoderPlan: dims [heads, kv_heads, head_dim, partition] expected");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2], partition_ = dims[3];
    for (size_t i = 0; i < tensors.size(); i += kPerLayer) {
      auto at_ = [&](size_t j) { return tensors[i + j]; };
      auto proj = [&](size_t j) {
        TORCH_CHECK(at_(j).has_value(), "DecoderPlan: a projection weight is missing");
        const bool lora = at_(j + 4).has_value();
        TORCH_CHECK(at_(j + 5).has_value() == lora && at_(j + 6).has_value() == lora,
                    "DecoderPlan: a LoRA adapter's tensors come together");
        return Proj{*at_(j), at_(j + 1), at_(j + 2), at_(j + 3), at_(j + 4), at_(j + 5), at_(j + 6), ue8m0};
      };
      TORCH_CHECK(at_(0).has_value() && at_(1).has_value(), "DecoderPlan: a layer norm weight is missing");
      layers_.push_back(Layer{*at_(0), *at_(1), at_(2), at_(3), proj(4), proj(11), proj(18), proj(25)});
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Seconds spent adding partial sums over the tensor-parallel ranks since the plan was built.
  double collective_seconds() const { return reduce_.seconds(); }

  // x [T, hidden] (the embeddings) -> (output of the last layer, its residual), which the final norm adds.
  // kv_caches: k and v cache of each layer; scales: k, v and q scale of each layer (q 0: not full FP8);
  // bf16_kernel: the BF16 projections (and LoRA products) take the C++ kernel at T rows (else torch's linear);
  // lora: a LoRA adapter is loaded, its products are added.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& positions,
                                             std::vector<at::Tensor> kv_caches, std::vector<double> scales,
                                             const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                             bool bf16_kernel, bool lora) const {
    const int64_t n = num_layers();
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == 2 * n && static_cast<int64_t>(scales.size()) == 3 * n,
                "DecoderPlan.forward: ", 2 * n, " caches and ", 3 * n, " scales expected");
    const Ops& ops = get_ops();
    const ProjPath path{batch_invariant_, nt16_, fp8_gemm_, bf16_gemm_, bf16_kernel, prefetch_next_};
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    // The norms and the activation write into buffers every layer reuses (h: a norm's output, res: the residual
    // stream, updated in place from the second norm on, act: SiLU-and-mul's output), which saves each op its
    // allocations; the first layer's residual is the embeddings x, which stay the caller's.
    const int64_t t = x.size(0), hidden = x.size(1);
    at::Tensor h = at::empty({t, hidden}, x.options()), res = at::empty({t, hidden}, x.options()), act;
    OptTensor residual;
    for (int64_t i = 0; i < n; ++i) {
      const Layer& l = layers_[i];
      if (residual) {
        ops.rms_norm_out.call(x, res, l.input_norm, eps_, h, res);
      } else {
        ops.rms_norm_out.call(x, std::nullopt, l.input_norm, eps_, h, std::nullopt);
        residual = x;
      }
      const at::Tensor qkv = l.qkv(ops, h, path, lora, &l.o);
      at::Tensor q = qkv.narrow(-1, 0, q_size).reshape({t, heads_, head_dim_});
      at::Tensor k = qkv.narrow(-1, q_size, kv_size).reshape({t, kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(-1, q_size + kv_size, kv_size).reshape({t, kv_heads_, head_dim_}).contiguous();
      if (l.q_norm) {
        q = std::get<0>(ops.rms_norm.call(q, std::nullopt, *l.q_norm, eps_));
        k = std::get<0>(ops.rms_norm.call(k, std::nullopt, *l.k_norm, eps_));
      }
      ops.rotary.call(q, k, cos_, sin_, positions);
      const double k_scale = scales[3 * i], v_scale = scales[3 * i + 1], q_scale = scales[3 * i + 2];
      at::Tensor& k_cache = kv_caches[2 * i];
      at::Tensor& v_cache = kv_caches[2 * i + 1];
      TORCH_CHECK(q_scale == 0 || (k_cache.scalar_type() == at::kFloat8_e4m3fn && q_scale > 0),
                  "full-FP8 attention needs an FP8 KV cache and a positive fp8_q_scale");
      ops.write_kv.call(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
      const at::Tensor attn = ops.attention.call(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                 attn_scale_, k_scale, v_scale, q_scale, partition_);
      const at::Tensor o = reduce_(l.o(ops, attn.reshape({t, -1}), path, lora, &l.gate_up));
      ops.rms_norm_out.call(o, *residual, l.post_norm, eps_, h, res);
      residual = res;
      const at::Tensor gate_up = l.gate_up(ops, h, path, lora, &l.down);
      if (!act.defined()) act = at::empty({t, gate_up.size(1) / 2}, x.options());
      ops.silu_and_mul_out.call(gate_up, act);
      x = reduce_(l.down(ops, act, path, lora, i + 1 < n ? &layers_[i + 1].qkv : nullptr));
    }
    return {x, *residual};
  }

  // The model from token ids to its final norm's output [T, hidden]: the embedding lookup (at::embedding, the op
  // F.embedding calls), forward, and the final RMSNorm (rms_norm with the last residual, as RMSNorm.forward calls
  // it) - the ops the Python model runs around the plan, in here to spare a decode step two module calls.
  at::Tensor forward_tokens(const at::Tensor& ids, const at::Tensor& embed, const at::Tensor& final_norm,
                            double final_eps, const at::Tensor& positions, std::vector<at::Tensor> kv_caches,
                            std::vector<double> scales, const at::Tensor& slot_mapping,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            const at::Tensor& block_tables, bool bf16_kernel, bool lora) const {
    const auto [x, residual] = forward(at::embedding(embed, ids), positions, std::move(kv_caches), std::move(scales),
                                       slot_mapping, query_start_loc, seq_lens, block_tables, bf16_kernel, lora);
    return std::get<0>(get_ops().rms_norm.call(x, residual, final_norm, final_eps));
  }

 private:
  std::vector<Layer> layers_;
  at::Tensor cos_, sin_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, partition_ = 0;
  double eps_ = 0, attn_scale_ = 0;
  bool batch_invariant_ = false;
  bool nt16_ = false;
  bool prefetch_next_ = true;
  std::string fp8_gemm_, bf16_gemm_;
  Reduce reduce_;
};

bool decoder_plan_supported() { return ops_supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8engine, m) {
  m.class_<DecoderPlan>("DecoderPlan")
      .def(torch::init<std::vector<OptTensor>, at::Tensor, at::Tensor, std::vector<int64_t>, double, double, bool,
                       bool, bool, std::vector<std::string>, bool, std::string, int64_t, bool>())
      .def("num_layers", &DecoderPlan::num_layers)
      .def("collective_seconds", &DecoderPlan::collective_seconds)
      .def("forward", &DecoderPlan::forward)
      .def("forward_tokens", &DecoderPlan::forward_tokens);
  m.def("decoder_plan_supported() -> bool", TORCH_FN(decoder_plan_supported));
}
