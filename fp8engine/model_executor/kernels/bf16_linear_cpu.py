"""CPU BF16 linear: the C++ kernel (csrc/bf16_linear.cpp) for the shapes where it beats torch, torch's
F.linear (its reference) everywhere else, including other devices and dtypes."""

import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel, load_cpu_ops

# Rows the kernel takes in one pass over the weight. Measured on a 2-core Zen 5 with every layer's
# weights coming from DRAM, as in a model forward (30 layers of the default model): at M = 1 the
# kernel takes 4.7 ms where torch takes 11.7 (6.9 before it prefetched the next tile's rows), at
# M = 4 8.3 vs 10.0 (before the prefetch); from M = 16 on torch's GEMM wins
# (12.4 vs 18.4 ms at M = 16, 37.8 vs 43.5 at M = 128) although the kernel's GEMM ties or beats it
# when the weights are cache-hot (fp8engine/benchmarks/fp8_linear_micro.py).
_STREAM_MAX_M = 4


def kernel_ops():
    """torch.ops.fp8engine when it holds bf16_linear, else None."""
    return load_cpu_ops() if cpu_kernel("bf16_linear") is not None else None


def use_kernel(m: int) -> bool:
    """Static choice by the number of rows: the kernel for M <= 4 (decode), torch above."""
    return m <= _STREAM_MAX_M


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                batch_invariant: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias; x: [..., K], weight: [N, K] (read in place), y: [..., N] in x's dtype.

    batch_invariant: the kernel for every M, on the one path whose row results do not depend on the
    batch (torch's GEMM picks its blocking by shape); needs bf16 on a CPU with the kernel."""
    n, k = weight.shape
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or weight.stride(-1) != 1 or x.numel() == 0 or not (batch_invariant or use_kernel(x.numel() // k))):
        return F.linear(x, weight, bias)
    kernel = cpu_kernel("bf16_linear")
    if kernel is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return kernel(x2, weight, bias, batch_invariant).reshape(*x.shape[:-1], n)
