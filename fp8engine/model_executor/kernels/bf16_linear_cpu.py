"""CPU BF16 linear: the C++ kernel (csrc/bf16_linear.cpp) for the shapes where it beats torch, torch's
F.linear (its reference) everywhere else, including other devices and dtypes (on CUDA with batch_invariant,
the Triton GEMM of dense_triton)."""

import functools
import os

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
# With AMX tiles (an Emerald Rapids Xeon, 1 thread) the kernel's GEMM takes 0.35-0.85x torch's time from M = 2 to
# 128 (default model shapes, weights cache-hot or streamed from L3), 0.9-1.0x at 256 and 1.1-1.2x from 512 on.
_AMX_MAX_M = 256


# torch's GEMM (oneDNN) picks its blocking by shape. Fed one shape only, rows in chunks of this many (the last
# padded with zeros), a row's result cannot depend on the others: every chunk is the same computation, and
# within one a row's sums do not mix with other rows.
BATCH_INVARIANT_ROWS = 64
_BI_GEMMS = ("cpp", "chunked")


def chunked_gemm() -> bool:
    """Whether batch-invariant BF16 linears take torch's GEMM in fixed-shape chunks (FP8ENGINE_BI_GEMM=chunked)
    instead of the C++ kernel (FP8ENGINE_BI_GEMM=cpp, the default), whose GEMM runs on AMX tiles where the CPU
    has them and on AVX-512 BF16 elsewhere (FP8ENGINE_BF16_GEMM=amx|avx512 overrides that)."""
    choice = os.environ.get("FP8ENGINE_BI_GEMM", "cpp")
    if choice not in _BI_GEMMS:
        raise ValueError(f"FP8ENGINE_BI_GEMM must be one of {_BI_GEMMS}, got {choice!r}")
    return choice == "chunked"


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


def kernel_gemm() -> str:
    """The GEMM the kernel runs for batch_invariant and large M: "amx" (where the build, CPU and OS allow AMX
    tiles) or "avx512"; FP8ENGINE_BF16_GEMM=amx|avx512 overrides."""
    return _kernel_gemm(os.environ.get("FP8ENGINE_BF16_GEMM"))


@functools.cache
def _kernel_gemm(choice: str | None) -> str:
    return load_cpu_ops().bf16_linear_gemm()


def use_kernel(m: int) -> bool:
    """Static choice by the number of rows: the kernel for M <= 4 (decode), or up to 256 rows where its GEMM
    runs on AMX tiles; torch above."""
    return m <= _STREAM_MAX_M or (m <= _AMX_MAX_M and kernel_gemm() == "amx")


def kernel_takes(m: int, batch_invariant: bool) -> bool:
    """Whether bf16_linear gives a bf16 CPU input of m rows to the C++ kernel (when it is built): batch invariant,
    unless torch's fixed-shape chunks are chosen; otherwise by use_kernel(m). The decoder plan
    (model_executor/fused_decoder.py) calls the kernel directly, so it runs only where this holds."""
    return not chunked_gemm() if batch_invariant else use_kernel(m)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                batch_invariant: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias; x: [..., K], weight: [N, K] (read in place), y: [..., N] in x's dtype.

    batch_invariant: the kernel for every M, on a GEMM whose row results do not depend on the batch (torch's
    picks its blocking by shape), or torch's in fixed-shape chunks (chunked_gemm); needs bf16 on a CPU with
    the kernel. On CUDA: the Triton GEMM of dense_triton, one launch for every M."""
    n, k = weight.shape
    if batch_invariant and x.is_cuda:
        from fp8engine.model_executor.kernels.dense_triton import linear_triton
        return linear_triton(x, weight, bias)
    kernel = cpu_kernel("bf16_linear") if x.device.type == "cpu" else None
    # Chosen, or without the kernel: batch invariance from torch's GEMM in fixed-shape chunks.
    if batch_invariant and x.device.type == "cpu" and x.dtype == torch.bfloat16 and (chunked_gemm() or kernel is None):
        return chunked_linear(x.reshape(-1, k), weight, bias).reshape(*x.shape[:-1], n)
    if (kernel is None or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.stride(-1) != 1
            or x.numel() == 0 or not kernel_takes(x.numel() // k, batch_invariant)):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return kernel(x2, weight, bias, batch_invariant).reshape(*x.shape[:-1], n)


# Rows of the float32 head per call: bounds the bf16 terms (3 x rows x K) a scored prompt stages at once.
SPLIT_ROWS = 256
_FP32_HEADS = ("tiles", "fma")


def split_float32_head() -> bool:
    """Whether the float32 LM head runs on AMX tiles (split_float32_linear) rather than the float32 FMA kernel
    (csrc/lm_head.cpp): where the kernel's GEMM is on tiles, unless FP8ENGINE_FP32_HEAD=fma."""
    choice = os.environ.get("FP8ENGINE_FP32_HEAD", "tiles")
    if choice not in _FP32_HEADS:
        raise ValueError(f"FP8ENGINE_FP32_HEAD must be one of {_FP32_HEADS}, got {choice!r}")
    return choice == "tiles" and cpu_kernel("bf16_linear_terms_f32") is not None and kernel_gemm() == "amx"


def split_float32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] bf16 ^T in float32, on AMX tiles.

    x = hi + mid + lo exactly (three bf16 terms of 8 significant bits hold float32's 24, barring underflow
    below 2^-126); a bf16 weight times a bf16 term is exact in float32, and the kernel adds each 32-k step's
    products of the three terms into one float32 running sum per output (csrc/bf16_linear.cpp,
    bf16_linear_terms_f32), in an order that depends only on the row: batch invariant, as accurate as a
    float32 product, at about three times the BF16 head's tile work and its weight traffic."""
    m, k = x.shape
    kernel = cpu_kernel("bf16_linear_terms_f32")
    out = []
    for start in range(0, m, SPLIT_ROWS):
        rows = x[start:start + SPLIT_ROWS]
        r = rows.shape[0]
        terms = torch.zeros(3, -(-r // 16) * 16, k, dtype=torch.bfloat16)
        terms[0, :r] = hi = rows.to(torch.bfloat16)
        rest = rows - hi.float()
        terms[1, :r] = mid = rest.to(torch.bfloat16)
        terms[2, :r] = rest - mid.float()
        out.append(kernel(terms.view(-1, k), weight, 3)[:r])
    if not out:
        return x.new_empty(0, weight.shape[0])
    return out[0] if len(out) == 1 else torch.cat(out)
