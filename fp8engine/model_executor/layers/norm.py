"""RMSNorm, with the residual add fused in, computed like Hugging Face (float32 statistics); the kernel set's
rms_norm runs it (C++ on CPU, Triton on CUDA when batch invariant; kernels/layer_ops_ref.py is the reference)."""

import torch
from torch import nn

from fp8engine.model_executor.kernel_set import KernelSet


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, kernels: KernelSet):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.kernels = kernels

    def forward_float32(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The normed rows in float32, unrounded (the final norm before a float32 LM head): the residual add
        in the model dtype as in forward, then statistics, normalisation and weight in float32."""
        xf = (x if residual is None else x + residual).float()
        return self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed, new residual): the residual is x + residual, or x itself when there is none."""
        return self.kernels.rms_norm(x, residual, self.weight, self.eps)
