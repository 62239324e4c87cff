// The weight a caller runs next, so that a linear kernel can prefetch the start of it while it finishes its own.
//
// A call's threads each begin on a share of the weight that no prefetch has asked for: at one row, the default
// model's 120 FP8 projections from DRAM took ~4.3 ms of kernel time where the same bytes as two long calls took
// 3.0-3.6 (2 threads of a Zen 4; the rest of the difference is each call's fork and its threads waiting for each
// other at its end). decoder.cpp names each projection's successor (NextWeightScope), and the nt16
// kernels (FP8 and BF16), in each thread's last task, prefetch into L2 the first task that thread takes of it, if
// the next call splits its tasks as this one does (at::parallel_for's static split over the same threads). Batch-1
// decode of the default model, hint against none: in alternating rounds of one process (a temporary switch)
// full-fp8 1.04x, with the FP8 head 1.00-1.09x (median of 6 runs 1.05x), fp8-linear 1.04x, bf16 1.03x, full-fp8-bi
// 1.03x; as separate engines taking turns (benchmarks/decode_side_by_side.py, FP8ENGINE_PREFETCH_NEXT=0 for none,
// 3 runs) full-fp8-head 1.00 / 1.03 / 1.02x, fp8-linear 1.06 / 1.01 / 1.01x; 8 sequences 0.99-1.01x; the same
// tokens. Prefetching two tasks ahead gained no more, three lost. A hint moves no arithmetic: a wrong one costs the
// prefetched lines, nothing else.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace fp8e {

struct NextWeight {
  const char* data = nullptr;  // row r at data + r * row_bytes (rows, or nt16 groups of 16 rows)
  int64_t rows = 0, row_bytes = 0;

  // Where the calling thread of a parallel region starts on this weight when its tasks of task_rows rows are split
  // as at::parallel_for splits them at grain 1; nullptr without a hint or past the end.
  const char* share(int64_t task_rows) const {
    if (data == nullptr) return nullptr;
    const int64_t tasks = (rows + task_rows - 1) / task_rows;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
    const int64_t first = at::get_thread_num() * ((tasks + threads - 1) / threads);
    return first < tasks ? data + first * task_rows * row_bytes : nullptr;
  }
};

// The calling thread's hint: set around a projection by its caller, taken (and so cleared) by the kernel.
inline NextWeight& next_weight_hint() {
  static thread_local NextWeight hint;
  return hint;
}

inline NextWeight take_next_weight() {
  const NextWeight hint = next_weight_hint();
  next_weight_hint() = NextWeight{};
  return hint;
}

// Sets the hint to `next` (none when undefined) for one call on this thread; cleared on the way out either way.
class NextWeightScope {
 public:
  explicit NextWeightScope(const at::Tensor* next) {
    if (next != nullptr && next->defined() && next->dim() == 2)
      next_weight_hint() = NextWeight{static_cast<const char*>(next->data_ptr()), next->size(0),
                                      next->size(1) * static_cast<int64_t>(next->element_size())};
  }
  ~NextWeightScope() { next_weight_hint() = NextWeight{}; }
  NextWeightScope(const NextWeightScope&) = delete;
  NextWeightScope& operator=(const NextWeightScope&) = delete;
};

}  // namespace fp8e
