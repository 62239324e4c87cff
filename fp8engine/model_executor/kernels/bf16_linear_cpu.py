"""CPU BF16 linear: the C++ kernel (csrc/bf16_linear.cpp) for the shapes where it beats torch, torch's
F.linear (its reference) everywhere else, including other devices and dtypes."""

import functools

import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.cpu_ops import load_cpu_ops

# Measured with fp8engine/benchmarks/fp8_linear_micro.py on a 2-core Zen 5 (see use_kernel).
_STREAM_MAX_M = 4  # rows the kernel takes in one pass over the weight
_GEMM_MIN_M = 16  # below this the GEMM path pads M to 16 and loses to torch on wide layers
_GEMM_MAX_WEIGHT = 2**22  # elements; the LM head (28M) re-streams its weight per tile and loses to torch


@functools.cache
def kernel_ops():
    """torch.ops.fp8engine when it holds bf16_linear, else None."""
    ops = load_cpu_ops()
    return ops if ops is not None and hasattr(ops, "bf16_linear") else None


def use_kernel(m: int, n: int, k: int) -> bool:
    """Static choice per shape [M, K] x [N, K]: the kernel streams the weight faster than torch for
    M <= 4 at every size measured (decoder layers 1.3-6x, LM head 1.5x at M=1), and its GEMM beats
    torch from M = 16 on for decoder-sized weights (1.0-1.5x); torch keeps M = 5..15 and large-M LM heads."""
    return m <= _STREAM_MAX_M or (m >= _GEMM_MIN_M and n * k <= _GEMM_MAX_WEIGHT)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias; x: [..., K], weight: [N, K] (read in place), y: [..., N] in x's dtype."""
    n, k = weight.shape
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or weight.stride(-1) != 1 or x.numel() == 0 or not use_kernel(x.numel() // k, n, k)):
        return F.linear(x, weight, bias)
    ops = kernel_ops()
    if ops is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return ops.bf16_linear(x2, weight, bias).reshape(*x.shape[:-1], n)
