"""Token embedding and LM head; both stay in the model dtype (never FP8)."""

import torch
from torch import nn
from torch.nn import functional as F

from fp8engine.model_executor.kernel_set import KernelSet


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in the model dtype, or float32 (kernels.lm_head_fp32: every product and sum in float32, from a
    float32 input); shares its weight with the embedding when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, kernels: KernelSet,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.kernels = kernels

    @property
    def fp32(self) -> bool:
        return self.kernels.lm_head_fp32

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.lm_head(hidden, self.weight)
