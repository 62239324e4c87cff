"""Token embedding and LM head; both stay in the model dtype (never FP8)."""

import torch
from torch import nn
from torch.nn import functional as F

from fp8engine.model_executor.kernels import bf16_linear_cpu
from fp8engine.model_executor.kernels.bf16_linear_cpu import bf16_linear
from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in the model dtype, or float32 (`fp32`); shares its weight with the embedding when the model
    ties them. `batch_invariant`: a row's logits do not depend on the other rows."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.fp32 = False
        self.batch_invariant = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return lm_head_fp32(hidden, self.weight, self.batch_invariant)
        return bf16_linear(hidden, self.weight, None, self.batch_invariant)


# Rows up to which the FMA kernel beats the tiles' split when the batch need not be invariant (the default model's
# head, 2 cores of an Emerald Rapids Xeon: 1.9 vs 3.7 ms at 1 row, 3.1 vs 3.1 at 4, 11.1 vs 3.1 at 16).
FMA_HEAD_MAX_ROWS = 2


def lm_head_fp32(hidden: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """float32 logits of hidden [M, K] against weight [V, K] in the model dtype, every product and sum in
    float32: on CPU the BF16 GEMM on AMX tiles over an exact three-way bf16 split of the float32 input
    (bf16_linear_cpu.split_float32_linear; with batch_invariant, and above FMA_HEAD_MAX_ROWS rows) or the
    float32 FMA kernel (each batch invariant on its own), the Triton GEMM on CUDA when batch_invariant, torch
    elsewhere."""
    if batch_invariant and hidden.is_cuda:
        from fp8engine.model_executor.kernels.dense_triton import linear_triton
        return linear_triton(hidden, weight, out_dtype=torch.float32)
    x = hidden.float()
    if (hidden.device.type == "cpu" and hidden.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.stride(-1) == 1 and (batch_invariant or x.shape[0] > FMA_HEAD_MAX_ROWS)
            and bf16_linear_cpu.split_float32_head()):
        return bf16_linear_cpu.split_float32_linear(x, weight)
    kernel = cpu_kernel("lm_head_f32") if hidden.device.type == "cpu" else None
    if kernel is None or hidden.dim() != 2:
        return F.linear(x, weight.float())
    return kernel(x.contiguous(), weight if weight.is_contiguous() else weight.contiguous())
