"""The C++ layer ops (csrc/layer_ops.cpp) with the signatures of their references in layer_ops_ref.py."""

import torch


def rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = torch.ops.fp8engine.rms_norm(x, residual, weight, eps)
    return out, x if residual is None else summed


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: q and k are rotated where they lie (views into the fused qkv output)."""
    torch.ops.fp8engine.rotary_embedding_(q, k, cos, sin, positions)
    return q, k


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.fp8engine.silu_and_mul(x)


def lora_add_cpu(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                 segments: torch.Tensor) -> torch.Tensor:
    """In place, y [..., N] += (x [..., K] A^T) B, B given transposed (bt [R, N]), by segments (int64 [S, 4]:
    j0, j1, o0, o1 — A and B's rows j0:j1 feed y's columns o0:o1, nothing else); y contiguous (a fresh output)."""
    torch.ops.fp8engine.lora_add_(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(), a, bt, segments)
    return y
