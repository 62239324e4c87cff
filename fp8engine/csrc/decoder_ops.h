// What a decoder plan (decoder.cpp: dense Llama-family layers; hybrid_decoder.cpp: Qwen3.5 / Qwen3-Next) calls:
// the fp8engine ops looked up once in the dispatcher, and one projection as layers/linear.py runs it.

#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "next_weight.h"

namespace fp8e::plan {

using OptTensor = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The ops a layer calls, looked up once (a plan cannot be built where one is missing, e.g. without AVX-512).
struct Ops {
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const at::Tensor&,
                                                              double)>
      rms_norm = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const at::Tensor&,
                                                            double)>("fp8engine::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, bool,
                                      const OptTensor&, bool, const std::string&, bool)>
      fp8_linear = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, bool,
                                      const OptTensor&, bool, const std::string&, bool)>("fp8engine::fp8_block_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool, bool,
                                      const std::string&, bool)>
      bf16_linear = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool, bool,
                                       const std::string&, bool)>("fp8engine::bf16_linear");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      rotary = find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "fp8engine::rotary_embedding_");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                double, double)>
      write_kv = find_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, double,
                              double)>("fp8engine::write_kv_cache");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, double, double, double, int64_t)>
      attention = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, double, double, double, double, int64_t)>(
          "fp8engine::paged_attention");
  c10::TypedOperatorHandle<void(const at::Tensor&, const OptTensor&, const at::Tensor&, double, at::Tensor&,
                                const OptTensor&)>
      rms_norm_out = find_op<void(const at::Tensor&, const OptTensor&, const at::Tensor&, double, at::Tensor&,
                                  const OptTensor&)>("fp8engine::rms_norm_out");
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor&)> silu_and_mul_out =
      find_op<void(const at::Tensor&, at::Tensor&)>("fp8engine::silu_and_mul_out");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      lora_add = find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&)>("fp8engine::lora_add_");
};

// How a step's projections run, as the engine chose them (kernel_set.py): the GEMM of the FP8 and of the BF16
// kernel, and whether the BF16 layers take the C++ kernel at this step's row count or torch's GEMM
// (bf16_linear_cpu.kernel_takes, decided in Python for each call).
struct ProjPath {
  bool batch_invariant;
  bool nt16;  // the projections' weights (all FP8 or all BF16) are in the nt16 layout (weights/layout.py)
  const std::string& fp8_gemm;
  const std::string& bf16_gemm;
  bool bf16_kernel;
  bool prefetch_next;  // each projection names the next one's weight to its kernel (next_weight.h)
};

// One projection as layers/linear.py calls it: FP8 (weight E4M3 + block scales, optional row -> scale-row map)
// or the model dtype through the BF16 kernel or torch's linear (aten::linear, what F.linear calls); with a LoRA
// adapter loaded (`lora`), y += (x A^T) B^T by the kernel layers/lora.py calls (lora_add_).
struct Proj {
  at::Tensor weight;
  OptTensor scale, bias, scale_rows, lora_a, lora_b, lora_segments;
  bool ue8m0 = false;
  // Whether this weight is in the nt16 layout where the plan's projections differ (a hybrid model's FP8 engine keeps
  // in_proj_a / in_proj_b in the model dtype): -1 the path's `nt16`; 1 in the layout, which only the kernel reads,
  // so the BF16 kernel takes every row count; 0 rows.
  int nt16 = -1;

  // next: the projection the layer runs after this one, whose weight's start the kernel prefetches (next_weight.h)
  // where path.prefetch_next.
  at::Tensor operator()(const Ops& ops, const at::Tensor& x, const ProjPath& path, bool lora, const Proj* next) const {
    const fp8e::NextWeightScope hint(path.prefetch_next && next != nullptr ? &next->weight : nullptr);
    const bool nt = nt16 < 0 ? path.nt16 : nt16 > 0;
    at::Tensor y = scale ? ops.fp8_linear.call(x, weight, *scale, bias, ue8m0, scale_rows, path.batch_invariant,
                                               path.fp8_gemm, nt)
                         : path.bf16_kernel || nt16 > 0 ? ops.bf16_linear.call(x, weight, bias, path.batch_invariant,
                                                                               false, path.bf16_gemm, nt)
                                                        : at::linear(x, weight, bias);
    if (lora && lora_a) ops.lora_add.call(y, x.contiguous(), *lora_a, *lora_b, *lora_segments);
    return y;
  }
};

inline const Ops& get_ops() {
  static const Ops ops;
  return ops;
}

// Whether every op a plan calls is registered (the attention and layer ops need AVX-512, the BF16 linear
// AVX512-BF16); Python builds a plan only then.
inline bool ops_supported() {
  try {
    (void)Ops();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

// A row-parallel projection's partial sums added over the ranks, as tensor_parallel.py's TPGroup.all_reduce adds
// them (the same ops on the same group: the same bits).
class Reduce {
 public:
  Reduce(std::string group, int64_t size, bool fixed_order)
      : group_(std::move(group)), size_(size), fixed_order_(fixed_order) {
    TORCH_CHECK(size_ >= 1 && (size_ == 1 || !group_.empty()), "DecoderPlan: a tensor-parallel group needs a name");
    if (size_ > 1) {
      auto& dispatcher = c10::Dispatcher::singleton();
      all_reduce_ = dispatcher.findSchemaOrThrow("_c10d_functional::all_reduce", "");
      all_gather_ = dispatcher.findSchemaOrThrow("_c10d_functional::all_gather_into_tensor", "");
      wait_ = dispatcher.findSchemaOrThrow("_c10d_functional::wait_tensor", "");
    }
  }

  at::Tensor operator()(const at::Tensor& y) const {
    if (size_ == 1) return y;
    const auto start = std::chrono::steady_clock::now();
    at::Tensor out;
    if (fixed_order_) {  // every rank's y, added in rank order in float32
      const at::Tensor parts = call(*wait_, {call(*all_gather_, {y.contiguous(), size_, group_})});
      const int64_t t = y.size(0);
      at::Tensor total = parts.narrow(0, 0, t).to(at::kFloat);
      for (int64_t r = 1; r < size_; ++r) total.add_(parts.narrow(0, r * t, t));
      out = total.to(y.scalar_type());
    } else {  // the backend's all-reduce, in float32
      out = call(*wait_, {call(*all_reduce_, {y.to(at::kFloat), std::string("sum"), group_})}).to(y.scalar_type());
    }
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return out;
  }

  double seconds() const { return seconds_; }

 private:
  static at::Tensor call(const c10::OperatorHandle& op, std::vector<c10::IValue> args) {
    op.callBoxed(&args);
    return args.at(0).toTensor();
  }

  std::string group_;
  int64_t size_;
  bool fixed_order_;
  std::optional<c10::OperatorHandle> all_reduce_, all_gather_, wait_;
  mutable double seconds_ = 0;
};

}  // namespace fp8e::plan
