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


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """y [M, N] += (x [M, K] A [R, K]^T) B, with B given transposed (bt [R, N]), in place: the products and the sum in
    float32 and y rounded once (csrc/layer_ops.cpp lora_add_ sums in another order: equal to rounding)."""
    return y.copy_((y.float() + (x.float() @ a.float().T) @ bt.float()).to(y.dtype))


def lora_add_dense(dense_linear, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """lora_add_ref's y as two of the engine's dense linears and an add, over all of A and B (outside the segments
    they hold zeros); on a CPU where the C++ kernel is not built: the products in the model dtype, batch invariant
    where `dense_linear` is."""
    return y.add_(dense_linear(dense_linear(x, a, None), bt.t().contiguous(), None))
