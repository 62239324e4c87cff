"""CPU BF16 linear and float32 LM head: the C++ kernels (csrc/bf16_linear.cpp, csrc/lm_head.cpp) for the shapes
where they beat torch, torch's F.linear (their reference) everywhere else. The engine's kernel set
(model_executor/kernel_set.py) binds the GEMM ("avx512" | "amx") and batch invariance into these once."""

import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.layer_ops_ref import float32_linear_ref

# Rows up to which the C++ kernels beat torch's GEMM on AVX-512 alone (the gemv up to 4 rows, then the nt kernel,
# weight rows in the lanes). Measured with every layer's weights from DRAM as in a forward (benchmarks/
# linear_stream.py: the default model's 30 layers, 2 threads of a 2-core Zen 5, ms per forward; docs/cpu-peers.txt):
# at M = 1 8.1 against torch's 16.7, at 8 10.2 vs 12.9, at 32 22.9 vs 27.6 (the head: 1.6 vs 3.5 at 1 row, 5.6 vs
# 6.8 at 32); at 64 they are level for the layers and torch's is faster for the head (8.1 vs 6.7).
_STREAM_MAX_M = 32
# With AMX tiles (an Emerald Rapids Xeon, 1 thread) the kernel's GEMM takes 0.35-0.85x torch's time from M = 2 to
# 128 (default model shapes, weights cache-hot or streamed from L3), 0.9-1.0x at 256 and 1.1-1.2x from 512 on.
_AMX_MAX_M = 256


# torch's GEMM (oneDNN) picks its blocking by shape. Fed one shape only, rows in chunks of this many (the last
# padded with zeros), a row's result cannot depend on the others: every chunk is the same computation, and
# within one a row's sums do not mix with other rows.
BATCH_INVARIANT_ROWS = 64


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   rows: int = BATCH_INVARIANT_ROWS) -> torch.Tensor:
    """F.linear over x [..., K] in chunks of `rows` rows, every call the same shape."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    padded = -(-m // rows) * rows
    if padded != m:
        x2 = torch.cat([x2, x2.new_zeros(padded - m, k)])
    out = torch.empty(padded, weight.shape[0], dtype=x.dtype)
    for start in range(0, padded, rows):
        out[start:start + rows] = F.linear(x2[start:start + rows], weight, bias)
    return out[:m].reshape(*x.shape[:-1], weight.shape[0])


def kernel_takes(m: int, batch_invariant: bool, gemm: str, nt16: bool = False) -> bool:
    """Whether bf16_linear gives m rows to the C++ kernel: every M for a weight in the nt16 layout (which only the
    kernel reads; it hands prefill-sized M to torch itself), when batch invariant (its kernels are, torch's GEMM is
    not) or on AVX2 (no BF16 dot products: torch's GEMM converts and runs 3-5x slower from 4 rows on), else
    decode-sized batches (M <= 32), and up to 256 rows where its GEMM runs on AMX tiles. The decoder plan
    (model_executor/fused_decoder.py) calls the kernel directly, so it runs only where this holds."""
    return nt16 or batch_invariant or gemm == "avx2" or m <= (_AMX_MAX_M if gemm == "amx" else _STREAM_MAX_M)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                batch_invariant: bool = False, gemm: str = "avx512", nt16: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias; x: [..., K] bf16, weight: [N, K] bf16 (read in place), y: [..., N] bf16.

    The C++ kernel where kernel_takes(M), torch's F.linear elsewhere. batch_invariant: the kernel's GEMM for
    every M, whose row results do not depend on the batch (torch picks its blocking by shape). nt16: the weight is
    in the nt16 layout (weights/layout.py): the kernel for every M (without batch_invariant, from prefill-sized M
    it gives torch's GEMM a rows copy of the weight, csrc/bf16_linear.cpp)."""
    n, k = weight.shape
    if nt16:
        x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()
        return torch.ops.fp8engine.bf16_linear(x2, weight, bias, batch_invariant, False, gemm, True).reshape(
            *x.shape[:-1], n)
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.stride(-1) != 1 or x.numel() == 0
            or not kernel_takes(x.numel() // k, batch_invariant, gemm)):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return torch.ops.fp8engine.bf16_linear(x2, weight, bias, batch_invariant, False, gemm).reshape(*x.shape[:-1], n)


# Rows up to which the FMA kernel beats the tiles' split when the batch need not be invariant (the default model's
# head, 2 cores of an Emerald Rapids Xeon: 1.9 vs 3.7 ms at 1 row, 3.1 vs 3.1 at 4, 11.1 vs 3.1 at 16).
FMA_HEAD_MAX_ROWS = 2


def float32_head(x: torch.Tensor, weight: torch.Tensor, split: bool, batch_invariant: bool = False) -> torch.Tensor:
    """float32 logits of hidden x [M, K] against a bf16 weight [V, K] on CPU: the BF16 GEMM on AMX tiles over an
    exact three-way bf16 split of the input (`split`; every row when batch invariant, above FMA_HEAD_MAX_ROWS
    rows otherwise), or the float32 FMA kernel (csrc/lm_head.cpp), each batch invariant on its own."""
    xf = x.float()
    if x.dim() != 2 or weight.stride(-1) != 1:
        return float32_linear_ref(xf, weight)
    if split and weight.dtype == torch.bfloat16 and (batch_invariant or xf.shape[0] > FMA_HEAD_MAX_ROWS):
        return split_float32_linear(xf, weight)
    return torch.ops.fp8engine.lm_head_f32(xf.contiguous(), weight if weight.is_contiguous() else weight.contiguous())


# Rows of the float32 head per call: bounds the bf16 terms (3 x rows x K) a scored prompt stages at once.
SPLIT_ROWS = 256


def split_float32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] bf16 ^T in float32, on AMX tiles.

    x = hi + mid + lo exactly (three bf16 terms of 8 significant bits hold float32's 24, barring underflow
    below 2^-126); a bf16 weight times a bf16 term is exact in float32, and the kernel adds each 32-k step's
    products of the three terms into one float32 running sum per output (csrc/bf16_linear.cpp,
    bf16_linear_terms_f32), in an order that depends only on the row: batch invariant, as accurate as a
    float32 product, at about three times the BF16 head's tile work and its weight traffic."""
    m, k = x.shape
    out = []
    for start in range(0, m, SPLIT_ROWS):
        rows = x[start:start + SPLIT_ROWS]
        r = rows.shape[0]
        terms = torch.zeros(3, -(-r // 16) * 16, k, dtype=torch.bfloat16)
        terms[0, :r] = hi = rows.to(torch.bfloat16)
        rest = rows - hi.float()
        terms[1, :r] = mid = rest.to(torch.bfloat16)
        terms[2, :r] = rest - mid.float()
        out.append(torch.ops.fp8engine.bf16_linear_terms_f32(terms.view(-1, k), weight, 3)[:r])
    if not out:
        return x.new_empty(0, weight.shape[0])
    return out[0] if len(out) == 1 else torch.cat(out)
