"""CPU BF16 linear: the C++ kernel (csrc/bf16_linear.cpp) for the shapes where it beats torch, torch's
F.linear (its reference) everywhere else, including other devices and dtypes (on CUDA with batch_invariant,
the Triton GEMM of dense_triton)."""

import os

import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.cpu_ops import cpu_flags, cpu_kernel, load_cpu_ops

# Rows the kernel takes in one pass over the weight. Measured on a 2-core Zen 5 with every layer's
# weights coming from DRAM, as in a model forward (30 layers of the default model): at M = 1 the
# kernel takes 4.7 ms where torch takes 11.7 (6.9 before it prefetched the next tile's rows), at
# M = 4 8.3 vs 10.0 (before the prefetch); from M = 16 on torch's GEMM wins
# (12.4 vs 18.4 ms at M = 16, 37.8 vs 43.5 at M = 128) although the kernel's GEMM ties or beats it
# when the weights are cache-hot (fp8engine/benchmarks/fp8_linear_micro.py).
_STREAM_MAX_M = 4


# Batch invariant on a CPU with AMX tiles (Sapphire Rapids and later): torch's GEMM (oneDNN) runs on the tile
# unit, several times the C++ kernel's AVX-512 rate from M = 16 up, but picks its blocking by shape. Fed one
# shape only, rows in chunks of this many (the last padded with zeros), a row's result cannot depend on the
# others: every chunk is the same computation, and within one a row's sums do not mix with other rows.
BATCH_INVARIANT_ROWS = 64


def tile_gemm() -> bool:
    """Whether batch-invariant BF16 linears take torch's GEMM in fixed-shape chunks (AMX) instead of the C++
    kernel. FP8ENGINE_BI_GEMM=cpp|chunked overrides the choice."""
    choice = os.environ.get("FP8ENGINE_BI_GEMM")
    if choice in ("cpp", "chunked"):
        return choice == "chunked"
    return {"amx_bf16", "amx_tile"} <= cpu_flags() and torch.backends.mkldnn.is_available()


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   rows: int = BATCH_INVARIANT_ROWS) -> torch.Tensor:
    """F.linear over x [M, K] in chunks of `rows` rows, every call the same shape."""
    m, k = x.shape
    padded = -(-m // rows) * rows
    if padded != m:
        x = torch.cat([x, x.new_zeros(padded - m, k)])
    out = torch.empty(padded, weight.shape[0], dtype=x.dtype)
    for start in range(0, padded, rows):
        out[start:start + rows] = F.linear(x[start:start + rows], weight, bias)
    return out[:m]


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
    batch (torch's GEMM picks its blocking by shape); needs bf16 on a CPU with the kernel. On CUDA: the
    Triton GEMM of dense_triton, one launch for every M."""
    n, k = weight.shape
    if batch_invariant and x.is_cuda:
        from fp8engine.model_executor.kernels.dense_triton import linear_triton
        return linear_triton(x, weight, bias)
    if batch_invariant and x.device.type == "cpu" and x.dtype == torch.bfloat16 and tile_gemm():
        return chunked_linear(x.reshape(-1, k), weight, bias).reshape(*x.shape[:-1], n)
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
