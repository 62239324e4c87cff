"""RMSNorm, with the residual add fused in, computed like Hugging Face (float32 statistics).

On CPU the C++ kernel (csrc/layer_ops.cpp) does the add and the norm in one pass; `_norm` is its
reference. On CUDA with `batch_invariant` a Triton kernel does, one program per row (torch's reduction
picks its strategy by the number of rows).
"""

import torch
from torch import nn

from fp8engine.model_executor.kernels.cpu_ops import fused_kernel


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.batch_invariant = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_float32(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The normed rows in float32, unrounded (the final norm before a float32 LM head): the residual add
        in the model dtype as in forward, then statistics, normalisation and weight in float32."""
        xf = (x if residual is None else x + residual).float()
        return self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed, new residual): the residual is x + residual, or x itself when there is none."""
        if self.batch_invariant and x.is_cuda:
            from fp8engine.model_executor.kernels.dense_triton import rms_norm_triton
            return rms_norm_triton(x, residual, self.weight, self.eps)
        op = fused_kernel("rms_norm", x)
        if op is not None and x.dtype == self.weight.dtype:
            out, summed = op(x, residual, self.weight, self.eps)
            return out, x if residual is None else summed
        if residual is None:
            return self._norm(x), x
        residual = x + residual
        return self._norm(residual), residual

