import torch
from torch.nn import functional as F

from fp8engine.model_executor.kernels.cpu_ops import fused_kernel


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up (one C++ pass on CPU; this is its reference)."""
    op = fused_kernel("silu_and_mul", x)
    if op is not None:
        return op(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
