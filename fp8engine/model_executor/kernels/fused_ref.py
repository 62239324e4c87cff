"""Torch references of the fused decoder-layer kernels (kernels/fused_triton.py), rounding where they round: the
model dtype after the residual add, after normalising, after the weight, after each RoPE product and sum, after
silu and after the gate product, then the 1 x 128 E4M3 groups of quant.quantize_activation_groups. A row's sum of
squares in the kernels' order (`sum_pairs`). The unfused CUDA path (layer_ops_ref) rounds at the same points and
differs only in that order and in rsqrt against 1 / sqrt."""

import torch

from fp8engine.weights import quant



def sum_pairs(sq: torch.Tensor) -> torch.Tensor:
    """Each row of sq [..., N] (float32) summed as the kernels sum it: padded with zeros to a power of two, then
    added pairwise, neighbours first."""
    n = sq.shape[-1]
    acc = torch.zeros(*sq.shape[:-1], 1 << (n - 1).bit_length(), dtype=torch.float32)
    acc[..., :n] = sq
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    return acc[..., 0]


def rms_norm_rows(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * round(s * 1 / sqrt(mean(s^2) + eps)) over the last dim, s in the model dtype."""
    sf = s.float()
    inv = 1.0 / torch.sqrt(sum_pairs(sf * sf) / s.shape[-1] + eps)
    return weight * (sf * inv.unsqueeze(-1)).to(s.dtype)


def norm_quant_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   quant_out: bool = True, scale_fmt: str | None = None):
    """fused_triton.norm_quant's (x_q, x_scale, s, normed): x [T, H] in the model dtype or [S, T, H] float32
    partials (added in order, then rounded)."""
    if x.dim() == 3:
        total = x[0]
        for part in x[1:]:
            total = total + part
        x = total.to(weight.dtype)
    s = x if residual is None else x + residual
    normed = rms_norm_rows(s, weight, eps)
    x_q, x_s = quant.quantize_activation_groups(normed, scale_fmt=scale_fmt) if quant_out else (None, None)
    return x_q, x_s, s, normed


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the step's rows cos / sin [T, D]: x * cos + rotate_half(x) * sin in the model dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def qkv_epilogue_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [T, heads, D] as fused_triton.qkv_epilogue computes them (it writes k and v into the cache as
    attention_ref.write_kv_cache_ref would)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm_rows(q, q_norm, eps), rms_norm_rows(k, k_norm, eps)
    return rope_rows(q, cos, sin), rope_rows(k, cos, sin), v.reshape(-1, num_kv_heads, head_dim)


def silu_mul_ref(x: torch.Tensor, quant_out: bool = True, scale_fmt: str | None = None):
    """fused_triton.silu_mul_quant's result: silu(gate) = gate / (1 + exp(-gate)) rounded, times up, rounded."""
    gate, up = x.float().chunk(2, dim=-1)
    h = ((gate / (1 + torch.exp(-gate))).to(x.dtype).float() * up).to(x.dtype)
    return quant.quantize_activation_groups(h, scale_fmt=scale_fmt) if quant_out else (h, None)
