"""Plain torch for the small per-layer ops: the references of csrc/layer_ops.cpp (and, for RMSNorm, of the Triton
kernel in dense_triton.py), computed as Hugging Face computes them (float32 statistics for RMSNorm); and the
float32 LM head's."""

import torch
from torch.nn import functional as F


def rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(s), s) with s = x + residual in x's dtype, or x itself without a residual."""
    s = x if residual is None else x + residual
    sf = s.float()
    return weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype), s


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated by the cos/sin tables [max_positions, D] at positions [T]."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def float32_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T with every product and sum in float32 (the float32 LM head's reference)."""
    return F.linear(x.float(), weight.float())
